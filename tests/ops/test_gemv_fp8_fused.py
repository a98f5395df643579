"""The fused one-token GEMVs on FP8 weights (ops/gemv.py's rmsnorm_linear, linear_add and rmsnorm_linear_silu_mul
taking an Fp8Weight; cuda_src/gemv_fp8.cu's gemv_fp8_row_* entries, gemv_row.cuh's one-row kernel with the e4m3
format). On the CPU: the references are the unfused references composed around linear_fp8_reference (dequantize,
then multiply), the ops run them, power-of-two scales make the FP8 op equal the bf16 op on the dequantized weight
(a wrong scale row would not), the plan, argument errors, the entries compiled. On a GPU: fresh random inputs,
poisoned outputs, odd and Qwen3-8B shapes, one-step and looping entries, the entries' occupancy."""
import numpy as np
import pytest

from xserv.fp8_format import Fp8Weight, dequantize_blockwise, quantize_blockwise
from xserv.ops import gemv as G
from xserv.ops.activation import silu_and_mul_reference
from xserv.ops.gemv import (add_rounded, fp8_row_supported, linear_add, plan, rmsnorm_linear,
                            rmsnorm_linear_reference, rmsnorm_linear_silu_mul, rmsnorm_linear_silu_mul_reference,
                            silu_mul_linear_add)
from xserv.ops.gemv_fp8 import linear_fp8_reference
from xserv.ops.rmsnorm import rmsnorm_reference
from xserv.runtime.compiler import compile_family, kernel_code_sizes
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import poisoned, random_array, rel_error

EPS = 1e-6


def fp8_pair(rng, n, k, pow2=False):
    """(e4m3 [n, k], scale_inv): a random weight quantized blockwise as the checkpoints are; pow2: every scale
    rounded to a power of two and moved by up to 4x either way per block (then each dequantized weight, 4
    significant bits, is exact in bf16, and the blocks' scales differ)."""
    q, s = quantize_blockwise(random_array(rng, (n, k), np.float32, mean=0.0, std=0.05))
    if pow2:
        s = np.exp2(np.round(np.log2(s)) + rng.integers(-2, 3, size=s.shape)).astype(np.float32)
    return q, s


def fp8_weight(pair, device):
    return Fp8Weight(Tensor.from_numpy(pair[0], device), Tensor.from_numpy(pair[1], device))


def norm_inputs(rng, k):
    return (random_array(rng, (1, k), np.float32, mean=0.2, std=3.0),  # the fp32 residual stream
            random_array(rng, (k,), bfloat16, mean=1.0, std=0.1))


def float64_dequantized(pair):
    q, s = pair
    full = np.repeat(np.repeat(s.astype(np.float64), 128, axis=0), 128, axis=1)[:q.shape[0], :q.shape[1]]
    return q.astype(np.float64) * full


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten element?)"
    assert rel_error(got, want) < tol and np.abs(got - want).max() / (np.abs(want).max() + 1e-30) < 4 * tol


# ---- CPU: the references and the ops --------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(37, 272), (300, 1040), (256, 128)])
def test_references_compose_norm_dequantize_multiply(rng, n, k):
    """rmsnorm (the unfused op's rounding) -> bf16 -> x @ (e4m3 * scale)^T in float64; the SiLU-and-mul and the
    residual add on top of it as the unfused ops round."""
    residual, norm_w = norm_inputs(rng, k)
    pair = fp8_pair(rng, 2 * n, k)
    normed = rmsnorm_reference(residual, norm_w, EPS).astype(bfloat16).astype(np.float64)
    want = normed @ float64_dequantized(pair).T
    got = rmsnorm_linear_reference(residual, norm_w, EPS, pair)
    assert got.dtype == np.float64 and rel_error(got, want) < 1e-6
    gate_up = want.astype(bfloat16).astype(np.float32)
    silu = gate_up[:, :n] / (1 + np.exp(-gate_up[:, :n]))
    want_act = (silu.astype(bfloat16).astype(np.float32) * gate_up[:, n:]).astype(bfloat16)
    got_act = rmsnorm_linear_silu_mul_reference(residual, norm_w, EPS, pair)
    assert rel_error(got_act.astype(np.float64), want_act.astype(np.float64)) < 1e-2  # exp rounding at ties
    np.testing.assert_array_equal(got_act, silu_and_mul_reference(got.astype(bfloat16)).astype(bfloat16))


