"""Helpers (not tests) for comparing the hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) with Hugging Face
transformers: build transformers' own class for a checkpoint folder and read its logits, prefill-only or through its
decode path (one token at a time with its cache), and report which kernels it ran on.

transformers picks the class by config.json `architectures[0]` (Qwen3_5ForConditionalGeneration,
Qwen3_5ForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, ...), on CUDA when there is one, else
the CPU. In float32 TF32 is switched off (matmuls and cuDNN's conv1d), so that a float32 run is a float32 run.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np


def transformers_class(folder):
    """transformers' class named by the folder's config.json, or None when this transformers has none."""
    import transformers

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch, None)


def kernel_report() -> dict:
    """Which optional fast paths transformers could take instead of its torch code (flash-linear-attention's GDN
    kernels, causal-conv1d), and whether TF32 is on: a float32 parity figure means little without it."""
    import torch
    from transformers.utils import import_utils

    return {"fla": import_utils.is_flash_linear_attention_available(),
            "causal_conv1d": import_utils.is_causal_conv1d_available(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def hf_model(folder, dtype="float32", device=None):
    """transformers' model of a folder in `dtype` ("float32" or "bfloat16"), eval mode, on `device` (CUDA when
    None and there is one). Raises ValueError when transformers left a text weight unloaded or met a shape it did
    not expect (the vision tower, absent from a text-only random folder, may stay at its initialisation)."""
    import torch

    cls = transformers_class(folder)
    if cls is None:
        raise ValueError(f"this transformers has no class for {folder}/config.json's architecture")
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model, info = cls.from_pretrained(str(folder), dtype=getattr(torch, dtype), output_loading_info=True)
    missing = [k for k in info.get("missing_keys", ()) if ".visual." not in f".{k}" and "lm_head" not in k]
    if missing or info.get("mismatched_keys"):
        raise ValueError(f"transformers did not load {sorted(missing)[:8]} (mismatched: {info.get('mismatched_keys')})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def _release(model):
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_logits(folder, token_ids, dtype="float32", device=None) -> np.ndarray:
    """float64 [T, vocab]: transformers' logits at every position of one sequence in one forward pass (no cache:
    its chunked GDN path from a zero state)."""
    import torch

    model = hf_model(folder, dtype, device)
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)], device=dev), use_cache=False).logits[0]
    logits = out.double().cpu().numpy()
    _release(model)
    return logits


def hf_logits_incremental(folder, token_ids, prefill: int, dtype="float32", device=None) -> np.ndarray:
    """float64 [T, vocab]: transformers' logits with its cache, the first `prefill` tokens in one pass and each
    later one alone (its decode path: the conv-window update and the token-by-token GDN recurrence from the
    cached state, attention against the KV cache)."""
    import torch

    if not 1 <= prefill <= len(token_ids):
        raise ValueError(f"prefill must lie in [1, {len(token_ids)}], got {prefill}")
    model = hf_model(folder, dtype, device)
    dev = next(model.parameters()).device
    ids = list(token_ids)
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([ids[:prefill]], device=dev), use_cache=True)
        rows.append(out.logits[0].double().cpu())
        past = out.past_key_values
        for tok in ids[prefill:]:
            out = model(torch.tensor([[tok]], device=dev), past_key_values=past, use_cache=True)
            rows.append(out.logits[0].double().cpu())
            past = out.past_key_values
    _release(model)
    return torch.cat(rows).numpy()


def rel_err_rows(out, ref) -> np.ndarray:
    """Relative L2 error of each row (position) of out against ref."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


def worst_rows(err, n=4) -> str:
    return ", ".join(f"{i} ({err[i]:.2e})" for i in np.argsort(err)[::-1][:n])
