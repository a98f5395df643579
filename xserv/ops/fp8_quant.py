"""FP8 conversions of the large-M linear paths (cuda_src/fp8.cu; used by ops/fp8_linear.py):

    quantize_1x128(x, q=None, scales=None)            x bf16 [M, K] -> (q e4m3 [M, K], scales float32 [G, M])
    dequantize_bf16(weight, scale_inv, out=None)       e4m3 [N, K] + scales [ceil(N/128), ceil(K/128)] -> bf16 [N, K]
    pad_scales(scale_inv, out)                         [nb, kb] -> [nb, round_up(kb, 4)], zero-padded

quantize_1x128: one float32 scale per row and 128-column group (G = ceil(K / 128) groups), scale = amax / 448 (1 for
an all-zero group), q = e4m3(clip(x / scale, +-448)) with an IEEE float32 division, rounded to nearest even; the
scales stored group-major, scales[g, m] (the M scales of a group contiguous): cuBLASLt's VEC128_32F layout for the
activations (runtime/cublas.py, gemm_fp8_block_scaled). dequantize_bf16: bf16(float32(e4m3) * scale_inv), the float32
product rounded once, as fp8_format.py's dequantize_blockwise. Both need K % 16 == 0 on CUDA (16-byte accesses, a
chunk never straddles a 128-column group). The NumPy references compute the same values: the CUDA kernels match them
bit for bit (tests/ops/test_fp8_linear.py).
"""
from __future__ import annotations

import numpy as np

from ..fp8_format import DEFAULT_BLOCK, E4M3, dequantize_blockwise, scale_shape
from ..runtime import kernel
from ..runtime.compiler import piece
from ..tensor import Tensor, bfloat16, float8_e4m3fn, float32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, round_up

FAMILY = "fp8"
GROUP = 128
E4M3_MAX = np.float32(448.0)
K_MULTIPLE = 16
_THREADS = 256


def _piece() -> str:
    return piece(FAMILY, fp8=1)


