"""The skinny-GEMM kernels (xserv/ops/gemv.py, cuda_src/gemv.cu): every prologue/epilogue against the composition
of the unfused ops' NumPy references, on zero-mean data, poisoned outputs, row counts 1..16 (every compiled M and
the masked rows between them), N not a multiple of a tile, K not a multiple of a warp's sweep, every split count,
the persistent loop over tiles, and K sliced across CTAs."""
import numpy as np
import pytest

from xserv.ops.activation import silu_and_mul
from xserv.ops import gemv as G
from xserv.ops.gemv import (CTAS_PER_SM, add_rounded, gemv_supported, k_slices, linear_add, linear_gemv, plan,
                            rmsnorm_linear, rmsnorm_linear_reference, rmsnorm_linear_silu_mul,
                            rmsnorm_linear_silu_mul_reference, silu_mul_linear_add, silu_mul_linear_reference, MAX_M)
from xserv.ops._launch import cdiv, round_up
from xserv.ops.linear import linear, linear_reference
from xserv.ops.rmsnorm import fused_add_rmsnorm
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import poisoned, random_array, rel_error

EPS = 1e-6


def weights(rng, n, k):
    return random_array(rng, (n, k), bfloat16, mean=0.0, std=0.05)


def close(got, want, tol=2e-2):
    """Relative L2 error and the worst element against the output's scale: a dropped row, chunk or tile moves
    both far past this (the outputs are sums of hundreds of zero-mean products)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten element?)"
    scale = np.abs(want).max() + 1e-30
    assert rel_error(got, want) < tol and np.abs(got - want).max() / scale < 4 * tol


# ---- CPU: the fused ops are the unfused model path -----------------------------------------------------------
def test_cpu_rmsnorm_linear_is_norm_then_linear(rng):
    k, n, t = 64, 40, 5
    residual = random_array(rng, (t, k), np.float32, mean=0.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    w = weights(rng, n, k)
    rows = np.array([4, 0, 2], np.int32)
    # the unfused path: fused_add_rmsnorm over a zero x keeps the residual and normalises it
    res_t = Tensor.from_numpy(residual[rows], "cpu")
    normed = fused_add_rmsnorm(Tensor.zeros((3, k), bfloat16, "cpu"), res_t, Tensor.from_numpy(norm_w, "cpu"), EPS)
    want = linear(normed, Tensor.from_numpy(w, "cpu"), out_dtype=float32).array
    got = rmsnorm_linear(Tensor.from_numpy(residual, "cpu"), Tensor.from_numpy(norm_w, "cpu"), EPS,
                         Tensor.from_numpy(w, "cpu"), rows=Tensor.from_numpy(rows, "cpu"), out_dtype=float32)
    np.testing.assert_array_equal(got.array, want)


def test_cpu_silu_mul_linear_add_is_activation_linear_add(rng):
    i, n, t = 48, 24, 3
    gate_up = random_array(rng, (t, 2 * i), bfloat16, mean=0.0, std=2.0)
    residual = random_array(rng, (t, n), np.float32, mean=0.0)
    w = weights(rng, n, i)
    act = silu_and_mul(Tensor.from_numpy(gate_up, "cpu"))
    hidden = linear(act, Tensor.from_numpy(w, "cpu"))  # bf16, as the unfused decoder writes it
    want = residual + hidden.array.astype(np.float32)
    res_t = Tensor.from_numpy(residual.copy(), "cpu")
    silu_mul_linear_add(Tensor.from_numpy(gate_up, "cpu"), Tensor.from_numpy(w, "cpu"), res_t)
    np.testing.assert_array_equal(res_t.array, want)


def test_cpu_rmsnorm_linear_silu_mul_is_norm_linear_then_activation(rng):
    k, i = 64, 24
    residual = random_array(rng, (1, k), np.float32, mean=0.0, std=2.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    w = Tensor.from_numpy(weights(rng, 2 * i, k), "cpu")
    res_t, norm_t = Tensor.from_numpy(residual, "cpu"), Tensor.from_numpy(norm_w, "cpu")
    gate_up = rmsnorm_linear(res_t, norm_t, EPS, w)  # bf16, as the unfused decoder stores it
    want = silu_and_mul(gate_up).array
    got = rmsnorm_linear_silu_mul(res_t, norm_t, EPS, w)
    assert got.dtype == bfloat16 and got.shape == (1, i)
    np.testing.assert_array_equal(got.array, want)
    with pytest.raises(ValueError, match="one"):
        rmsnorm_linear_silu_mul(Tensor.from_numpy(np.zeros((2, k), np.float32), "cpu"), norm_t, EPS, w)
    with pytest.raises(ValueError, match="even"):
        rmsnorm_linear_silu_mul(res_t, norm_t, EPS, Tensor.from_numpy(weights(rng, 7, k), "cpu"))


def test_cpu_linear_add_and_plain(rng):
    x = random_array(rng, (2, 32), bfloat16, mean=0.0)
    w = weights(rng, 8, 32)
    residual = random_array(rng, (2, 8), np.float32, mean=0.0)
    res_t = Tensor.from_numpy(residual.copy(), "cpu")
    linear_add(Tensor.from_numpy(x, "cpu"), Tensor.from_numpy(w, "cpu"), res_t)
    y = (x.astype(np.float64) @ w.astype(np.float64).T)
    np.testing.assert_allclose(res_t.array, residual + y.astype(np.float32).astype(bfloat16).astype(np.float32),
                               rtol=1e-2, atol=1e-3)
    out = linear_gemv(Tensor.from_numpy(x, "cpu"), Tensor.from_numpy(w, "cpu"))
    np.testing.assert_allclose(out.array.astype(np.float32), y, rtol=2e-2, atol=2e-3)


def test_errors_name_the_problem(rng):
    x = Tensor.from_numpy(random_array(rng, (2, 32), bfloat16), "cpu")
    w = Tensor.from_numpy(weights(rng, 8, 32), "cpu")
    with pytest.raises(ValueError, match="weight"):
        linear_gemv(x, Tensor.from_numpy(weights(rng, 8, 16), "cpu"))
    with pytest.raises(ValueError, match="rows"):
        linear_gemv(Tensor.from_numpy(random_array(rng, (MAX_M + 1, 32), bfloat16), "cpu"), w)
    with pytest.raises(ValueError, match="residual"):
        linear_add(x, w, Tensor.zeros((2, 9), float32, "cpu"))
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_linear(x, Tensor.from_numpy(np.ones(32, bfloat16), "cpu"), EPS, w)
    with pytest.raises(ValueError, match="rows"):
        rmsnorm_linear(Tensor.zeros((3, 32), float32, "cpu"), Tensor.from_numpy(np.ones(32, bfloat16), "cpu"), EPS,
                       w, rows=Tensor.from_numpy(np.array([0, 3], np.int32), "cpu"))
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul_linear_add(Tensor.from_numpy(random_array(rng, (2, 33), bfloat16), "cpu"), w,
                            Tensor.zeros((2, 8), float32, "cpu"))
    # one row stages all of x; more rows slice K, so that every Qwen3 in_features fits 16 of them
    assert gemv_supported(1, 12288) and not gemv_supported(1, 57344) and not gemv_supported(1, 100)
    assert gemv_supported(16, 4096) and gemv_supported(16, 25600) and gemv_supported(2, 57344)


def test_plan_splits_fill_the_sms():
    # few output rows: the warps of a CTA share each row group's K; many: one warp per row group; the grid never
    # exceeds what is resident, and the grid-stride loop covers the other tiles
    assert plan(1, 1024, 132) == ("gemv_row", 128, 4, 256, 1)
    assert plan(2, 6144, 132)[:3] == ("gemv_mma_m8", 256, 8)
    assert plan(4, 24576, 132, k=4096)[2:] == (4, 264, 1)  # 2 would leave 384 tiles on 264 CTAs
    assert plan(1, 6144, 132, k=1024)[2] == 1  # a warp's half of K = 1024 would leave half its loads empty
    # 256 tiles of whole load steps on 264 slots rather than 512 of half-empty ones (ROW_SHORT_K_FILL)
    assert plan(1, 4096, 132, k=1024)[2:4] == (1, 256)
    assert plan(1, 1024, 132, k=2048)[2] == 4  # 128 tiles of split 2 would leave half the slots idle
    # K = 4096 (8B): split 4 makes a tile one load step, on up to 3 CTAs per SM with the RMSNorm
    # prologue (qkv), 4 without (o)
    assert plan(1, 6144, 132, k=4096, normed=True)[2:4] == (4, 396) and plan(1, 4096, 132, k=4096)[2:4] == (4, 528)
    assert plan(1, 4096, 132, k=12288)[2:4] == (2, 264)  # no split makes it one step: 768 tiles, the looping entry
    name, _, split, grid, slices = plan(3, 151936, 132, k=1024)
    assert name == "gemv_mma_m8" and split == 2 and slices == 1 and grid == 132 * CTAS_PER_SM < 151936 / 64
    # the SiLU-and-mul epilogue pairs two row groups per tile: at most 2 warps share K
    assert plan(1, 1024, 132, paired=True)[2] == 2 and plan(1, 24576, 132, paired=True)[2] == 1
    # a warp's share of K within one load step: the _1step entries, up to 3 CTAs per SM with the RMSNorm prologue
    # (0.6B gate/up: its 384 tiles in one round; lm_head: 396 CTAs); longer shares keep 2 CTAs per SM (8B gate/up:
    # split <= 2)
    assert (G.ONE_STEP_CTAS_PER_SM, G.ONE_STEP_PLAIN_CTAS_PER_SM) == (3, 4)
    assert plan(1, 6144, 132, paired=True, k=1024)[2:4] == (1, 384)
    assert plan(1, 151936, 132, k=1024, normed=True)[2:4] == (1, 396)
    assert plan(1, 151936, 132, k=4096, normed=True)[2:4] == (4, 396)
    assert plan(1, 24576, 132, paired=True, k=4096)[2:4] == (1, 264)
    assert G.one_load_step(1024, 1) and not G.one_load_step(1032, 1) and G.one_load_step(4096, 4)


def test_every_row_entry_the_launcher_names_is_compiled():
    """gemv_row has one entry per (prologue, epilogue) the ops use (gemv.cu's XSERV_GEMV_ROW list): the launcher's
    table names exactly those, and every one-row op's combination is in it."""
    import re

    from xserv.runtime.compiler import family_source

    src = family_source("gemv").read_text()
    assert set(G._ROW_ENTRY.values()) == set(re.findall(r"^XSERV_GEMV_ROW\((\w+),", src, re.M))
    p, e = G._PROLOGUE, G._EPILOGUE
    used = {(p["bf16"], e[bfloat16]), (p["bf16"], e[float32]), (p["bf16"], e["add"]), (p["rmsnorm"], e[bfloat16]),
            (p["rmsnorm"], e[float32]), (p["rmsnorm"], e["silu_mul"]), (p["silu_mul"], e["add"])}
    assert used == set(G._ROW_ENTRY)
    assert set(re.findall(r"^XSERV_GEMV_MMA_PLAIN\((\d+), \d\)$", src, re.M)) == {"8", "16"}


def test_k_slices_bound_the_staged_x(monkeypatch):
    """The mma kernel's K slices: none while m rows of K fit STAGE_BYTES; else the fewest whose staged rows do,
    each a multiple of 32 long (the last may be shorter, none empty); the plan deals the grid out to them."""
    monkeypatch.setattr(G, "STAGE_BYTES", 48 * 1024)
    assert k_slices(1, 12288) == (1, 12288) and k_slices(4, 4096) == (1, 4096) and k_slices(2, 8192) == (1, 8192)
    assert k_slices(4, 12288) == (3, 4096)  # 98 KB of x -> 3 slices of 33 KB (2 would be 49.4 KB with the padding)
    assert k_slices(16, 4096) == (3, 1376)  # 131 KB (does not fit at all) -> three of 45 KB
    for m in range(2, MAX_M + 1):
        for k in (8, 64, 1000, 1016, 3072, 4096, 12288, 25600, 57344):
            slices, kc = k_slices(m, k)
            assert kc % 32 == 0 or slices == 1
            assert (slices - 1) * kc < k <= slices * kc
            assert slices == 1 or m * (kc + 32) * 2 <= G.STAGE_BYTES or kc == 32
            assert slices == 1 or m * (round_up(cdiv(k, slices - 1), 32) + 32) * 2 > G.STAGE_BYTES
    name, _, split, grid, slices = plan(4, 4096, 132, k=12288)
    assert (name, slices) == ("gemv_mma_m8", 3) and grid % slices == 0 and grid <= 132 * CTAS_PER_SM
    assert plan(16, 24576, 132, k=4096)[4] == 3
    monkeypatch.setattr(G, "STAGE_BYTES", 1024)  # a budget too small for any slice: 32-value slices, still valid
    assert k_slices(16, 1000) == (32, 32)


@pytest.mark.parametrize("stage_kb", [4, 48, 72, 1 << 20])
def test_plan_is_a_valid_launch(monkeypatch, stage_kb):
    """Every plan the kernels can take: split a power of two dividing the CTA's warps (<= 2 when paired), the grid
    a multiple of the slices and within CTAS_PER_SM per SM (the _1step entries: their CTAs per SM), a sliced warp's
    share of K at least two load steps."""
    monkeypatch.setattr(G, "STAGE_BYTES", stage_kb * 1024)
    for sms in (78, 114, 132):
        for m in (1, 2, 3, 8, 9, 16):
            for n in (5, 1000, 4096, 24576, 151936):
                for k in (64, 1016, 3072, 4096, 12288):
                    if not gemv_supported(m, k):
                        continue
                    name, threads, split, grid, slices = plan(m, n, sms, False, k)
                    warps = threads // 32
                    assert split in (1, 2, 4, 8) and warps % split == 0, (m, n, k, split)
                    assert slices == k_slices(m, k)[0] and grid % slices == 0
                    one_step = m == 1 and G.one_load_step(k, split)
                    per_sm = G.ONE_STEP_PLAIN_CTAS_PER_SM if one_step else CTAS_PER_SM
                    assert slices <= grid <= sms * per_sm or grid == slices
                    if m == 1:  # the RMSNorm prologue's entries: at most 3 CTAs per SM
                        assert plan(m, n, sms, False, k, normed=True)[3] <= sms * max(CTAS_PER_SM, 3)
                    if slices > 1 and split > 1:
                        assert k_slices(m, k)[1] >= 2 * split * 128
                    if m == 1 and n % 2 == 0:  # the SiLU-and-mul epilogue's pairs of row groups
                        _, _, split, grid, _ = plan(m, n, sms, True, k)
                        per_sm = G.ONE_STEP_CTAS_PER_SM if G.one_load_step(k, split) else CTAS_PER_SM
                        assert split in (1, 2) and 1 <= grid <= sms * per_sm


def test_prefer_gemv_follows_the_measured_table():
    """One row: always the GEMV kernel. 2..8 rows: the mma kernel where it measured faster end to end (gemv.md: at
    most 4096 outputs and 16M weights, i.e. the 0.6B qkv, o and down projections and the 8B o), cuBLASLt on the rest
    and from 9 rows."""
    small = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # Qwen3-0.6B
    large = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # Qwen3-8B
    for n, k in [*small.values(), *large.values(), (151936, 1024), (151936, 4096)]:
        assert G.prefer_gemv(1, n, k)
    for m in (2, 4, 8):
        assert [p for p, (n, k) in small.items() if G.prefer_gemv(m, n, k)] == ["qkv", "o", "down"]
        assert [p for p, (n, k) in large.items() if G.prefer_gemv(m, n, k)] == ["o"]
        assert not G.prefer_gemv(m, 151936, 1024)
    assert not any(G.prefer_gemv(m, n, k) for m in (9, 16) for n, k in [*small.values(), *large.values()])
    assert not G.prefer_gemv(17, 1024, 2048) and not G.prefer_gemv(2, 1024, 100)


# ---- GPU: the kernels against the references ---------------------------------------------------------------------
SHAPES = [(1, 1024, 1024), (2, 37, 1000), (3, 3001, 2048), (5, 5003, 64), (8, 1024, 3072), (11, 300, 520),
          (16, 2112, 1024), (1, 70001, 64), (1, 515, 2056), (1, 3001, 4096), (1, 300, 4104), (7, 9000, 1016),
          (4, 1000, 12296), (13, 4099, 4104), (16, 70001, 2568), (1, 2000, 8192)]
# (m, N, K): the one-row kernel and both mma kernels, masked rows, N not a multiple of 16, K not a multiple of 32
# (tail blocks), splits 8/4/2/1, more tiles than CTAs (the grid-stride loop), the one-row RMSNorm prologue with
# the row held in registers (K <= 4096: a thread's last chunk past the row at 2056, four chunks each at 4096) and
# past them (4104: the two-pass prologue), and K sliced across CTAs (the last three: 2 slices each at STAGE_BYTES =
# 72 KB, the last slice shorter and not a multiple of 32, more tiles than a slice's CTAs), and the one-row kernel's
# _1step entries (a warp's share of K within one load step: K <= 1024 * split, as at 1024, 2056 and 4096) and its
# looping entries (4104, and 8192: two load steps a warp, more tiles than CTAs); test_cuda_k_slices_repeatable deals
# K out to many more


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [bfloat16, float32])
def test_cuda_linear_gemv(rng, m, n, k, out_dtype):
    x = random_array(rng, (m, k), bfloat16, mean=0.0)
    w = weights(rng, n, k)
    out = poisoned((m, n), out_dtype)
    linear_gemv(Tensor.from_numpy(x), Tensor.from_numpy(w), out=out)
    close(out.numpy(), linear_reference(x, w).astype(out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_cuda_rmsnorm_linear(rng, m, n, k):
    t = m + 3
    residual = random_array(rng, (t, k), np.float32, mean=0.0, std=3.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    w = weights(rng, n, k)
    rows = rng.permutation(t)[:m].astype(np.int32)
    for row_idx in (rows, None):
        src = residual if row_idx is not None else residual[:m]
        out = poisoned((m, n), float32)
        rmsnorm_linear(Tensor.from_numpy(src), Tensor.from_numpy(norm_w), EPS, Tensor.from_numpy(w), out=out,
                       rows=Tensor.from_numpy(row_idx) if row_idx is not None else None)
        close(out.numpy(), rmsnorm_linear_reference(src, norm_w, EPS, w, row_idx))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_cuda_silu_mul_linear_add(rng, m, n, k):
    gate_up = random_array(rng, (m, 2 * k), bfloat16, mean=0.0, std=2.0)
    residual = random_array(rng, (m, n), np.float32, mean=0.0, std=0.1)
    w = weights(rng, n, k)
    res_t = Tensor.from_numpy(residual)
    silu_mul_linear_add(Tensor.from_numpy(gate_up), Tensor.from_numpy(w), res_t)
    want = add_rounded(residual, silu_mul_linear_reference(gate_up, w))
    close(res_t.numpy() - residual, want - residual)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_cuda_linear_add(rng, m, n, k):
    x = random_array(rng, (m, k), bfloat16, mean=0.0)
    residual = random_array(rng, (m, n), np.float32, mean=0.0, std=0.1)
    w = weights(rng, n, k)
    res_t = Tensor.from_numpy(residual)
    linear_add(Tensor.from_numpy(x), Tensor.from_numpy(w), res_t)
    want = add_rounded(residual, linear_reference(x, w))
    close(res_t.numpy() - residual, want - residual)


@pytest.mark.gpu
def test_cuda_one_step_entries_fit_the_planned_ctas_per_sm():
    """The plan runs up to ONE_STEP_CTAS_PER_SM (RMSNorm prologue) / ONE_STEP_PLAIN_CTAS_PER_SM (the others) CTAs
    of a _1step entry per SM: the compiled entries (gemv.cu's launch bounds) must fit that many at once."""
    from cuda.bindings import driver

    from xserv.runtime import kernel

    for (prologue, _), suffix in G._ROW_ENTRY.items():
        per_sm = G.ONE_STEP_CTAS_PER_SM if prologue == G._PROLOGUE["rmsnorm"] else G.ONE_STEP_PLAIN_CTAS_PER_SM
        func = kernel("gemv", f"gemv_row_{suffix}_1step")._func
        err, fit = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, 128, G._smem(1, 4096))
        assert err == driver.CUresult.CUDA_SUCCESS and fit >= per_sm, (suffix, fit, per_sm)


@pytest.mark.gpu
@pytest.mark.parametrize("i,k", [(3072, 1024), (1001, 1000), (37, 520), (12288, 64), (5, 3072)])
def test_cuda_rmsnorm_linear_silu_mul(rng, i, k):
    """The gate/up projection with the activation in its epilogue: I not a multiple of a tile's 4 or 8 outputs,
    K not a multiple of 32, split 2 and 1, more tiles than CTAs (I = 12288, K = 64), a single tile (I = 5)."""
    residual = random_array(rng, (1, k), np.float32, mean=0.0, std=3.0)
    norm_w = random_array(rng, (k,), bfloat16, mean=1.0, std=0.1)
    w = weights(rng, 2 * i, k)
    out = poisoned((1, i), bfloat16)
    rmsnorm_linear_silu_mul(Tensor.from_numpy(residual), Tensor.from_numpy(norm_w), EPS, Tensor.from_numpy(w),
                            out=out)
    close(out.numpy(), rmsnorm_linear_silu_mul_reference(residual, norm_w, EPS, w))


@pytest.mark.gpu
def test_cuda_matches_cublas_at_decode_shapes(rng):
    """Against an independent implementation (cuBLASLt through `linear`), on Qwen3-8B's qkv shape: the same bf16
    output up to the fp32 summation order."""
    x = random_array(rng, (16, 4096), bfloat16, mean=0.0)
    w = Tensor.from_numpy(weights(rng, 6144, 4096))
    xt = Tensor.from_numpy(x)
    ref = linear(xt, w).numpy()  # 16 rows: cuBLASLt
    for m in (1, 4, 8):
        got = linear_gemv(Tensor.from_numpy(x[:m]), w).numpy()
        close(got, ref[:m], tol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("stage_kb", [48, 4])
def test_cuda_k_slices_repeatable(rng, monkeypatch, stage_kb):
    """K sliced across CTAs: the slices' sums meet in a workspace and the tile's last CTA adds them in slice order,
    so repeated calls give the same bits (and each call finds its tile counters reset: a stale counter would leave
    outputs unwritten, which the poisoned outputs show); a 4 KB budget deals K out to dozens of slices."""
    monkeypatch.setattr(G, "STAGE_BYTES", stage_kb * 1024)
    m, n, k = 16, 4099, 4104
    assert k_slices(m, k)[0] > 1
    x = random_array(rng, (m, k), bfloat16, mean=0.0)
    w = weights(rng, n, k)
    xt, wt = Tensor.from_numpy(x), Tensor.from_numpy(w)
    want = linear_reference(x, w).astype(float32)
    first = None
    for _ in range(3):
        out = poisoned((m, n), float32)
        linear_gemv(xt, wt, out=out)
        got = out.numpy()
        close(got, want)
        if first is None:
            first = got
        np.testing.assert_array_equal(got, first)


@pytest.mark.gpu
def test_cuda_k_slices_in_a_graph(rng):
    """Graph replays reuse the workspace and the counters: every replay writes the whole residual update again."""
    from xserv.runtime.graphs import CUDAGraph
    m, n, k = 8, 1000, 12296
    assert k_slices(m, k)[0] > 1
    x = random_array(rng, (m, k), bfloat16, mean=0.0)
    w = weights(rng, n, k)
    xt, wt = Tensor.from_numpy(x), Tensor.from_numpy(w)
    res = Tensor.zeros((m, n), float32)
    linear_add(xt, wt, res)  # outside the capture first: the workspace exists before the graph records it
    graph = CUDAGraph()
    with graph.capture():
        linear_add(xt, wt, res)
    step = linear_reference(x, w).astype(bfloat16).astype(np.float32)
    for replays in (1, 2):
        graph.replay()
        close(res.numpy(), step * (1 + replays), tol=2e-2)
    graph.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_row_kernels_wait_for_the_gemv_before(rng, graph):
    """The RMSNorm and SiLU-and-mul row kernels launch early after a GEMV (programmatic dependent launch, <= 16
    rows): each must wait for it before reading. The GEMV here streams 25 MB of weights through a long K on few
    CTAs (SMs stay free for the row kernel's CTAs to start early) into rows that start as NaN, so a kernel that read
    them early would give NaN; eagerly and in a graph replay, each result must match its reference on the GEMV's
    final output. (The eager run fails with the waits taken out of rmsnorm.cu and activation.ptx, H200.)"""
    from xserv.ops.activation import silu_and_mul, silu_and_mul_reference
    from xserv.ops.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_reference, rmsnorm, rmsnorm_reference
    from xserv.runtime.graphs import CUDAGraph
    m, n, k = 4, 256, 49152
    x, w = Tensor.from_numpy(random_array(rng, (m, k), bfloat16, mean=0.0)), Tensor.from_numpy(weights(rng, n, k))
    norm_w = random_array(rng, (n,), bfloat16, mean=1.0, std=0.1)
    residual = random_array(rng, (m, n), np.float32, mean=0.0)  # the model's fp32 residual stream
    h, normed, act = (Tensor.empty(shape, bfloat16) for shape in ((m, n), (m, n), (m, n // 2)))
    res_t, norm_t = Tensor.from_numpy(residual), Tensor.from_numpy(norm_w)

    def chain(target):  # a GEMV writing h, then one row kernel reading it
        linear_gemv(x, w, out=h)
        if target == "rmsnorm":
            rmsnorm(h, norm_t, EPS, out=normed)
        elif target == "fused_add_rmsnorm":
            fused_add_rmsnorm(h, res_t, norm_t, EPS, out=normed)
        else:
            silu_and_mul(h, out=act)

    for target in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul"):
        for t in (h, normed, act):
            t.copy_(np.full(t.shape, np.nan, bfloat16))
        res_t.copy_(residual)
        if graph:
            g = CUDAGraph()
            with g.capture():
                chain(target)
            g.replay()
            g.close()
        else:
            chain(target)
        hv = h.numpy()
        close(hv, linear_reference(x.numpy(), w.numpy()))
        if target == "rmsnorm":
            close(normed.numpy(), rmsnorm_reference(hv, norm_w, EPS))
        elif target == "fused_add_rmsnorm":
            want_res, want_out = fused_add_rmsnorm_reference(hv, residual, norm_w, EPS)
            close(res_t.numpy(), want_res)
            close(normed.numpy(), want_out)
        else:
            close(act.numpy(), silu_and_mul_reference(hv))
