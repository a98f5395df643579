"""The FP8 weight-only GEMV (cuda_src/gemv_fp8.cu, xserv/ops/gemv_fp8.py; the M <= 8 path of linear_fp8). On the CPU:
the reference against float64 dequantize-then-multiply (partial 128-blocks), the kernel's bit-manipulation e4m3 ->
float conversion re-implemented in NumPy over all 256 codes against ml_dtypes (what catches a wrong sm_80 path),
the launch plan, argument errors, and the family compiling for the five CI arches (also in
tests/runtime/test_compile_all.py, with the rest). On a GPU: fresh random inputs, poisoned outputs, odd and Qwen3-8B shapes,
and the hardware conversion bit-identical to the soft one."""
import ml_dtypes
import numpy as np
import pytest

from xserv.fp8_format import quantize_blockwise, scale_shape
from xserv.ops import gemv_fp8 as F
from xserv.ops.gemv_fp8 import e4m3_to_float_soft, linear_fp8_gemv, linear_fp8_reference, plan
from xserv.runtime.compiler import compile_family, kernel_code_sizes
from xserv.tensor import Tensor, bfloat16, float8_e4m3fn, float32
from xserv.testing import poisoned, random_array, rel_error



def fp8_weight(rng, n, k, std=0.05):
    """A random bf16-ish weight quantized blockwise as the checkpoints are: (e4m3 [n, k], scale_inv float32)."""
    return quantize_blockwise(random_array(rng, (n, k), np.float32, mean=0.0, std=std))


def float64_reference(x, q, s):
    """Dequantize in float64 (no float32 rounding of the product), then multiply."""
    w = q.astype(np.float64)
    s_full = np.repeat(np.repeat(s.astype(np.float64), 128, axis=0), 128, axis=1)[:q.shape[0], :q.shape[1]]
    return x.astype(np.float64) @ (w * s_full).T


# ---- CPU: the reference -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k", [(1, 5, 16), (3, 130, 272), (8, 257, 400), (2, 128, 128), (1, 300, 1040)])
def test_reference_is_dequantize_then_multiply(rng, m, n, k):
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    assert s.shape == scale_shape((n, k))
    got = linear_fp8_reference(x, q, s)
    want = float64_reference(x, q, s)
    assert got.dtype == np.float64 and np.all(np.isfinite(got))
    assert rel_error(got, want) < 1e-6  # only the float32 rounding of each dequantized weight differs


def test_reference_uses_each_partial_blocks_own_scale(rng):
    """N and K not multiples of 128: a wrong block index (or a scale shared across blocks) shows at once."""
    m, n, k = 2, 200, 336
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, _ = fp8_weight(rng, n, k)
    s = (2.0 ** rng.integers(-12, -2, size=scale_shape((n, k)))).astype(np.float32)  # very different per block
    np.testing.assert_allclose(linear_fp8_reference(x, q, s), float64_reference(x, q, s), rtol=1e-6, atol=1e-9)
    s2 = s.copy()
    s2[-1, -1] *= 2  # the corner partial block only: rows >= 128, columns >= 256
    d = linear_fp8_reference(x, q, s2) - linear_fp8_reference(x, q, s)
    assert np.all(d[:, :128] == 0) and np.any(d[:, 128:] != 0)


def test_cpu_op_runs_the_reference(rng):
    m, n, k = 4, 150, 160
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    t = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    out = linear_fp8_gemv(t(x), t(q), t(s), out_dtype=float32)
    assert out.dtype == float32 and out.shape == (m, n)
    np.testing.assert_array_equal(out.array, linear_fp8_reference(x, q, s).astype(np.float32))
    out16 = linear_fp8_gemv(t(x), t(q), t(s))
    assert out16.dtype == bfloat16
    np.testing.assert_array_equal(out16.array, linear_fp8_reference(x, q, s).astype(bfloat16))


# ---- CPU: the kernel's soft e4m3 conversion --------------------------------------------------------------------
def test_soft_conversion_every_code_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    for order in (codes, codes[::-1].copy(), np.roll(codes, 1), np.roll(codes, 2)):  # every code in every byte lane
        got = e4m3_to_float_soft(order)
        ref = order.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # bit for bit, -0 included
    assert np.isnan(want[[0x7F, 0xFF]]).all() and np.isnan(want).sum() == 2  # e4m3fn: NaN = 0x7f / 0xff only


