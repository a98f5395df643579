"""linear_fp8 (xserv/ops/fp8_linear.py) and its conversions (ops/fp8_quant.py, cuda_src/fp8.cu).

CPU: the references (1x128 activation quantization against an independent float64 construction, every group's
scale and saturation; the bf16 dequantization against fp8.py), the dispatch rule, the scratch's sizing, the compile
keys (fp8=1 only for a quantized config), argument errors, and the family compiling for the CI arches. GPU
(`-m gpu`): each path against the dequantize-then-multiply reference on fresh random inputs (mean off 0), outputs
poisoned, odd shapes (N, K not multiples of 128; M = 9, 17, 300), both large-M paths forced on one GPU, the
quantize / dequantize kernels bit for bit against their references (the VEC128 scale layout is checked through the
GEMM: a wrong layout gives a wrong product), a preallocated scratch reused under CUDA-graph capture."""
import ml_dtypes
import numpy as np
import pytest

from xserv.fp8_format import dequantize_blockwise, quantize_blockwise, scale_shape
from xserv.ops import fp8_quant as Q
from xserv.ops.fp8_linear import Fp8Scratch, choose_path, linear_fp8, linear_fp8_reference
from xserv.ops.fp8_quant import (dequantize_1x128, dequantize_bf16, dequantize_bf16_reference, pad_scales,
                                 pad_scales_reference, quantize_1x128, quantize_1x128_reference)
from xserv.models.dense import DenseModel
from xserv.runtime.compiler import compile_family, kernel_code_sizes, startup_families
from xserv.runtime.errors import CublasError
from xserv.tensor import Tensor, bfloat16, float8_e4m3fn, float32
from xserv.testing import poisoned, random_array, rel_error



def cpu(a):
    return Tensor.from_numpy(a, "cpu")


def fp8_weight(rng, n, k, std=0.05):
    return quantize_blockwise(random_array(rng, (n, k), np.float32, mean=0.0, std=std))


def float64_reference(x, q, s):
    w = q.astype(np.float64)
    s_full = np.repeat(np.repeat(s.astype(np.float64), 128, axis=0), 128, axis=1)[:q.shape[0], :q.shape[1]]
    return x.astype(np.float64) @ (w * s_full).T


# ---- CPU: references ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, k", [(1, 16), (3, 128), (9, 1040), (5, 400)])
def test_quantize_1x128_reference(rng, m, k):
    x = random_array(rng, (m, k), bfloat16, mean=0.3, std=2.0)
    q, scales = quantize_1x128_reference(x)
    assert q.dtype == float8_e4m3fn and q.shape == (m, k)
    assert scales.dtype == np.float32 and scales.shape == (-(-k // 128), m)
    xf = x.astype(np.float64)
    for g in range(scales.shape[0]):
        block = xf[:, 128 * g:128 * (g + 1)]
        amax = np.abs(block).max(axis=1)
        np.testing.assert_array_equal(scales[g], (amax.astype(np.float32) / np.float32(448)))  # float32 division
        qg = q[:, 128 * g:128 * (g + 1)].astype(np.float64)
        assert np.abs(qg).max() <= 448 and np.isclose(np.abs(qg).max(axis=1), 448).all()  # each row's amax -> 448
    # e4m3 keeps 3 mantissa bits: the quantized x is within 2^-4 relative of x, elementwise (normal range)
    back = dequantize_1x128(q, scales)
    big = np.abs(xf) > np.repeat(scales.T, 128, axis=1)[:, :k] * 2.0 ** -6
    assert np.all(np.abs(back - xf)[big] <= np.abs(xf)[big] * 2.0 ** -4)


def test_quantize_1x128_zero_group_and_rounding(rng):
    x = np.zeros((2, 256), np.float32)
    x[1, 128:] = random_array(rng, (128,), np.float32, mean=0.1)
    x[1, 130] = 7.0  # the group's amax
    xb = x.astype(bfloat16)
    q, scales = quantize_1x128_reference(xb)
    assert scales[0, 0] == 1 and scales[1, 0] == 1 and scales[0, 1] == 1  # all-zero groups: scale 1, codes 0
    assert not q[0].astype(np.float32).any() and not q[1, :128].astype(np.float32).any()
    s = np.float32(7.0) / np.float32(448)
    assert scales[1, 1] == s and q[1, 130].astype(np.float32) == 448
    want = (xb[1, 128:].astype(np.float32) / s).astype(ml_dtypes.float8_e4m3fn)  # RN-even from float32
    np.testing.assert_array_equal(q[1, 128:].view(np.uint8), want.view(np.uint8))


def test_dequantize_bf16_reference_is_fp8_py(rng):
    q, s = fp8_weight(rng, 300, 272)
    got = dequantize_bf16_reference(q, s)
    assert got.dtype == bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), dequantize_blockwise(q, s, out_dtype=bfloat16).view(np.uint16))
    exact = q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:300, :272]
    np.testing.assert_array_equal(got.view(np.uint16), exact.astype(bfloat16).view(np.uint16))


