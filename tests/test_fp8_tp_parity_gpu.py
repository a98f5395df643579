"""FP8 checkpoints (issue 31) and tensor parallelism (issue 32) against transformers float32, on the GPU.

Each test takes xserv's logits at every position of a 1,500-token prompt (`llm.logits`) and compares them, as
relative L2 error per position, with transformers float32; transformers' own bf16 run of the same weights is the
peer, its error printed beside and part of the bound (PEER_FACTOR x the peer's, or the bar, whichever is larger; the
MoE parity test's rule, tests/test_moe_parity_gpu.py, since routing near-ties make a few positions differ in any bf16
run).

FP8: random checkpoints in Qwen's -FP8 layout (a 0.6B-shaped dense one, 4 layers; a MoE one, whose attention
projections stay FP8 and experts are dequantized at load). The reference runs the **dequantized** weights (weight *
weight_scale_inv blockwise, the exact float32 products: a float32 twin checkpoint); the peer is transformers bf16 of
those weights. What xserv computes depends on the device's path (xserv/ops/fp8_linear.py): a 1,500-row prefill is
weight-only below sm_90 (the weights dequantized to bf16; XSERV_ARCH=sm_80 / sm_89 on an H100), held to the issue's
3e-2 per position; on sm_90 and up it is W8A8 (activations rounded to e4m3 per 1 x 128 group, Qwen's dynamic
activation scheme), whose e4m3 rounding noise bf16 does not have: held to the FP8 model test's 1e-1 max / 6e-2 mean
(tests/test_fp8_checkpoint.py), with transformers' own FP8 run of the checkpoint (its fine-grained FP8 W8A8 path,
where this transformers and GPU have it) printed beside as the like-for-like peer.

Tensor parallelism: a 0.6B-shaped checkpoint (4 layers, untied) at tensor_parallel_size 2 against transformers
float32, bar 2e-2 (docs/parity.md's per-position bar for the dense models).
"""
import numpy as np
import pytest

from qwen3_reference import hf_logits, rel_err_rows, write_dequantized_twin

pytestmark = pytest.mark.gpu

PROMPT_LEN = 1500
PEER_FACTOR = 1.5
WEIGHT_ONLY_BAR = (3e-2, 1e-2)  # (max, mean) per position: issue 31's 3e-2
W8A8_BAR = (1e-1, 6e-2)         # tests/test_fp8_checkpoint.py's bounds for the W8A8 path
DENSE_BAR = (2e-2, 1e-2)        # docs/parity.md
SMALL_DENSE = {"num_hidden_layers": 4, "tie_word_embeddings": False, "initializer_range": 0.05,
               "max_position_embeddings": 4096, "max_window_layers": 4}
SMALL_MOE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 2, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4,
             "moe_intermediate_size": 256, "norm_topk_prob": True, "mlp_only_layers": [1],
             "tie_word_embeddings": False, "max_position_embeddings": 4096, "max_window_layers": 4}
FP8_VARIANTS = {"dense-0.6b-shaped": ("0.6b", SMALL_DENSE), "moe": ("moe-tiny", SMALL_MOE)}


@pytest.fixture(scope="module")
def transformers_version():
    pytest.importorskip("torch")
    return pytest.importorskip("transformers").__version__


def _prompt() -> list[int]:
    return np.random.default_rng(1500).integers(0, 151643, PROMPT_LEN).tolist()


def _xserv_logits(folder, prompt, **options) -> np.ndarray:
    from xserv import LLM

    with LLM(str(folder), device="cuda", max_model_len=len(prompt) + 64, kv_cache_tokens=len(prompt) + 1024,
             max_num_seqs=4, progress=False, **options) as llm:
        return llm.logits(prompt)


def _check(what: str, ours, ref, peer, bar) -> None:
    """ours and peer against ref; the bound: PEER_FACTOR x the peer's error or the bar, max and mean each."""
    assert np.all(np.isfinite(ours)), f"{what}: non-finite logits"
    err, err_peer = rel_err_rows(ours, ref), rel_err_rows(peer, ref)
    bound_max, bound_mean = max(PEER_FACTOR * err_peer.max(), bar[0]), max(PEER_FACTOR * err_peer.mean(), bar[1])
    worst = ", ".join(f"{i} ({err[i]:.2e})" for i in np.argsort(err)[::-1][:4])
    print(f"{what}: xserv max {err.max():.3e} mean {err.mean():.3e}; transformers bf16 max {err_peer.max():.3e} "
          f"mean {err_peer.mean():.3e}; bounds {bound_max:.3e} / {bound_mean:.3e}; worst positions {worst}")
    assert err.max() <= bound_max, f"{what}: max {err.max():.3e} > {bound_max:.3e}"
    assert err.mean() <= bound_mean, f"{what}: mean {err.mean():.3e} > {bound_mean:.3e}"


def _transformers_fp8_error(folder, prompt, ref) -> str:
    """transformers running the FP8 checkpoint itself (its fine-grained FP8 integration), for the report only: it
    needs kernels this install or GPU may lack."""
    import torch

    try:
        logits, _ = hf_logits(folder, prompt, torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - a report line, not a requirement
        return f"transformers FP8: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    err = rel_err_rows(logits, ref)
    return f"transformers FP8 (its W8A8) max {err.max():.3e} mean {err.mean():.3e}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_fp8_logits_against_transformers_float32_of_the_dequantized_weights(variant, transformers_version,
                                                                           tmp_path):
    import torch

    from xserv.models.random_checkpoint import make_test_model
    from xserv.ops.fp8_linear import choose_path
    from xserv.runtime import get_device

    preset, overrides = FP8_VARIANTS[variant]
    folder = make_test_model(preset, tmp_path / variant, seed=31, overrides=overrides, fp8=True, progress=False)
    twin = write_dequantized_twin(folder, tmp_path / f"{variant}-f32", np.float32)
    prompt = _prompt()
    ours = _xserv_logits(folder, prompt)
    ref, _ = hf_logits(twin, prompt, torch.float32)
    peer, _ = hf_logits(twin, prompt, torch.bfloat16)
    w8a8 = choose_path(PROMPT_LEN, get_device().arch) == "cublas_fp8"
    print(f"{variant} (transformers {transformers_version}; prefill path {'W8A8' if w8a8 else 'weight-only'}): "
          + _transformers_fp8_error(folder, prompt, ref))
    _check(f"{variant} FP8", ours, ref, peer, W8A8_BAR if w8a8 else WEIGHT_ONLY_BAR)


def _two_gpus() -> bool:
    from xserv.runtime import device_count

    return device_count() >= 2


@pytest.mark.timeout(900)
def test_tp2_logits_against_transformers_float32(transformers_version, tmp_path):
    import torch

    from xserv.models.random_checkpoint import make_test_model

    if not _two_gpus():
        pytest.skip("needs 2 CUDA GPUs")
    folder = make_test_model("0.6b", tmp_path / "tp", seed=32, overrides=SMALL_DENSE, progress=False)
    prompt = _prompt()
    ours = _xserv_logits(folder, prompt, tensor_parallel_size=2)
    ref, _ = hf_logits(folder, prompt, torch.float32)
    peer, _ = hf_logits(folder, prompt, torch.bfloat16)
    _check(f"0.6B-shaped TP=2 (transformers {transformers_version})", ours, ref, peer, DENSE_BAR)
