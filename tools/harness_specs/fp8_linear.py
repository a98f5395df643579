"""Linear layers on FP8 block-quantized weights (xserv/ops/fp8_linear.py, ops/fp8_quant.py, cuda_src/fp8.cu):

linear_fp8      x bf16 [M, K] @ dequant(W e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)])^T -> bf16 [M, N],
                shapes MxNxK (K % 16 == 0). `--variant` picks the path: (none) the device's rule, `cublas_fp8` (x
                quantized 1x128 + cuBLASLt's block-scaled FP8 GEMM), `dequant` (W dequantized to a bf16 scratch + the
                bf16 GEMM), `gemv` (M <= 8), and `bf16`: the peer, xserv's bf16 cuBLAS GEMM on the dequantized weight
                (what an unquantized model runs at the same shape). The bench shapes are Qwen3-8B's projections (qkv,
                o, gate_up, down) at M = 16, 64, 256 and 2048; `--shapes 8192x8192x8192` gives the FP8 ceiling.
                TFLOP/s and %gemm (of the bf16 8192^3 ceiling) are 2MNK over the time, quantization included;
                bytes_moved counts the FP8 weight, its scales, x and out (%copy: meaningful at small M).
fp8_quantize    x bf16 [M, K] -> e4m3 [M, K] (+ float32 scales [ceil(K/128), M], checked in the tests), MxK.
fp8_dequantize  W e4m3 [N, K] -> bf16 [N, K], NxK: the dequant path's extra pass (3 bytes a weight).
Use --graph: the scratch buffers are made by each input set's first (eager) call, as a model's warm-up does."""
import numpy as np

from xserv.fp8_format import quantize_blockwise, scale_shape
from xserv.tensor import float8_e4m3fn
from xserv.testing import poisoned, random_array

from . import OpSpec

QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate_up, down: (N, K)
BENCH = [(m, n, k) for m in (16, 64, 256, 2048) for n, k in QWEN3_8B]
CHECK = [(9, 1000, 1040), (17, 301, 4112), (300, 4096, 4096), (64, 130, 12304), (4, 257, 400)]


def fp8_codes(rng, n, k):
    """A random e4m3 weight and its scales, made fast enough for the 100M-element bench weights: every finite code
    equally likely (a NaN code becomes its neighbour, +-448), scales log-uniform in [2^-14, 2^-8]. Small weights
    (the check shapes) are quantized from normal values instead, as a checkpoint's are."""
    if n * k <= 1 << 22:
        return quantize_blockwise(random_array(rng, (n, k), np.float32, mean=0.0, std=0.05))
    c = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    c -= ((c & 0x7F) == 0x7F).view(np.uint8)
    s = np.exp2(rng.uniform(-14, -8, size=scale_shape((n, k)))).astype(np.float32)
    return c.view(float8_e4m3fn), s


def _inputs(rng, shape):
    m, n, k = shape
    q, s = fp8_codes(rng, n, k)
    return {"x": random_array(rng, (m, k), "bfloat16", mean=0.1), "weight": q, "scale_inv": s}


def _run(d):
    from xserv.ops.fp8_linear import Fp8Scratch, linear_fp8
    from xserv.ops.linear import linear

    m, k = d["x"].shape
    n = d["weight"].shape[0]
    out = poisoned((m, n), "bfloat16", d["x"].device)
    variant = d.get("variant") or "auto"
    if variant == "bf16":
        if "weight_bf16" not in d:  # the peer's weight: made once per input set, outside any capture
            from xserv.ops.fp8_quant import dequantize_bf16

            d["weight_bf16"] = dequantize_bf16(d["weight"], d["scale_inv"])
        return linear(d["x"], d["weight_bf16"], out=out)
    if "scratch" not in d:
        d["scratch"] = Fp8Scratch(m, k, n * k, paths=() if variant == "gemv" else None)
    return linear_fp8(d["x"], d["weight"], d["scale_inv"], out=out, scratch=d["scratch"], path=variant)


def _ref(d):
    from xserv.ops.fp8_linear import linear_fp8_reference

    return linear_fp8_reference(d["x"], d["weight"], d["scale_inv"]).astype("bfloat16").astype(np.float64)


def _bytes(s):
    m, n, k = s
    nb, kb = scale_shape((n, k))
    return n * k + nb * kb * 4 + m * k * 2 + m * n * 2


def _flops(s):
    m, n, k = s
    return 2 * m * n * k


def _quant_inputs(rng, shape):
    m, k = shape
    return {"x": random_array(rng, (m, k), "bfloat16", mean=0.1)}


def _quant_run(d):
    from xserv.ops.fp8_quant import quantize_1x128

    m, k = d["x"].shape
    q, _ = quantize_1x128(d["x"], q=poisoned((m, k), float8_e4m3fn, "cuda"),
                          scales=poisoned((-(-k // 128), m), "float32", "cuda"))
    return q


def _quant_ref(d):
    from xserv.ops.fp8_quant import quantize_1x128_reference

    return quantize_1x128_reference(d["x"])[0].astype(np.float64)


def _dequant_inputs(rng, shape):
    n, k = shape
    q, s = fp8_codes(rng, n, k)
    return {"weight": q, "scale_inv": s}


def _dequant_run(d):
    from xserv.ops.fp8_quant import dequantize_bf16

    return dequantize_bf16(d["weight"], d["scale_inv"], out=poisoned(d["weight"].shape, "bfloat16", "cuda"))


def _dequant_ref(d):
    from xserv.ops.fp8_quant import dequantize_bf16_reference

    return dequantize_bf16_reference(d["weight"], d["scale_inv"]).astype(np.float64)


SPECS = [
    OpSpec(name="linear_fp8", family="fp8", kernels=("fp8_quantize_1x128", "fp8_dequantize_bf16", "fp8_pad_scales"),
           make_inputs=_inputs, run=_run, reference=_ref, tolerance=1.5e-2, check_shapes=CHECK, bench_shapes=BENCH,
           bytes_moved=_bytes, flops=_flops, shape_help="MxNxK (K % 16 == 0)"),
    OpSpec(name="fp8_quantize", family="fp8", kernels=("fp8_quantize_1x128",), make_inputs=_quant_inputs,
           run=_quant_run, reference=_quant_ref, tolerance=0.0,
           check_shapes=[(1, 16), (9, 1040), (300, 4096), (17, 12304)],
           bench_shapes=[(2048, 4096), (2048, 12288), (256, 4096)],
           bytes_moved=lambda s: s[0] * s[1] * 3 + s[0] * (-(-s[1] // 128)) * 4, shape_help="MxK (K % 16 == 0)"),
    OpSpec(name="fp8_dequantize", family="fp8", kernels=("fp8_dequantize_bf16",), make_inputs=_dequant_inputs,
           run=_dequant_run, reference=_dequant_ref, tolerance=0.0,
           check_shapes=[(1, 16), (301, 1040), (4096, 4112)],
           bench_shapes=[(6144, 4096), (24576, 4096), (4096, 12288)],
           bytes_moved=lambda s: 3 * s[0] * s[1] + scale_shape(s)[0] * scale_shape(s)[1] * 4, shape_help="NxK"),
]
