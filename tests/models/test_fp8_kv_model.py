"""The FP8 KV cache end to end: EngineConfig / CLI, capacity in tokens, and the model with an fp8_e4m3 cache against
the bf16-cache model (NumPy on the CPU; on a GPU the CUDA path against the NumPy one, at 512 and 8,192 tokens).
Kernel-level checks: tests/ops/test_attention_fp8_kv.py."""
import argparse

import numpy as np
import pytest
from qwen3_reference import perturbed_model_dir, rel_err_rows, tiny_model_dir  # noqa: F401

from xserv import LLM, SamplingParams
from xserv.engine.config import EngineConfig
from xserv.engine.kv_cache import KVCache, KVCacheSpec, kv_cache_dtype
from xserv.tensor import bfloat16, float8_e4m3fn

# Logits with an FP8 cache against the bf16 cache, relative L2 per position: e4m3 keeps 3 mantissa bits (up to 2^-4
# relative per K/V element), which reach the logits through every layer. Measured on the CPU at 600 positions: the
# bundled tiny model max 4.6e-2 / mean 1.7e-2, the perturbed one (weights std 0.1, norms off 1: every layer moves the
# logits) max 8.9e-2 / mean 4.3e-2. A wrong scale or a misread block gives errors of order 1.
LOGITS_MAX, LOGITS_MEAN = 1.5e-1, 6e-2


# ---- config and command line -------------------------------------------------------------------------------------
def test_kv_cache_dtype_config_and_cli():
    assert EngineConfig().kv_cache_dtype == "auto" and not EngineConfig().fp8_kv_cache
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").fp8_kv_cache
    for bad in ("fp8", "float8_e4m3fn", None, 8):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype must be one of auto, bfloat16, fp8_e4m3, got {bad!r}"):
            EngineConfig(kv_cache_dtype=bad)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--kv-cache-dtype", "fp8_e4m3"])) == \
        EngineConfig(kv_cache_dtype="fp8_e4m3")
    assert EngineConfig.from_cli_args(p.parse_args([])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp16"])
    assert kv_cache_dtype("auto", bfloat16) == bfloat16 and kv_cache_dtype("bfloat16", bfloat16) == bfloat16
    assert kv_cache_dtype("fp8_e4m3", bfloat16) == float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*, got 'int8'"):
        kv_cache_dtype("int8", bfloat16)


def test_cli_names_a_bad_kv_cache_dtype(capsys):
    from xserv.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "some-model", "--kv-cache-dtype", "e5m2", "--prompt", "x"])
    assert e.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err


# ---- capacity -----------------------------------------------------------------------------------------------------
def test_fp8_token_bytes_are_half_and_the_cuda_pool_holds_about_twice_the_tokens(monkeypatch):
    spec = KVCacheSpec(num_layers=28, num_kv_heads=8, head_dim=128)
    assert spec.bytes_per_token(bfloat16) == 2 * spec.bytes_per_token(float8_e4m3fn) == 2 * 28 * 8 * 128 * 2
    assert spec.scratch_bytes_per_token(bfloat16) == 0
    assert spec.scratch_bytes_per_token(float8_e4m3fn) == 2 * 8 * 128 * 2  # one layer's K and V in bf16

    class Fake:  # the runtime capacity_tokens asks: 10 GiB free, nothing cached
        device = type("D", (), {"memory_info": staticmethod(lambda: (10 << 30, 80 << 30))})()
        allocator = type("A", (), {"stats": type("S", (), {"bytes_cached": 0})()})()

    import xserv.runtime

    monkeypatch.setattr(xserv.runtime, "get_runtime", lambda: Fake())
    bf16 = KVCache.capacity_tokens(spec, bfloat16, 0.5)
    fp8 = KVCache.capacity_tokens(spec, float8_e4m3fn, 0.5)
    assert bf16 == (5 << 30) // spec.bytes_per_token(bfloat16)
    assert fp8 == (5 << 30) // (spec.bytes_per_token(float8_e4m3fn) + spec.scratch_bytes_per_token(float8_e4m3fn))
    assert abs(fp8 / bf16 - 2 * 28 / 30) < 1e-3  # 2 L / (L + 2): twice, less the prefill copy of one layer


