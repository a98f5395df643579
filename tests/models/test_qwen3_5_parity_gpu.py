"""The float64 Qwen3.5 reference (tests/qwen3_5_reference.py) against Hugging Face transformers' own classes
(Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM, Qwen3NextForCausalLM, Qwen3_5MoeForConditionalGeneration) on
tiny random checkpoints, 300 positions: transformers float32 in one pass (its chunked GDN path) and through its decode
path (200 prompt tokens, then 100 alone: conv-window update, token-by-token recurrence, KV cache); then the reference's
bf16 rounding model against transformers' own bf16 run; then xserv (`xserv_hybrid_logits`, skipped until xserv
loads the architecture) against the reference, with transformers bf16 as the bar.

Bars. float32: every position's relative L2 error at most F32_BAR. Measured on these folders and prompts with
transformers 5.17 float32 on the CPU (torch 2.13, no flash-linear-attention / causal-conv1d; no GPU run yet): max
8.3e-6 (qwen3_5), 1.4e-5 (qwen3_5_text), 4.3e-6 (qwen3_5_real_heads), 1.9e-5 (qwen3_next_moe), 3.3e-5
(qwen3_5_moe), means 1.3e-6 to 2.3e-6, one pass and decode path alike. A float32 run drifts from float64 by float32
roundings (2^-24 relative each, through 4 layers and a 300-step recurrence), so 1e-4 leaves room for cuBLAS's and
the GPU's own summation orders, while anything semantic (a gate on the wrong rows, the wrong value-head sharing, a
decay order, a missing (1 + w)) moves logits by 1e-2 or more. With FLA's kernels or TF32 active (kernel_report()
prints which), 1e-4 may not hold: the failure message says so.
bf16: the reference with bf16_points=True is a model of transformers' bf16 noise, not a copy of it: its mean error
against float64 within a factor BF16_MODEL_FACTOR of transformers bf16's own (on the CPU, same folders, CASES order:
2.24e-2 vs 2.25e-2, 2.07e-2 vs 2.08e-2, 1.79e-2 vs 1.80e-2, 3.97e-2 vs 3.98e-2, 3.28e-2 vs 3.54e-2). Means only: a
MoE routing near-tie flips experts at a few positions in any bf16 run.
xserv: like tests/models/test_moe_parity_gpu.py, max and mean error against the float64 reference at most
PEER_FACTOR x transformers bf16's own, each at least FLOOR.
"""
import json
import shutil

import numpy as np
import pytest

from hybrid_parity import hf_logits, hf_logits_incremental, kernel_report, rel_err_rows, transformers_class, worst_rows
from qwen3_5_reference import TINY_MOE_FIELDS, TINY_TEXT_CONFIG, reference_logits, write_random_folder

pytestmark = pytest.mark.gpu

PROMPT_LEN = 300
PREFILL = 200
F32_BAR = 1e-4
BF16_MODEL_FACTOR = 2.0
PEER_FACTOR = 1.5
FLOOR = 1e-2

