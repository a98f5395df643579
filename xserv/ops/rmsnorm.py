"""RMSNorm (Qwen3RMSNorm), the fused residual-add + RMSNorm of the decoder layer, and per-head RMSNorm (q_norm /
k_norm).

Rounding follows Hugging Face: mean(x^2) and x * rsqrt(...) in fp32, the normalised value cast to the input dtype
(bf16) BEFORE the multiply by the weight, the product rounded to bf16 — in the kernels and in the references.
"""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, check_eps, check_int32_range, round_up

HEAD_DIMS = (64, 128)
_HEAD_BLOCK = 256  # 8 warps
_HEAD_ROWS_PER_WARP = 2  # kRowsPerWarp in rmsnorm.cu / rope.cu


# ---- references (NumPy, float32 math; return float32 values the caller writes into the output dtype) ----------
def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Over the last axis of x (any leading shape)."""
    xf = x.astype(np.float32)
    variance = np.mean(xf * xf, axis=-1, keepdims=True, dtype=np.float32)
    normed = xf * (np.float32(1.0) / np.sqrt(variance + np.float32(eps)))
    return weight.astype(np.float32) * normed.astype(x.dtype).astype(np.float32)


def fused_add_rmsnorm_reference(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float):
    """-> (new residual in residual's dtype, rmsnorm of it as float32)."""
    new_residual = (x.astype(np.float32) + residual.astype(np.float32)).astype(residual.dtype)
    return new_residual, rmsnorm_reference(new_residual, weight, eps)


def head_rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return rmsnorm_reference(x, weight, eps)


# ---- ops ---------------------------------------------------------------------------------------------------------
def _check_rows(x: Tensor, weight: Tensor, eps) -> tuple[int, int, np.float32]:
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    num_rows, hidden = x.shape
    if hidden == 0:
        raise ValueError("x: hidden size is 0")
    check_int32_range("x", hidden)
    check_tensor("weight", weight, dtype=bfloat16, shape=(hidden,))
    return num_rows, hidden, check_eps(eps)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """x: bf16 [T, H], weight: bf16 [H] -> out: bf16 [T, H]. `out` may be `x`."""
    num_rows, hidden, eps32 = _check_rows(x, weight, eps)
    device = same_device(x=x, weight=weight, out=out)
    out = output("out", out, x.shape, bfloat16, device)
    check_alias("out", out, "x", x, allow_identical=True)
    if num_rows == 0:
        return out
    if device == "cpu":
        out.array[...] = rmsnorm_reference(x.array, weight.array, eps32).astype(out.dtype)
        return out
    _launch_rows("rmsnorm", num_rows, hidden, (x,), weight, out, eps32)
    return out


def fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """residual <- x + residual (in place); out <- rmsnorm(residual). Returns out. `out` may be `x`, not
    `residual`. The residual stream is bf16 (rounded like HF in bf16) or float32 (kept unrounded; the normalised
    value is then not rounded before the weight multiply either, as HF's RMSNorm does on an fp32 input)."""
    num_rows, hidden, eps32 = _check_rows(x, weight, eps)
    check_tensor("residual", residual, dtype=(bfloat16, float32), shape=x.shape)
    device = same_device(x=x, residual=residual, weight=weight, out=out)
    out = output("out", out, x.shape, bfloat16, device)
    check_alias("out", out, "x", x, allow_identical=True)
    check_alias("out", out, "residual", residual, allow_identical=False)
    check_alias("residual", residual, "x", x, allow_identical=False)
    if num_rows == 0:
        return out
    if device == "cpu":
        new_residual, y = fused_add_rmsnorm_reference(x.array, residual.array, weight.array, eps32)
        residual.array[...] = new_residual
        out.array[...] = y.astype(out.dtype)
        return out
    op = "fused_add_rmsnorm" if residual.dtype == bfloat16 else "fused_add_rmsnorm_f32res"
    _launch_rows(op, num_rows, hidden, (x, residual), weight, out, eps32)
    return out


def _launch_rows(op: str, num_rows: int, hidden: int, inputs: tuple, weight: Tensor, out: Tensor, eps32) -> None:
    """One CTA per row; the row in registers (VPT 16-byte vectors per thread) when hidden % 8 == 0, the pointers
    are 16-byte aligned and the row fits 8 * 8 * 1024 values, else the two-pass scalar kernel."""
    args = (*inputs, weight, out, np.int32(hidden), eps32)
    nchunks = hidden // 8
    if hidden % 8 == 0 and aligned(*inputs, weight, out):
        for vpt in (1, 2, 4, 8):  # the fewest vectors per thread that keep the block at <= 256 threads
            threads = round_up(cdiv(nchunks, vpt), 32)
            if threads <= 256 or (vpt == 8 and threads <= 1024):
                kernel("rmsnorm", f"{_kernel_prefix(op)}_vpt{vpt}")(num_rows, threads, *args)
                return
    kernel("rmsnorm", f"{_kernel_prefix(op)}_scalar")(num_rows, min(1024, round_up(hidden, 32)), *args)


def _kernel_prefix(op: str) -> str:
    return op if op.endswith("_f32res") else f"{op}_bf16"


def head_rmsnorm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """x: bf16 [T, num_heads, D] (D = 64 or 128), weight: bf16 [D] -> out: bf16 [T, num_heads, D], normalised over
    D. `out` may be `x` (in place)."""
    check_tensor("x", x, dtype=bfloat16, ndim=3)
    head_dim = x.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"x: head_dim {head_dim} is not supported (supported: {HEAD_DIMS})")
    check_tensor("weight", weight, dtype=bfloat16, shape=(head_dim,))
    eps32 = check_eps(eps)
    device = same_device(x=x, weight=weight, out=out)
    out = output("out", out, x.shape, bfloat16, device)
    check_alias("out", out, "x", x, allow_identical=True)
    rows = x.shape[0] * x.shape[1]
    if rows == 0:
        return out
    if device == "cpu":
        out.array[...] = head_rmsnorm_reference(x.array, weight.array, eps32).astype(out.dtype)
        return out
    name = f"head_rmsnorm_d{head_dim}_bf16"
    if head_dim == 128 and not aligned(x, out, nbytes=4):
        name += "_scalar"
    grid = cdiv(rows, _HEAD_ROWS_PER_WARP * _HEAD_BLOCK // 32)
    kernel("rmsnorm", name)(grid, _HEAD_BLOCK, x, weight, out, np.int64(rows), eps32)
    return out