def test_pad_scales_reference():
    s = np.arange(15, dtype=np.float32).reshape(3, 5) + 1
    p = pad_scales_reference(s)
    assert p.shape == (3, 8) and np.array_equal(p[:, :5], s) and not p[:, 5:].any()
    out = Tensor.empty((3, 8), float32, "cpu")
    pad_scales(cpu(s), out)
    np.testing.assert_array_equal(out.array, p)


@pytest.mark.parametrize("m, n, k", [(9, 200, 336), (17, 130, 272), (1, 5, 16), (40, 257, 1040)])
def test_cpu_linear_fp8_is_the_reference(rng, m, n, k):
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    out = linear_fp8(cpu(x), cpu(q), cpu(s), out_dtype=float32)
    assert out.dtype == float32 and out.shape == (m, n)
    assert rel_error(out.array, float64_reference(x, q, s)) < 1e-6
    out16 = linear_fp8(cpu(x), cpu(q), cpu(s))
    np.testing.assert_array_equal(out16.array, linear_fp8_reference(x, q, s).astype(bfloat16))


# ---- CPU: dispatch, scratch, compile keys -----------------------------------------------------------------------
def test_dispatch_rule():
    for target in ("sm_90a", "sm_80@sm_90a", "sm_89", "sm_100a", "sm_120a", "sm_80"):
        for m in (1, 2, 7):
            assert choose_path(m, target) == "gemv"
    # 8 rows: cuBLASLt's FP8 GEMM where it exists (2.5x the GEMV on an H100), the GEMV elsewhere
    assert choose_path(8, "sm_90a") == choose_path(8, "sm_120a") == "cublas_fp8"
    assert choose_path(8, "sm_89") == choose_path(8, "sm_89@sm_90a") == choose_path(8, "sm_80") == "gemv"
    for m in (9, 16, 256, 4096):
        assert choose_path(m, "sm_90a") == "cublas_fp8"
        assert choose_path(m, "sm_100a") == "cublas_fp8" and choose_path(m, "sm_120a") == "cublas_fp8"
        assert choose_path(m, "sm_89") == "dequant" and choose_path(m, "sm_80") == "dequant"
        assert choose_path(m, "sm_89@sm_90a") == "dequant" and choose_path(m, "sm_80@sm_90a") == "dequant"