@pytest.mark.parametrize("n, k", [(36, 272), (132, 2064), (512, 4096)])  # n: I of a [2I, K] gate/up weight
def test_cpu_fp8_ops_run_the_references(rng, n, k):
    residual, norm_w = norm_inputs(rng, k)
    pair = fp8_pair(rng, 2 * n, k)
    t = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    w = fp8_weight(pair, "cpu")
    out = rmsnorm_linear(t(residual), t(norm_w), EPS, w)
    assert out.dtype == bfloat16 and out.shape == (1, 2 * n)
    np.testing.assert_array_equal(out.array, rmsnorm_linear_reference(residual, norm_w, EPS, pair).astype(bfloat16))
    act = rmsnorm_linear_silu_mul(t(residual), t(norm_w), EPS, w)
    assert act.shape == (1, n)
    np.testing.assert_array_equal(act.array, rmsnorm_linear_silu_mul_reference(residual, norm_w, EPS, pair))
    x = random_array(rng, (1, k), bfloat16, mean=0.1)
    before = random_array(rng, (1, 2 * n), np.float32, mean=0.0, std=0.1)
    res = t(before.copy())
    linear_add(t(x), w, res)
    np.testing.assert_array_equal(res.array, add_rounded(before, linear_fp8_reference(x, *pair)))


def test_pow2_scales_make_the_fp8_ops_the_bf16_ops_on_the_dequantized_weight(rng):
    """With power-of-two scales the dequantized weight is exact in bf16: the FP8 op and the bf16 op on that weight
    differ only in the sums' precision (float64 vs float32). A scale read from the wrong block row or column (N, K
    past one block, partial edge blocks) moves the outputs by factors of two."""
    n, k = 300, 400
    residual, norm_w = norm_inputs(rng, k)
    pair = fp8_pair(rng, n, k, pow2=True)
    bf16_w = dequantize_blockwise(pair[0], pair[1], out_dtype=np.float32).astype(bfloat16)
    assert np.array_equal(bf16_w.astype(np.float64), float64_dequantized(pair))
    t = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    fp8 = rmsnorm_linear(t(residual), t(norm_w), EPS, fp8_weight(pair, "cpu"), out_dtype=bfloat16).array
    bf16 = rmsnorm_linear(t(residual), t(norm_w), EPS, t(bf16_w), out_dtype=bfloat16).array
    close(fp8, bf16, 1e-2)
    wrong = (pair[0], pair[1][::-1].copy())  # block rows swapped
    assert rel_error(rmsnorm_linear_reference(residual, norm_w, EPS, wrong), bf16.astype(np.float64)) > 0.1


def test_errors_name_the_problem(rng):
    t = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    residual, norm_w = norm_inputs(rng, 256)
    w = fp8_weight(fp8_pair(rng, 40, 256), "cpu")
    with pytest.raises(ValueError, match="one row"):
        rmsnorm_linear(t(np.repeat(residual, 2, 0)), t(norm_w), EPS, w)
    with pytest.raises(ValueError, match="one row"):
        linear_add(t(random_array(rng, (2, 256), bfloat16)), w, t(np.zeros((2, 40), np.float32)))
    with pytest.raises(ValueError, match="out: dtype .*bfloat16"):
        rmsnorm_linear(t(residual), t(norm_w), EPS, w, out_dtype=float32)
    with pytest.raises(ValueError, match="bf16 weights only"):
        silu_mul_linear_add(t(random_array(rng, (1, 512), bfloat16)), w, t(np.zeros((1, 40), np.float32)))
    with pytest.raises(ValueError, match="rows a multiple of 8"):
        rmsnorm_linear_silu_mul(t(residual), t(norm_w), EPS, fp8_weight(fp8_pair(rng, 36, 256), "cpu"))
    res264, norm264 = norm_inputs(rng, 264)
    with pytest.raises(ValueError, match="multiple of 16"):
        rmsnorm_linear(t(res264), t(norm264), EPS, fp8_weight(fp8_pair(rng, 40, 264), "cpu"))
    bad = object.__new__(Fp8Weight)  # past the dataclass's own check: scales of the wrong shape
    object.__setattr__(bad, "weight", w.weight)
    object.__setattr__(bad, "scale_inv", t(np.ones((1, 1), np.float32)))
    with pytest.raises(ValueError, match="scale_inv: shape"):
        rmsnorm_linear(t(residual), t(norm_w), EPS, bad)
    assert fp8_row_supported(24576, 4096, paired=True) and not fp8_row_supported(36, 256, paired=True)
    assert fp8_row_supported(36, 256) and not fp8_row_supported(40, 264) and not fp8_row_supported(40, 0)