_DENSE = {**TINY_TEXT_CONFIG, "num_experts": 0, "vocab_size": 248320, "tie_word_embeddings": True}
_MOE = {**TINY_TEXT_CONFIG, **TINY_MOE_FIELDS, "tie_word_embeddings": False}
# Qwen3.5's own head sizes (attention heads of 256 with RoPE on 64, GDN heads of 128, its mrope sections and theta)
_REAL_HEADS = {**_DENSE, "num_attention_heads": 8, "head_dim": 256, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
# name -> (layout, text config, expert tensors): Qwen3.5's real vocabulary for the Qwen3.5 layouts (tied, as the
# small Qwen3.5 models), Qwen3-Next's for Qwen3-Next (untied, per-expert tensors as released).
CASES = {
    "qwen3_5": ("qwen3_5", _DENSE, "fused"),
    "qwen3_5_text": ("qwen3_5_text", _DENSE, "fused"),
    "qwen3_5_real_heads": ("qwen3_5", _REAL_HEADS, "fused"),
    "qwen3_next_moe": ("qwen3_next", {**_MOE, "vocab_size": 151936}, "per_expert"),
    "qwen3_5_moe": ("qwen3_5_moe", {**_MOE, "vocab_size": 248320}, "fused"),
}


@pytest.fixture(scope="module")
def transformers_version():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.__version__


@pytest.fixture(scope="module")
def parity_folders(tmp_path_factory, transformers_version):
    """Each case's random folder (weights rounded to bf16 values, so that a bf16 run loads exactly the float32
    run's weights) with the prompt and the float64 reference logits; cases whose class this transformers lacks are
    left out (their tests skip)."""
    made = {}
    for i, (name, (layout, cfg, experts)) in enumerate(CASES.items()):
        folder = write_random_folder(tmp_path_factory.mktemp("hybrid") / name, cfg, layout, seed=100 + i,
                                     experts=experts, bf16_values=True)
        if transformers_class(folder) is None:
            continue
        prompt = np.random.default_rng(300 + i).integers(0, cfg["vocab_size"], PROMPT_LEN).tolist()
        made[name] = (folder, prompt, reference_logits(folder, prompt))
    return made


def _case(parity_folders, name):
    if name not in parity_folders:
        pytest.skip(f"transformers has no class for {CASES[name][0]}")
    return parity_folders[name]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_transformers_float32(name, parity_folders, transformers_version):
    folder, prompt, ref = _case(parity_folders, name)
    one_pass = rel_err_rows(hf_logits(folder, prompt), ref)
    stepwise = rel_err_rows(hf_logits_incremental(folder, prompt, PREFILL), ref)
    kernels = kernel_report()
    print(f"{name} (transformers {transformers_version}, {kernels}): one pass max {one_pass.max():.2e} mean "
          f"{one_pass.mean():.2e}, worst {worst_rows(one_pass)}; decode path max {stepwise.max():.2e} mean "
          f"{stepwise.mean():.2e}, worst {worst_rows(stepwise)}")
    note = f" (kernels: {kernels}; FLA or TF32 would explain a small excess)"
    assert one_pass.max() <= F32_BAR, f"one pass: max {one_pass.max():.2e} at {worst_rows(one_pass)}{note}"
    assert stepwise.max() <= F32_BAR, f"decode path: max {stepwise.max():.2e} at {worst_rows(stepwise)}{note}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_points_model_transformers_bf16_noise(name, parity_folders, transformers_version):
    folder, prompt, ref = _case(parity_folders, name)
    ours = rel_err_rows(reference_logits(folder, prompt, bf16_points=True), ref)
    theirs = rel_err_rows(hf_logits(folder, prompt, dtype="bfloat16"), ref)
    print(f"{name}: reference bf16_points mean {ours.mean():.2e} max {ours.max():.2e}; transformers bf16 mean "
          f"{theirs.mean():.2e} max {theirs.max():.2e}")
    assert theirs.mean() / BF16_MODEL_FACTOR <= ours.mean() <= theirs.mean() * BF16_MODEL_FACTOR


# ------------------------------------------------------------------------------------------------ xserv (the lead's)

def xserv_hybrid_logits(folder, token_ids, device="cuda") -> np.ndarray:
    """xserv's logits at every position of one prompt (llm.logits), the folder first given the tokenizer xserv
    bundles for its architecture. Skips while xserv does not load the architecture."""
    from xserv import LLM
    from xserv.models.random_checkpoint import TOKENIZER_FILES, preset_file
    from xserv.models.registry import config_from_dict

    try:
        config = config_from_dict(json.loads((folder / "config.json").read_text()))
        tokenizer = preset_file(config, "tokenizer")
    except ValueError as e:
        pytest.skip(f"xserv does not load {folder.name} yet: {e}")
    for name in TOKENIZER_FILES:
        if not (folder / name).exists():
            shutil.copyfile(tokenizer / name, folder / name)
    with LLM(str(folder), device=device, max_model_len=len(token_ids) + 64, kv_cache_tokens=len(token_ids) + 1024,
             max_num_seqs=4, progress=False) as llm:
        return np.asarray(llm.logits(token_ids), np.float64)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_xserv_matches_reference(name, parity_folders, transformers_version):
    folder, prompt, ref = _case(parity_folders, name)
    ours = xserv_hybrid_logits(folder, prompt)
    assert np.all(np.isfinite(ours))
    err = rel_err_rows(ours, ref)
    peer = rel_err_rows(hf_logits(folder, prompt, dtype="bfloat16"), ref)
    bound_max, bound_mean = max(PEER_FACTOR * peer.max(), FLOOR), max(PEER_FACTOR * peer.mean(), FLOOR)
    print(f"{name}: xserv max {err.max():.2e} mean {err.mean():.2e}, worst {worst_rows(err)}; transformers bf16 max "
          f"{peer.max():.2e} mean {peer.mean():.2e}; bounds {bound_max:.2e} / {bound_mean:.2e}")
    assert err.max() <= bound_max and err.mean() <= bound_mean