def test_cpu_engine_pool_doubles(tiny_model_dir):  # noqa: F811
    a = LLM(str(tiny_model_dir), device="cpu", progress=False, max_model_len=4096, max_num_batched_tokens=512)
    b = LLM(str(tiny_model_dir), device="cpu", progress=False, max_model_len=4096, max_num_batched_tokens=512,
            kv_cache_dtype="fp8_e4m3")
    spec = KVCacheSpec(*a.model.kv_layout, a.kv_cache.block_size)
    assert b.kv_cache.dtype == float8_e4m3fn and a.kv_cache.dtype == bfloat16
    from xserv.engine.config import CPU_KV_BYTES

    want = [min(4 * 4096, max(CPU_KV_BYTES // spec.bytes_per_token(d), 2048)) for d in (bfloat16, float8_e4m3fn)]
    assert [a.kv_cache.num_tokens, b.kv_cache.num_tokens] == [-(-w // 16) * 16 for w in want]
    assert spec.bytes_per_token(bfloat16) == 2 * spec.bytes_per_token(float8_e4m3fn)
    assert b.kv_cache.k_scales[0].numpy().tolist() == [1.0] * spec.num_kv_heads  # the fixed scale (kv_cache.py)


# ---- the model ----------------------------------------------------------------------------------------------------
def _prompt(n, seed=0):
    return list(np.random.default_rng(seed).integers(0, 151936, n))


def test_cpu_fp8_cache_logits_and_greedy_tokens_against_bf16(perturbed_model_dir):  # noqa: F811
    kw = dict(device="cpu", max_model_len=1024, progress=False, max_num_batched_tokens=256)  # chunked: cached K/V read
    bf16, fp8 = LLM(str(perturbed_model_dir), **kw), LLM(str(perturbed_model_dir), kv_cache_dtype="fp8_e4m3", **kw)
    prompt = _prompt(600)
    ref, got = bf16.logits(prompt), fp8.logits(prompt)
    err = rel_err_rows(got, ref)
    print(f"CPU tiny model, 600 positions, fp8 vs bf16 KV: max rel err {err.max():.2e}, mean {err.mean():.2e}")
    assert err.max() <= LOGITS_MAX and err.mean() <= LOGITS_MEAN
    _greedy_agrees(bf16, fp8, [_prompt(50, 1), _prompt(130, 2)])


def _greedy_agrees(ref_llm, llm, prompts, steps=16):
    """llm's greedy tokens equal ref_llm's up to the first near tie (top-2 logits within 5% of the logit scale of
    ref_llm at that step); after a divergence the sequences differ by construction."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ref_logits = ref_llm.logits(prompt + out.token_ids[:-1])[len(prompt) - 1:]
        for i, tok in enumerate(out.token_ids):
            top2 = np.sort(ref_logits[i])[-2:]
            if int(np.argmax(ref_logits[i])) != tok:
                assert top2[1] - top2[0] <= 5e-2 * np.abs(ref_logits[i]).max(), (i, tok)
                break


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The perturbed tiny model with a 16,384-token context (the preset's is 4,096): the 8,192-token case."""
    from xserv.models.random_checkpoint import make_test_model

    return make_test_model("tiny", tmp_path_factory.mktemp("models") / "tiny-long", seed=3, progress=False,
                           overrides={"tie_word_embeddings": False, "initializer_range": 0.1,
                                      "max_position_embeddings": 16384})


@pytest.mark.gpu
@pytest.mark.parametrize("context", [512, 8192])
def test_cuda_fp8_cache_model_against_numpy(long_model_dir, context):
    """CUDA with an FP8 cache against NumPy with an FP8 cache (the same quantization: the kernels' error), and
    against CUDA with a bf16 cache (the format's error), at every position of a `context`-token prompt and in
    greedy decode steps (graphs)."""
    kw = dict(max_model_len=context + 64, progress=False, max_num_batched_tokens=2048)  # 8,192: chunked prefill
    prompt = _prompt(context, context)
    cpu = LLM(str(long_model_dir), device="cpu", kv_cache_dtype="fp8_e4m3", **kw)
    gpu = LLM(str(long_model_dir), device="cuda", kv_cache_dtype="fp8_e4m3", kv_cache_tokens=4 * context, **kw)
    gpu_bf16 = LLM(str(long_model_dir), device="cuda", kv_cache_tokens=4 * context, **kw)
    ref, got, bf = cpu.logits(prompt), gpu.logits(prompt), gpu_bf16.logits(prompt)
    e_np, e_bf = rel_err_rows(got, ref), rel_err_rows(got, bf)
    print(f"context {context}: CUDA fp8 vs NumPy fp8: max {e_np.max():.2e} mean {e_np.mean():.2e}; "
          f"CUDA fp8 vs CUDA bf16 KV: max {e_bf.max():.2e} mean {e_bf.mean():.2e}")
    assert e_np.max() <= 3e-2
    assert e_bf.max() <= LOGITS_MAX and e_bf.mean() <= LOGITS_MEAN
    _greedy_agrees(cpu, gpu, [prompt[:300], prompt[-200:]])