# ---- CPU: the plan and the entries ----------------------------------------------------------------------------
QWEN3_8B = {"qkv": (6144, 4096, False, True), "o": (4096, 4096, False, False),
            "gate_up": (24576, 4096, True, True), "down": (4096, 12288, False, False)}  # N, K, paired, normed


@pytest.mark.parametrize("sms", [1, 78, 132, 170])
@pytest.mark.parametrize("n, k, paired", [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True),
                                          (4096, 12288, False), (37, 272, False), (8, 16, True), (1000, 8208, False)])
def test_fp8_plan_is_a_valid_launch(sms, n, k, paired):
    name, threads, split, grid, slices = plan(1, n, sms, paired, k, paired, fp8=True)
    assert name == "gemv_fp8_row" and threads == 128 and slices == 1 and split in ((1, 2) if paired else (1, 2, 4))
    outputs = n // 2 if paired else n
    tiles = -(-outputs // (4 * (4 // split) // (2 if paired else 1)))
    one_step = G.one_load_step(k, split, fp8=True)
    assert one_step == (k <= 2048 * split)
    per_sm = (G.ONE_STEP_CTAS_PER_SM if paired else G.ONE_STEP_PLAIN_CTAS_PER_SM) if one_step else G.CTAS_PER_SM
    assert 1 <= grid <= min(tiles, sms * per_sm)


def test_fp8_plan_takes_one_step_tiles_where_the_warps_allow():
    """FP8_PREFER_ONE_STEP: the 8B's qkv, o and gate/up (K = 4096) run one-step tiles (a warp's half of K is one
    load step of 2048 e4m3); the down projection (K = 12288: 3072 values a warp at split 4) loops. Without it, the
    fewest splits that fill the SMs."""
    for proj, (n, k, paired, normed) in QWEN3_8B.items():
        split = plan(1, n, 132, paired, k, normed, fp8=True)[2]
        assert G.one_load_step(k, split, fp8=True) == (proj != "down"), (proj, split)
    try:
        G.FP8_PREFER_ONE_STEP = False
        n, k, paired, normed = QWEN3_8B["gate_up"]
        assert not G.one_load_step(k, plan(1, n, 132, paired, k, normed, fp8=True)[2], fp8=True)
    finally:
        G.FP8_PREFER_ONE_STEP = True
    with pytest.raises(ValueError, match="one row"):
        plan(2, 4096, 132, k=4096, fp8=True)


@pytest.mark.slow  # the whole family compiled for sm_90a: tens of CPU-seconds
def test_every_fp8_row_entry_the_launcher_names_is_compiled():
    sizes = kernel_code_sizes(compile_family("gemv_fp8", "sm_90a"))
    names = [name for name in G._PIECES if name.startswith("gemv_fp8_row_")]
    assert len(names) == 2 * len(G._FP8_ROW_ENTRIES)
    for name in names:
        assert name in sizes and G._PIECES[name] == "gemv_fp8:f1", name


# ---- GPU ------------------------------------------------------------------------------------------------------
# (N, K): N not a multiple of a tile's rows or of 128 (partial scale blocks), K from one chunk (16) to the 8B's down
# projection; one-step tiles (K <= 2048 * split: 16 .. 4096) and looping ones (8208, 12288: several load steps a
# warp), more tiles than CTAs (24576), the RMSNorm prologue's held row (K <= 4096) and its two passes (8208, 12288).
SHAPES = [(37, 16), (130, 272), (1000, 1040), (301, 2064), (5, 4096), (4099, 8208), (6144, 4096), (4096, 4096),
          (4096, 12288), (24576, 4096)]
IDS = ["x".join(map(str, s)) for s in SHAPES]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", SHAPES, ids=IDS)
def test_cuda_fp8_rmsnorm_linear(rng, n, k):
    t = 3
    residual = random_array(rng, (t, k), np.float32, mean=0.2, std=3.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    pair = fp8_pair(rng, n, k)
    row = np.array([2], np.int32)
    for rows, src in ((None, residual[:1]), (row, residual)):
        out = poisoned((1, n), bfloat16)
        rmsnorm_linear(Tensor.from_numpy(src), Tensor.from_numpy(norm_w), EPS, fp8_weight(pair, "cuda"), out=out,
                       rows=None if rows is None else Tensor.from_numpy(rows))
        close(out.numpy(), rmsnorm_linear_reference(src, norm_w, EPS, pair, rows).astype(bfloat16), 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", SHAPES, ids=IDS)
def test_cuda_fp8_linear_add(rng, n, k):
    x = random_array(rng, (1, k), bfloat16, mean=0.1)
    residual = random_array(rng, (1, n), np.float32, mean=0.0, std=0.1)
    pair = fp8_pair(rng, n, k)
    res_t = Tensor.from_numpy(residual)
    linear_add(Tensor.from_numpy(x), fp8_weight(pair, "cuda"), res_t)
    close(res_t.numpy() - residual, add_rounded(residual, linear_fp8_reference(x, *pair)) - residual, 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("i, k", [(12, 16), (300, 272), (1004, 1040), (12288, 4096), (3072, 8208), (4, 12288)])
def test_cuda_fp8_rmsnorm_linear_silu_mul(rng, i, k):
    """Gate and up row groups paired in a tile (I not a multiple of a tile's outputs or of 128: an up group starts
    mid-block), one-step (split 2) and looping tiles, a single tile (I = 4)."""
    residual = random_array(rng, (1, k), np.float32, mean=0.2, std=3.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    pair = fp8_pair(rng, 2 * i, k)
    out = poisoned((1, i), bfloat16)
    rmsnorm_linear_silu_mul(Tensor.from_numpy(residual), Tensor.from_numpy(norm_w), EPS, fp8_weight(pair, "cuda"),
                            out=out)
    close(out.numpy(), rmsnorm_linear_silu_mul_reference(residual, norm_w, EPS, pair), 2e-2)


@pytest.mark.gpu
def test_cuda_fp8_row_equals_the_plain_fp8_gemv_on_the_same_x(rng, monkeypatch):
    """The row kernel's chunk arithmetic is gemv_fp8_m1's (16 fmaf, then the scale): at the same split, the fp32
    sums of a plain bf16 x are bit-identical. linear_add on a zero residual stores bf16(acc) as fp32; the plain
    kernel stores bf16(acc)."""
    from xserv.ops import gemv_fp8 as F
    from xserv.ops.gemv_fp8 import linear_fp8_gemv

    n, k = 1000, 4096
    x = random_array(rng, (1, k), bfloat16, mean=0.1)
    pair = fp8_pair(rng, n, k)
    split = plan(1, n, 132, k=k, fp8=True)[2]
    monkeypatch.setattr(F, "plan", lambda m, n_, k_, sms: ("gemv_fp8_m1", split, min(sms * 2, -(-n_ // (16 // split)))))
    plain = poisoned((1, n), bfloat16)
    linear_fp8_gemv(Tensor.from_numpy(x), *(Tensor.from_numpy(a) for a in pair), out=plain)
    res = Tensor.from_numpy(np.zeros((1, n), np.float32))
    linear_add(Tensor.from_numpy(x), fp8_weight(pair, "cuda"), res)
    if G.get_device().info.multiprocessor_count == 132:  # the split above is the device's
        np.testing.assert_array_equal(res.numpy(), plain.numpy().astype(np.float32))
    close(res.numpy(), linear_fp8_reference(x, *pair).astype(bfloat16), 8e-3)


@pytest.mark.gpu
def test_cuda_fp8_one_step_entries_fit_the_planned_ctas_per_sm():
    """As the bf16 _1step entries (test_gemv.py): the FP8 ones must fit the CTAs per SM the plan runs."""
    from cuda.bindings import driver

    from xserv.runtime import kernel

    for entry in G._FP8_ROW_ENTRIES:
        per_sm = G.ONE_STEP_CTAS_PER_SM if entry.startswith("rmsnorm") else G.ONE_STEP_PLAIN_CTAS_PER_SM
        func = kernel(G._PIECES[f"gemv_fp8_row_{entry}_1step"], f"gemv_fp8_row_{entry}_1step")._func
        err, fit = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, 128, G._smem(1, 4096))
        assert err == driver.CUresult.CUDA_SUCCESS and fit >= per_sm, (entry, fit, per_sm)