# ---- references --------------------------------------------------------------------------------------------------
def quantize_1x128_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q float8_e4m3fn [M, K], scales float32 [ceil(K / 128), M]) of x [M, K] as fp8.cu's fp8_quantize_1x128."""
    xf = np.asarray(x).astype(np.float32)
    m, k = xf.shape
    groups = cdiv(k, GROUP)
    padded = np.zeros((m, groups * GROUP), np.float32)
    padded[:, :k] = xf
    blocks = padded.reshape(m, groups, GROUP)
    amax = np.abs(blocks).max(axis=2)
    scale = np.where(amax > 0, amax / E4M3_MAX, np.float32(1)).astype(np.float32)
    q = np.clip(blocks / scale[:, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(m, -1)[:, :k]
    return np.ascontiguousarray(q), np.ascontiguousarray(scale.T)


def dequantize_1x128(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [M, K]: q * its row group's scale (what cuBLASLt's VEC128_32F operand means)."""
    m, k = q.shape
    full = np.repeat(np.asarray(scales, np.float32).T, GROUP, axis=1)[:, :k]
    return np.asarray(q).astype(np.float32) * full


def dequantize_bf16_reference(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    return dequantize_blockwise(np.asarray(weight), np.asarray(scale_inv, np.float32), DEFAULT_BLOCK,
                                out_dtype=bfloat16)


def pad_scales_reference(scale_inv: np.ndarray) -> np.ndarray:
    nb, kb = scale_inv.shape
    out = np.zeros((nb, round_up(kb, 4)), np.float32)
    out[:, :kb] = scale_inv
    return out


# ---- launchers ---------------------------------------------------------------------------------------------------
def _check_k(name: str, k: int) -> None:
    if k == 0 or k % K_MULTIPLE:
        raise ValueError(f"{name}: in_features {k} must be a positive multiple of {K_MULTIPLE}")


def quantize_1x128(x: Tensor, q: Tensor | None = None, scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x bf16 [M, K] -> (q float8_e4m3fn [M, K], scales float32 [ceil(K / 128), M])."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    m, k = x.shape
    _check_k("x", k)
    device = same_device(x=x, q=q, scales=scales)
    q = output("q", q, (m, k), float8_e4m3fn, device)
    scales = output("scales", scales, (cdiv(k, GROUP), m), float32, device)
    if device == "cpu":
        q.array[...], scales.array[...] = quantize_1x128_reference(x.array)
        return q, scales
    if m == 0:
        return q, scales
    if not aligned(x, q, nbytes=8) or not aligned(scales, nbytes=4):
        raise ValueError("quantize_1x128: x and q must be 8-byte aligned")
    warps = m * cdiv(k, GROUP)
    # fp8_quantize_1x128(x, x_stride, q, scales, M, K, scale_ld): a warp per (row, group), 8 warps a block
    kernel(_piece(), "fp8_quantize_1x128")(cdiv(warps, _THREADS // 32), _THREADS, x, np.int64(k), q, scales,
                                           np.int32(m), np.int32(k), np.int32(m))
    return q, scales


def _check_weight(weight: Tensor, scale_inv: Tensor) -> tuple[int, int]:
    check_tensor("weight", weight, dtype=float8_e4m3fn, ndim=2)
    n, k = weight.shape
    check_tensor("scale_inv", scale_inv, dtype=float32, ndim=2)
    want = scale_shape((n, k), DEFAULT_BLOCK)
    if scale_inv.shape != want:
        raise ValueError(f"scale_inv: shape {list(scale_inv.shape)}, expected {list(want)} (ceil(N / 128), "
                         f"ceil(K / 128)) for a weight of [{n}, {k}]")
    return n, k


def dequantize_bf16(weight: Tensor, scale_inv: Tensor, out: Tensor | None = None) -> Tensor:
    """weight float8_e4m3fn [N, K] with scale_inv [ceil(N / 128), ceil(K / 128)] -> bf16 [N, K]."""
    n, k = _check_weight(weight, scale_inv)
    _check_k("weight", k)
    device = same_device(weight=weight, scale_inv=scale_inv, out=out)
    out = output("out", out, (n, k), bfloat16, device)
    if device == "cpu":
        out.array[...] = dequantize_bf16_reference(weight.array, scale_inv.array)
        return out
    if n == 0:
        return out
    if not aligned(weight, out):
        raise ValueError("dequantize_bf16: weight and out must be 16-byte aligned")
    from ..runtime import get_device

    items = n * k // 8
    if items >= 1 << 31:
        raise ValueError(f"weight: [{n}, {k}] is over the kernel's 2^34 elements")
    grid = min(cdiv(items, _THREADS * 4), get_device().info.multiprocessor_count * 16)
    # fp8_dequantize_bf16(W, scale_inv, out, N, K): 4 items of 8 weights a thread a step, grid-stride
    kernel(_piece(), "fp8_dequantize_bf16")(grid, _THREADS, weight, scale_inv, out, np.int32(n), np.int32(k))
    return out


def pad_scales(scale_inv: Tensor, out: Tensor) -> Tensor:
    """scale_inv float32 [nb, kb] -> out [nb, round_up(kb, 4)], the padding columns zero."""
    check_tensor("scale_inv", scale_inv, dtype=float32, ndim=2)
    nb, kb = scale_inv.shape
    device = same_device(scale_inv=scale_inv, out=out)
    check_tensor("out", out, dtype=float32, shape=(nb, round_up(kb, 4)), device=device)
    check_alias("out", out, "scale_inv", scale_inv, allow_identical=False)
    if device == "cpu":
        out.array[...] = pad_scales_reference(scale_inv.array)
        return out
    if out.numel:
        kernel(_piece(), "fp8_pad_scales")(cdiv(out.numel, _THREADS), _THREADS, scale_inv, out, np.int32(nb),
                                           np.int32(kb), np.int32(out.shape[1]))
    return out


__all__ = ["quantize_1x128", "quantize_1x128_reference", "dequantize_1x128", "dequantize_bf16",
           "dequantize_bf16_reference", "pad_scales", "pad_scales_reference", "E4M3"]