def test_bf16_activations_take_the_weight_only_paths(monkeypatch):
    """XSERV_FP8_ACTIVATIONS=bf16: no W8A8 on any arch (the GEMV up to 8 rows, dequantize + bf16 GEMM above); an
    unknown value is an error naming the variable."""
    monkeypatch.setenv("XSERV_FP8_ACTIVATIONS", "bf16")
    for target in ("sm_90a", "sm_100a", "sm_120a", "sm_80"):
        assert [choose_path(m, target) for m in (1, 7, 8, 9, 2048)] == ["gemv"] * 3 + ["dequant"] * 2
    monkeypatch.setenv("XSERV_FP8_ACTIVATIONS", "e4m3")
    assert choose_path(2048, "sm_90a") == "cublas_fp8"
    monkeypatch.setenv("XSERV_FP8_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="XSERV_FP8_ACTIVATIONS='fp8': expected one of e4m3, bf16"):
        choose_path(2048, "sm_90a")


def test_scratch_sizes_and_checks():
    from xserv.ops.fp8_linear import _padded_scale_capacity

    s = Fp8Scratch(256, 12288, 24576 * 4096, device="cpu")
    s.check(256, 24576, 4096)
    s.check(9, 4096, 12288)
    with pytest.raises(ValueError, match="scratch: sized for 256 rows"):
        s.check(257, 4096, 4096)
    with pytest.raises(ValueError, match="scratch"):
        s.check(16, 24577, 4096)
    with pytest.raises(ValueError, match="must be positive"):
        Fp8Scratch(0, 16, 16, device="cpu")
    # the padded-scale bound covers every weight that fits (K a multiple of 16)
    for w_max in (16 * 16, 4096 * 4096, 300 * 1040):
        for k in (16, 48, 144, 1040, 4112):
            n = w_max // k
            if n:
                nb, kb = scale_shape((n, k))
                assert nb * (-(-kb // 4) * 4) <= _padded_scale_capacity(k, w_max), (w_max, k)


def test_fp8_models_compile_the_fp8_families_at_start():
    base = {"head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 8}
    dense = DenseModel.kernel_shapes(type("Config", (), base))
    quantized = DenseModel.kernel_shapes(type("Config", (), {**base, "quantization_config": object()}))
    assert "fp8" not in dense and quantized == {**dense, "fp8": 1}
    for target in ("sm_90a", "sm_89", "sm_80@sm_90a"):
        plain = startup_families(target, dense)
        fp8 = startup_families(target, quantized)
        assert not any(n.startswith(("gemv_fp8", "fp8")) for n in plain)
        assert set(fp8) - set(plain) == {"gemv_fp8:f1", "fp8:f1"}


@pytest.mark.slow  # the whole family compiled for sm_90a: tens of CPU-seconds
def test_every_kernel_the_launchers_name_is_compiled():
    sizes = kernel_code_sizes(compile_family("fp8", "sm_90a"))
    for name in ("fp8_quantize_1x128", "fp8_dequantize_bf16", "fp8_pad_scales"):
        assert name in sizes



def test_errors_name_the_problem(rng):
    x = cpu(random_array(rng, (12, 256), bfloat16))
    q, s = fp8_weight(rng, 40, 256)
    w, sc = cpu(q), cpu(s)
    with pytest.raises(ValueError, match="weight: dtype"):
        linear_fp8(x, cpu(q.astype(bfloat16)), sc)
    with pytest.raises(ValueError, match="x: dtype"):
        linear_fp8(cpu(random_array(rng, (12, 256), np.float32)), w, sc)
    with pytest.raises(ValueError, match="in_features"):
        linear_fp8(cpu(random_array(rng, (12, 128), bfloat16)), w, sc)
    with pytest.raises(ValueError, match="scale_inv: shape"):
        linear_fp8(x, w, cpu(np.ones((1, 1), np.float32)))
    with pytest.raises(ValueError, match="scale_inv: dtype"):
        linear_fp8(x, w, cpu(s.astype(bfloat16)))
    with pytest.raises(ValueError, match="out: dtype"):
        linear_fp8(x, w, sc, out=Tensor.empty((12, 40), np.float16, "cpu"))
    with pytest.raises(ValueError, match="out: shape"):
        linear_fp8(x, w, sc, out=Tensor.empty((12, 41), bfloat16, "cpu"))
    with pytest.raises(ValueError, match="path"):
        linear_fp8(x, w, sc, path="fast")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_1x128(cpu(random_array(rng, (2, 40), bfloat16)))
    with pytest.raises(ValueError, match="scales: shape"):
        quantize_1x128(cpu(random_array(rng, (2, 256), bfloat16)), scales=Tensor.empty((2, 3), float32, "cpu"))
    with pytest.raises(ValueError, match="scale_inv: shape"):
        dequantize_bf16(w, cpu(np.ones((2, 2), np.float32)))


# ---- GPU --------------------------------------------------------------------------------------------------------
def gpu(a):
    return Tensor.from_numpy(a, "cuda")


def _forcible_paths():
    """The large-M paths this GPU can run: "dequant" everywhere; "cublas_fp8" where the rule picks it."""
    from xserv.runtime import get_device

    return ["dequant"] + (["cublas_fp8"] if choose_path(9, get_device().arch) == "cublas_fp8" else [])


def _check(got, want, out_dtype, fp8_activations):
    got = got.astype(np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an unwritten element?)"
    # the dequant path multiplies bf16-rounded weights (2^-9 relative each); cublas_fp8 also rounds x to e4m3
    # (2^-4 relative at worst; an H100 gave 2.6e-2 of the norm on these inputs: the tight check is the one against
    # the quantized operands, in test_cuda_large_m_paths)
    tol = 5e-2 if fp8_activations else (8e-3 if out_dtype == bfloat16 else 4e-3)
    err = rel_error(got, want)
    assert err < tol, err
    assert np.abs(got - want).max() / (np.abs(want).max() + 1e-30) < 4 * tol


SHAPES = [(9, 1000, 1040), (17, 301, 4112), (300, 4096, 4096), (64, 130, 12304), (9, 128, 128), (33, 6144, 4096),
          (256, 4096, 12288), (17, 24, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("out_dtype", [bfloat16, float32], ids=["bf16", "f32"])
def test_cuda_large_m_paths(rng, m, n, k, out_dtype):
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    want = linear_fp8_reference(x, q, s)
    args = [gpu(a) for a in (x, q, s)]
    from xserv.runtime import get_device, get_runtime

    main = m - m % 4  # cuBLASLt's rows on the cublas_fp8 path; the last m % 4 go through the GEMV
    taken = get_runtime().cublas.fp8_block_scaled_plan(main, n, k, out_dtype) is not None
    for path in _forcible_paths() + ["auto"]:
        out = poisoned((m, n), out_dtype, "cuda")
        fp8 = path == "cublas_fp8" or (path == "auto" and choose_path(m, get_device().arch) == "cublas_fp8")
        if fp8 and not taken:  # a shape this cuBLASLt refuses: forced, an error naming it; auto, the fallback
            if path == "cublas_fp8":
                with pytest.raises(CublasError, match=f"refuses M={main} N={n} K={k}"):
                    linear_fp8(*args, out=out, path=path)
                continue
            with pytest.warns(RuntimeWarning, match="using the dequantize"):
                linear_fp8(*args, out=out, path=path)
            _check(out.numpy(), want, out_dtype, False)
            continue
        with _no_fallback_warning(path):
            linear_fp8(*args, out=out, path=path)
        _check(out.numpy(), want, out_dtype, fp8)
        if fp8:
            # exactly what cuBLASLt is given: x quantized 1x128, the weight's own blocks -> a tight reference
            # (5e-4 in fp32: an H100 gave 1.3e-4, the FP8 MMA's reduced-precision accumulation inside a 128-block);
            # the last m % 4 rows are the GEMV's: bf16 x against the dequantized weight
            qx, sx = quantize_1x128_reference(x[:main])
            exact = dequantize_1x128(qx, sx).astype(np.float64) @ dequantize_blockwise(q, s, out_dtype=np.float32).T
            tol = 5e-4 if out_dtype == float32 else 8e-3
            assert rel_error(out.numpy()[:main], exact) < tol
            if main < m:
                assert rel_error(out.numpy()[main:], want[main:]) < (1e-5 if out_dtype == float32 else 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 64, 256, 2048])
def test_cuda_cublaslt_takes_qwen3_shapes_on_sm90(m):
    """On an H100, cuBLASLt 13.1 took Qwen3-8B's four projections at these M (the bench) and refused M = 9, 17, 33
    and N = 130, 24 (docs/kernels/fp8.md): a cuBLASLt that refuses these sends every prefill to the slow path."""
    from xserv.runtime import get_device, get_runtime

    if choose_path(9, get_device().arch) != "cublas_fp8":
        pytest.skip("the dequant path's device (below sm_90 or a forced XSERV_ARCH)")
    cublas = get_runtime().cublas
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        assert cublas.fp8_block_scaled_plan(m, n, k, bfloat16) is not None, cublas.fp8_refusals


class _no_fallback_warning:
    """A forced path never warns; "auto" on this GPU warns only if cuBLASLt refused (the test then says so)."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self.log = self._ctx.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        msgs = [str(w.message) for w in self.log if "linear_fp8" in str(w.message)]
        assert not msgs, msgs  # cuBLASLt refused a shape the rule sends to it: the fallback ran (see the message)
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 5120, 2048), (7, 301, 4112), (3, 37, 48), (8, 301, 4112)])
def test_cuda_small_m_is_the_gemv(rng, m, n, k):
    """Below 8 rows the GEMV everywhere; at 8 rows where cuBLASLt refuses the shape (N = 301), the GEMV too, with
    no fallback warning (not the dequant path)."""
    x = random_array(rng, (m, k), bfloat16, mean=0.1)
    q, s = fp8_weight(rng, n, k)
    out = poisoned((m, n), float32, "cuda")
    with _no_fallback_warning("auto"):
        linear_fp8(gpu(x), gpu(q), gpu(s), out=out)
    assert rel_error(out.numpy(), linear_fp8_reference(x, q, s)) < 1e-5
    with pytest.raises(ValueError, match="'gemv' takes"):
        linear_fp8(gpu(random_array(rng, (9, k), bfloat16)), gpu(q), gpu(s), path="gemv")


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(1, 16), (9, 1040), (300, 4096), (17, 12304), (2, 144)])
def test_cuda_quantize_1x128_bit_for_bit(rng, m, k):
    x = random_array(rng, (m, k), bfloat16, mean=0.1, std=3.0)
    x[0, :min(k, 128)] = 0  # an all-zero group: scale 1
    q, scales = quantize_1x128(gpu(x), q=poisoned((m, k), float8_e4m3fn, "cuda"),
                               scales=poisoned((-(-k // 128), m), float32, "cuda"))
    want_q, want_s = quantize_1x128_reference(x)
    np.testing.assert_array_equal(scales.numpy(), want_s)
    np.testing.assert_array_equal(q.numpy().view(np.uint8), want_q.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(1, 16), (301, 1040), (4096, 4112), (130, 272)])
def test_cuda_dequantize_bf16_bit_for_bit(rng, n, k):
    q, s = fp8_weight(rng, n, k)
    out = dequantize_bf16(gpu(q), gpu(s), out=poisoned((n, k), bfloat16, "cuda"))
    np.testing.assert_array_equal(out.numpy().view(np.uint16), dequantize_bf16_reference(q, s).view(np.uint16))


@pytest.mark.gpu
def test_cuda_pad_scales(rng):
    s = random_array(rng, (7, 9), np.float32)
    out = poisoned((7, 12), float32, "cuda")
    pad_scales(gpu(s), out)
    np.testing.assert_array_equal(out.numpy(), pad_scales_reference(s))


@pytest.mark.gpu
def test_cuda_scratch_reused_under_graph_capture(rng):
    """One preallocated scratch serves calls of several shapes, eagerly and replayed from a CUDA graph, on both
    large-M paths; the graph's outputs equal the eager ones bit for bit."""
    from xserv.runtime.graphs import CUDAGraph

    shapes = [(16, 6144, 4096), (40, 4096, 12288), (300, 4096, 4096)]  # shapes cuBLASLt 13.1 took on an H100
    scratch = Fp8Scratch(300, 12288, 4096 * 12288, paths=tuple(_forcible_paths()))
    nbytes = scratch.nbytes
    for path in _forcible_paths():
        cases = []
        for m, n, k in shapes:
            x = random_array(rng, (m, k), bfloat16, mean=0.1)
            q, s = fp8_weight(rng, n, k)
            cases.append(([gpu(a) for a in (x, q, s)], poisoned((m, n), bfloat16, "cuda"),
                          linear_fp8_reference(x, q, s)))
        eager = []
        for args, out, want in cases:
            linear_fp8(*args, out=out, scratch=scratch, path=path)
            eager.append(out.numpy())
            _check(eager[-1], want, bfloat16, path == "cublas_fp8")
            out.copy_(np.full(out.shape, np.nan, bfloat16))
        graph = CUDAGraph()
        with graph.capture():
            for args, out, _ in cases:
                linear_fp8(*args, out=out, scratch=scratch, path=path)
        graph.replay()
        for (_, out, _), e in zip(cases, eager):
            np.testing.assert_array_equal(out.numpy().view(np.uint16), e.view(np.uint16))
        graph.close()
    assert scratch.nbytes == nbytes  # nothing allocated on the way


@pytest.mark.gpu
def test_cuda_scratch_too_small_is_an_error(rng):
    x = random_array(rng, (32, 256), bfloat16)
    q, s = fp8_weight(rng, 64, 256)
    scratch = Fp8Scratch(16, 256, 64 * 256)
    with pytest.raises(ValueError, match="scratch: sized for 16 rows"):
        linear_fp8(gpu(x), gpu(q), gpu(s), scratch=scratch)
