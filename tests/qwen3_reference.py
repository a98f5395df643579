"""Test helpers: an independent dense NumPy decoder (float64, no paged cache, plain causal attention, Hugging Face
formulas) for Qwen3 and Llama 3, read straight from config.json and the safetensors files, and tiny checkpoint
fixtures shared by the model / engine / LLM / CLI tests."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest


def llama3_inv_freq64(d, theta, factor, low_ff, high_ff, original):
    """Llama 3.1's RoPE scaling as its reference code states it, per frequency in float64: keep wavelengths below
    original / high_ff, divide by factor above original / low_ff, blend linearly in 1 / wavelength between."""
    out = []
    for f in theta ** (-np.arange(0, d, 2) / d):
        wavelen = 2 * math.pi / f
        if wavelen < original / high_ff:
            out.append(f)
        elif wavelen > original / low_ff:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def dense_reference_logits(folder, token_ids) -> np.ndarray:
    """float64 [T, vocab] logits of Qwen3ForCausalLM / LlamaForCausalLM as transformers computes them (without its
    dtype rounding). Qwen3 differs only by its q/k head RMSNorm; Llama 3 may scale RoPE ('llama3')."""
    from xserv.models.checkpoint import CheckpointReader

    cfg = json.loads((Path(folder) / "config.json").read_text())
    qk_norm = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}[cfg["architectures"][0]]
    reader = CheckpointReader(folder)
    eps = cfg["rms_norm_eps"]

    def w(name):
        return np.asarray(reader.get(name), np.float64)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    ids = np.asarray(token_ids)
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or hq
    t, d = len(ids), cfg.get("head_dim") or cfg["hidden_size"] // hq
    rs = cfg.get("rope_scaling")
    if rs is None:
        inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    else:
        assert rs["rope_type"] == "llama3", rs
        inv_freq = llama3_inv_freq64(d, cfg["rope_theta"], rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                                     rs["original_max_position_embeddings"])
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]

    def rotate(x):  # x [T, heads, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    causal = np.tril(np.ones((t, t), bool))
    x = w("model.embed_tokens.weight")[ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = (h @ w(p + "self_attn.q_proj.weight").T).reshape(t, hq, d)
        k = (h @ w(p + "self_attn.k_proj.weight").T).reshape(t, hkv, d)
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(t, hkv, d)
        if qk_norm:
            q, k = rms(q, w(p + "self_attn.q_norm.weight")), rms(k, w(p + "self_attn.k_norm.weight"))
        q, k = rotate(q), rotate(k)
        group = hq // hkv
        out = np.empty((t, hq, d))
        for head in range(hq):
            kh, vh = k[:, head // group], v[:, head // group]
            scores = q[:, head] @ kh.T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[:, head] = probs @ vh
        x = x + out.reshape(t, hq * d) @ w(p + "self_attn.o_proj.weight").T
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        gate, up = h @ w(p + "mlp.gate_proj.weight").T, h @ w(p + "mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "mlp.down_proj.weight").T
    x = rms(x, w("model.norm.weight"))
    head = w("model.embed_tokens.weight") if cfg.get("tie_word_embeddings") else w("lm_head.weight")
    return x @ head.T


def rel_err_rows(out, ref) -> np.ndarray:
    """Relative L2 error of each row (position)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


def write_dequantized_twin(folder: Path, out: Path, dtype=None) -> Path:
    """The twin of an FP8 checkpoint: every quantized tensor dequantized blockwise (weight * weight_scale_inv; dtype
    None: rounded to bf16 as the loader does, np.float32: the exact products), the rest as stored, the config without
    its quantization_config."""
    import shutil

    from xserv.models.checkpoint import CheckpointReader
    from xserv.fp8_format import dequantize_blockwise
    from xserv.models.random_checkpoint import TOKENIZER_FILES, save_safetensors
    from xserv.models.registry import config_from_dict, model_class

    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    c = config_from_dict(config)
    tensors = {}
    with CheckpointReader(folder) as r:
        for w in model_class(c).weight_table(c):
            arr = r.get(w.name)
            if w.quantized:
                tensors[w.name] = dequantize_blockwise(arr, r.get(w.scale_name), w.block, *(() if dtype is None
                                                                                            else (dtype,)))
            else:
                tensors[w.name] = arr.copy() if dtype is None else arr.astype(dtype)
    save_safetensors(out / "model.safetensors", tensors)
    del config["quantization_config"]
    if dtype is not None:
        config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        shutil.copyfile(folder / name, out / name)
    return out


def hf_logits(folder, prompt, dtype, prepare=None) -> tuple[np.ndarray, list[int]]:
    """transformers' logits at every position of one prompt on the GPU (`AutoModelForCausalLM` in `dtype`; prepare:
    called with the loaded model first, e.g. to add hooks), and which of its layers hold experts (a MoE variant's
    layer rule as transformers reads it; [] for a dense model)."""
    import gc

    import torch

    from tools.check_parity import hf_model

    model = hf_model(str(folder), dtype)
    if prepare is not None:
        prepare(model)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device="cuda")).logits[0].float().cpu().numpy()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return logits, sparse


# A module that imports a fixture gets its own copy of it, session scope or not: each checkpoint below is made once
# per test process, whichever modules import its fixture.
_MADE: dict[str, Path] = {}


def _once(name: str, make) -> Path:
    if name not in _MADE:
        _MADE[name] = make()
    return _MADE[name]


@pytest.fixture(scope="session")
def tiny_model_dir():
    from xserv.models.random_checkpoint import bundled_tiny_model

    return bundled_tiny_model()


@pytest.fixture(scope="session")
def perturbed_model_dir(tmp_path_factory):
    """The tiny preset with norms off 1, untied LM head, weights std 0.1 so that every layer moves the logits."""
    from xserv.models.random_checkpoint import make_test_model

    return _once("perturbed", lambda: make_test_model(
        "tiny", tmp_path_factory.mktemp("models") / "tiny-perturbed", seed=3,
        overrides={"tie_word_embeddings": False, "initializer_range": 0.1}, progress=False))


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory):
    """The tiny Llama 3 preset (no head_dim in config.json, llama3 RoPE scaling with a 256-token original context,
    so all three frequency bands occur), untied, weights std 0.1, norms off 1."""
    from xserv.models.random_checkpoint import make_test_model

    return _once("llama", lambda: make_test_model(
        "llama3-tiny", tmp_path_factory.mktemp("models") / "llama3-tiny", seed=5,
        overrides={"tie_word_embeddings": False, "initializer_range": 0.1}, progress=False))
