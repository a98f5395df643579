"""Linear layers: y = x @ W^T (weights [out_features, in_features], as stored in the checkpoints).

CUDA: cuBLASLt, bf16 in, fp32 accumulation, bf16 or fp32 out. CPU: NumPy in float32.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..runtime import get_runtime
from ..tensor import Tensor, bfloat16, float16, float32
from ._checks import check_tensor, output, same_device

_IN = (bfloat16, float16, float32)


_f32_weights: dict[int, np.ndarray] = {}


def _as_f32(w: np.ndarray) -> np.ndarray:
    """float32 copy of a weight. A read-only array (the model freezes its CPU weights after loading) is converted
    once and cached, since the CPU backend's GEMMs would otherwise spend most of their time re-converting bf16
    weights; a writable one is converted on every call, so an in-place update is never masked by a stale copy."""
    if w.dtype == np.float32:
        return w
    if w.flags.writeable:
        return w.astype(np.float32)
    key = id(w)
    cached = _f32_weights.get(key)
    if cached is None:
        cached = _f32_weights[key] = w.astype(np.float32)
        weakref.finalize(w, _f32_weights.pop, key, None)
    return cached


def linear_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) @ _as_f32(w).T


def linear(x: Tensor, weight: Tensor, out: Tensor | None = None, out_dtype=None, accumulate: bool = False) -> Tensor:
    """x [M, K] @ weight[N, K]^T -> out [M, N]; with accumulate=True, out += x @ weight^T."""
    check_tensor("x", x, dtype=_IN, ndim=2)
    check_tensor("weight", weight, dtype=x.dtype, ndim=2)
    device = same_device(x=x, weight=weight, out=out)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight: shape {list(weight.shape)} does not match x's in_features {k}")
    out_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
    out = output("out", out, (m, n), out_dtype, device)
    if m == 0:
        return out
    if device == "cpu":
        y = linear_reference(x.array, weight.array)
        out.array[...] = (out.array.astype(np.float32) + y if accumulate else y).astype(out.dtype)
        return out
    get_runtime().cublas.gemm(x.ptr, weight.ptr, out.ptr, m, n, k, x.dtype, out.dtype, accumulate=accumulate)
    return out


def batched_linear(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """Strided-batched: x [B, M, K] @ weight[B, N, K]^T -> out [B, M, N]."""
    check_tensor("x", x, dtype=_IN, ndim=3)
    check_tensor("weight", weight, dtype=x.dtype, ndim=3)
    device = same_device(x=x, weight=weight, out=out)
    b, m, k = x.shape
    if weight.shape[0] != b or weight.shape[2] != k:
        raise ValueError(f"weight: shape {list(weight.shape)} does not match x {list(x.shape)}")
    n = weight.shape[1]
    out = output("out", out, (b, m, n), out.dtype if out is not None else x.dtype, device)
    if device == "cpu":
        out.array[...] = np.einsum("bmk,bnk->bmn", x.array.astype(np.float32), weight.array.astype(np.float32)).astype(out.dtype)
        return out
    get_runtime().cublas.gemm(x.ptr, weight.ptr, out.ptr, m, n, k, x.dtype, out.dtype, batch=b,
                              stride_x=m * k, stride_w=n * k, stride_out=m * n)
    return out