def test_soft_conversion_of_neighbouring_nan_codes():
    """The NaN fix-up works per 16-bit lane: NaN beside finite codes in every position of a word."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=4096, dtype=np.uint8)
    codes[rng.integers(0, 4096, size=600)] = rng.choice([0x7F, 0xFF], size=600).astype(np.uint8)
    got = e4m3_to_float_soft(codes)
    ref = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan], ref[~nan])


# ---- CPU: plan and errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, rows", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_plan_entry_is_the_smallest_fitting(m, rows):
    assert plan(m, 4096, 4096, 132)[0] == f"gemv_fp8_m{rows}"


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5, 16), (1000, 2064)])
def test_plan_is_a_valid_launch(n, k):
    for sms in (1, 78, 132, 170):
        _, split, grid = plan(1, n, k, sms)
        assert split in (1, 2, 4)
        tiles = -(-n // (F.GROUP_ROWS * (F.WARPS // split)))
        assert 1 <= grid <= min(tiles, sms * F.CTAS_PER_SM)
        assert split == 1 or k >= split * 2048  # a warp keeps at least a load step of K


def test_the_family_is_an_fp8_models_piece():
    from xserv.runtime.compiler import family_shapes, piece

    assert F.FAMILY == "gemv_fp8" and family_shapes(F.FAMILY) == {"fp8": (1,)}
    assert piece(F.FAMILY, fp8=1) == "gemv_fp8:f1"


@pytest.mark.slow  # the whole family compiled for sm_90a: tens of CPU-seconds
def test_every_entry_the_launcher_names_is_compiled():
    sizes = kernel_code_sizes(compile_family(F.FAMILY, "sm_90a"))
    for rows in F.ENTRY_ROWS:
        assert f"gemv_fp8_m{rows}" in sizes and f"gemv_fp8_m{rows}_soft" in sizes


def test_errors_name_the_problem(rng):
    t = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    x = t(random_array(rng, (2, 256), bfloat16))
    q, s = fp8_weight(rng, 40, 256)
    w, sc = t(q), t(s)
    with pytest.raises(ValueError, match="weight_fp8: dtype"):
        linear_fp8_gemv(x, t(q.astype(bfloat16)), sc)
    with pytest.raises(ValueError, match="x: dtype"):
        linear_fp8_gemv(t(random_array(rng, (2, 256), np.float32)), w, sc)
    with pytest.raises(ValueError, match="in_features"):
        linear_fp8_gemv(t(random_array(rng, (2, 128), bfloat16)), w, sc)
    with pytest.raises(ValueError, match="multiple of 16"):
        q2, s2 = fp8_weight(rng, 40, 264)
        linear_fp8_gemv(t(random_array(rng, (2, 264), bfloat16)), t(q2), t(s2))
    with pytest.raises(ValueError, match="rows"):
        linear_fp8_gemv(t(random_array(rng, (9, 256), bfloat16)), w, sc)
    with pytest.raises(ValueError, match="scale_inv: shape"):
        linear_fp8_gemv(x, w, t(np.ones((1, 1), np.float32)))
    with pytest.raises(ValueError, match="scale_inv: dtype"):
        linear_fp8_gemv(x, w, t(s.astype(bfloat16)))
    with pytest.raises(ValueError, match="out: dtype"):
        linear_fp8_gemv(x, w, sc, out=Tensor.empty((2, 40), np.float16, "cpu"))
    with pytest.raises(ValueError, match="out: shape"):
        linear_fp8_gemv(x, w, sc, out=Tensor.empty((2, 41), bfloat16, "cpu"))
    with pytest.raises(ValueError, match="conversion"):
        linear_fp8_gemv(x, w, sc, conversion="fast")



# ---- GPU ---------------------------------------------------------------------------------------------------
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate_up, down (N, K)
SHAPES = ([(1, 5120, 2048), (8, 5120, 2048), (1, 1, 16), (3, 37, 48), (5, 1000, 1040), (8, 301, 4112),
           (1, 130, 12304), (2, 129, 2064)] + [(m, n, k) for m in (1, 8) for n, k in QWEN3_8B])


def _run(rng, m, n, k, out_dtype, conversion="auto"):
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    out = poisoned((m, n), out_dtype, "cuda")
    linear_fp8_gemv(Tensor.from_numpy(x, "cuda"), Tensor.from_numpy(q, "cuda"), Tensor.from_numpy(s, "cuda"),
                    out=out, conversion=conversion)
    return out.numpy(), linear_fp8_reference(x, q, s), (x, q, s)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("out_dtype", [float32, bfloat16], ids=["f32", "bf16"])
def test_cuda_linear_fp8_gemv(rng, m, n, k, out_dtype):
    got, want, _ = _run(rng, m, n, k, out_dtype)
    got = got.astype(np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten element?)"
    tol = 1e-5 if out_dtype == float32 else 8e-3
    assert rel_error(got, want) < tol
    assert np.abs(got - want).max() / (np.abs(want).max() + 1e-30) < 4 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 6144, 4096), (8, 300, 1040), (3, 129, 2064)])
def test_cuda_hardware_and_soft_conversions_are_bit_identical(rng, m, n, k):
    """On sm_89+ the plain entries use cvt.rn.f16x2.e4m3x2, the _soft ones the bit manipulation: the same floats,
    the same sums. Run twice: the result does not depend on timing."""
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    args = [Tensor.from_numpy(a, "cuda") for a in (x, q, s)]
    outs = []
    for conversion in ("auto", "soft", "auto"):
        out = poisoned((m, n), float32, "cuda")
        linear_fp8_gemv(*args, out=out, conversion=conversion)
        outs.append(out.numpy())
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert np.array_equal(outs[0].view(np.uint32), outs[2].view(np.uint32))


@pytest.mark.gpu
def test_cuda_every_code_converts(rng):
    """A weight holding all 254 finite codes in every byte lane against a one-hot x: the output is each code's value
    times its scale (both conversions)."""
    k = 256
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 254 finite codes
    q = np.zeros((k, k), np.uint8)
    for j in range(k):
        q[j] = np.roll(np.resize(codes, k), j)
    q = q.view(float8_e4m3fn)
    s = np.full(scale_shape((k, k)), 0.5, np.float32)
    for col in (0, 1, 2, 3, 17, 255):
        x = np.zeros((1, k), np.float32)
        x[0, col] = 1.0
        for conversion in ("auto", "soft"):
            out = poisoned((1, k), float32, "cuda")
            linear_fp8_gemv(Tensor.from_numpy(x.astype(bfloat16), "cuda"), Tensor.from_numpy(q, "cuda"),
                            Tensor.from_numpy(s, "cuda"), out=out, conversion=conversion)
            want = q[:, col].astype(np.float32) * np.float32(0.5)
            np.testing.assert_array_equal(out.numpy()[0], want)
