"""Linear layers on FP8 block-quantized weights (issue 31): out = x @ dequant(weight, scale_inv)^T.

    linear_fp8(x, weight, scale_inv, out=None, out_dtype=None)

x bf16 [M, K]; weight float8_e4m3fn [N, K] with float32 scale_inv [ceil(N / 128), ceil(K / 128)] (Qwen's -FP8
layout: 128 x 128 blocks, xserv/models/fp8.py); out bf16 (default) or float32 [M, N]. The model's projections call
this for every quantized weight (xserv/models/dense.py), whatever M is; it picks the kernel:
  CPU          the reference (dequantize as fp8.py does, then multiply in float64).
  M <= 8       the FP8 weight-only GEMV (xserv/ops/gemv_fp8.py): e4m3 read once, dequantized in registers.
  larger M     (to be filled in: FP8 tensor-core GEMM or dequantize-to-bf16 tiles, decided by measurement)
"""
from __future__ import annotations

from ..tensor import Tensor, bfloat16
from ._checks import check_tensor, output
from .gemv_fp8 import MAX_M, linear_fp8_gemv, linear_fp8_reference


def linear_fp8(x: Tensor, weight: Tensor, scale_inv: Tensor, out: Tensor | None = None, out_dtype=None) -> Tensor:
    """x bf16 [M, K] @ dequant(weight [N, K], scale_inv)^T -> out [M, N]."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    m = x.shape[0]
    if x.device == "cpu" and m > MAX_M:
        out = output("out", out, (m, weight.shape[0]), out.dtype if out is not None else (out_dtype or bfloat16), "cpu")
        out.array[...] = linear_fp8_reference(x.array, weight.array, scale_inv.array).astype(out.dtype)
        return out
    if 1 <= m <= MAX_M:
        return linear_fp8_gemv(x, weight, scale_inv, out=out, out_dtype=out_dtype)
    raise NotImplementedError("linear_fp8: more than 8 rows on CUDA is not written yet")


__all__ = ["linear_fp8", "linear_fp8_reference"]
