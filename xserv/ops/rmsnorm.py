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
from ._launch import (PDL_MAX_ROWS, aligned, cdiv, check_alias, check_eps, check_int32_range, disjoint, round_up,
                      same_or_disjoint)

HEAD_DIMS = (64, 128)
_HEAD_BLOCK = 256  # 8 warps
_HEAD_ROWS_PER_WARP = 2  # kRowsPerWarp in rmsnorm.cu / rope.cu
_EPS32: dict[float, np.float32] = {}  # eps (a valid Python float) -> its np.float32, built once
_ROWS: dict[tuple, tuple] = {}  # (op, hidden, vectorised) -> (kernel name, threads per row, np.int32(hidden))


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


def _eps32(eps) -> np.float32:
    """check_eps, remembered for Python floats (an op is called with the same eps every time)."""
    if type(eps) is float:  # not bool or int: True == 1 == 1.0 would find 1.0's entry without being checked
        eps32 = _EPS32.get(eps)
        if eps32 is None:
            eps32 = check_eps(eps)
            if len(_EPS32) < 64:
                _EPS32[eps] = eps32
        return eps32
    return check_eps(eps)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """x: bf16 [T, H], weight: bf16 [H] -> out: bf16 [T, H]. `out` may be `x`."""
    # The usual eager call (CUDA tensors, `out` new, `x` or disjoint from it) is checked in one expression;
    # anything else takes the full checks, which name what is wrong.
    if (type(x) is Tensor and type(weight) is Tensor and x.dtype is bfloat16 and weight.dtype is bfloat16
            and x.device == "cuda" and weight.device == "cuda" and len(x.shape) == 2
            and weight.shape == x.shape[1:] and 0 < x.shape[1] < 2**31):
        eps32 = _eps32(eps)
        if out is None:
            out = x.empty_like()  # a new block (x is bf16): it overlaps nothing
        elif not (type(out) is Tensor and out.device == "cuda" and out.dtype is bfloat16 and out.shape == x.shape
                  and same_or_disjoint(out.ptr, x.ptr, x.nbytes)):
            return _rmsnorm_checked(x, weight, eps, out)
        num_rows, hidden = x.shape
        if num_rows:
            name, threads, hidden32 = _rows_config("rmsnorm", hidden, not (x.ptr | weight.ptr | out.ptr) & 15)
            kernel("rmsnorm", name)(num_rows, threads, x, weight, out, hidden32, eps32)
        return out
    return _rmsnorm_checked(x, weight, eps, out)


def _rmsnorm_checked(x: Tensor, weight: Tensor, eps, out: Tensor | None) -> Tensor:
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
    if (type(x) is Tensor and type(residual) is Tensor and type(weight) is Tensor and x.dtype is bfloat16
            and weight.dtype is bfloat16 and (residual.dtype is bfloat16 or residual.dtype is float32)
            and x.device == "cuda" and residual.device == "cuda" and weight.device == "cuda"
            and len(x.shape) == 2 and residual.shape == x.shape and weight.shape == x.shape[1:]
            and 0 < x.shape[1] < 2**31 and disjoint(residual.ptr, residual.nbytes, x.ptr, x.nbytes)):
        eps32 = _eps32(eps)
        if out is None:
            out = x.empty_like()
        elif not (type(out) is Tensor and out.device == "cuda" and out.dtype is bfloat16 and out.shape == x.shape
                  and same_or_disjoint(out.ptr, x.ptr, x.nbytes)
                  and disjoint(out.ptr, out.nbytes, residual.ptr, residual.nbytes)):
            return _fused_add_rmsnorm_checked(x, residual, weight, eps, out)
        num_rows, hidden = x.shape
        if num_rows:
            op = "fused_add_rmsnorm" if residual.dtype is bfloat16 else "fused_add_rmsnorm_f32res"
            name, threads, hidden32 = _rows_config(op, hidden, not (x.ptr | residual.ptr | weight.ptr | out.ptr) & 15)
            kernel("rmsnorm", name)(num_rows, threads, x, residual, weight, out, hidden32, eps32)
        return out
    return _fused_add_rmsnorm_checked(x, residual, weight, eps, out)


def _fused_add_rmsnorm_checked(x: Tensor, residual: Tensor, weight: Tensor, eps, out: Tensor | None) -> Tensor:
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
    name, threads, hidden32 = _rows_config(op, hidden, aligned(*inputs, weight, out))
    # Programmatic dependent launch for the few rows of a decode step (rmsnorm.cu): the next kernel may start
    # early. Not for long prefills, whose thousands of CTAs the dependents' early CTAs would only crowd.
    kernel("rmsnorm", name)(num_rows, threads, *inputs, weight, out, hidden32, eps32, pdl=num_rows <= PDL_MAX_ROWS)


def _rows_config(op: str, hidden: int, vectorised_pointers: bool) -> tuple[str, int, np.int32]:
    """One CTA per row; the row in registers (VPT 16-byte vectors per thread) when hidden % 8 == 0, the pointers
    are 16-byte aligned and the row fits 8 * 8 * 1024 values, else the two-pass scalar kernel.
    -> (kernel name, threads per CTA, hidden as the kernel's int), computed once per (op, hidden, alignment)."""
    key = (op, hidden, vectorised_pointers)
    config = _ROWS.get(key)
    if config is None:
        config = None
        if hidden % 8 == 0 and vectorised_pointers:
            for vpt in (1, 2, 4, 8):  # the fewest vectors per thread that keep the block at <= 256 threads
                threads = round_up(cdiv(hidden // 8, vpt), 32)
                if threads <= 256 or (vpt == 8 and threads <= 1024):
                    config = (f"{_kernel_prefix(op)}_vpt{vpt}", threads, np.int32(hidden))
                    break
        if config is None:
            config = (f"{_kernel_prefix(op)}_scalar", min(1024, round_up(hidden, 32)), np.int32(hidden))
        _ROWS[key] = config
    return config


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
    eps32 = _eps32(eps)
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
    kernel("rmsnorm", name)(grid, _HEAD_BLOCK, x, weight, out, rows, eps32)  # rows: the kernel's long long
    return out
