"""Dtype conversion between bfloat16, float16 and float32 (any shape, flattened): through float32, one
round-to-nearest-even to the target (NaN stays NaN, overflow gives inf)."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, as_dtype, bfloat16, float16, float32
from ._checks import check_tensor, output
from ._launch import check_alias, identical

_FLOATS = (bfloat16, float16, float32)
_SUFFIX = {bfloat16: "bf16", float16: "f16", float32: "f32"}
_BLOCK = 256
_MAX_GRID = 1 << 20  # the kernel is grid-stride


def cast_reference(x: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the defined result
        return x.astype(np.float32).astype(dtype)


def cast(x: Tensor, dtype, out: Tensor | None = None) -> Tensor:
    """A copy of x converted to dtype (bfloat16, float16 or float32)."""
    check_tensor("x", x, dtype=_FLOATS)
    try:
        dtype = as_dtype(dtype)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"dtype: {exc}") from None
    if dtype not in _FLOATS:
        raise ValueError(f"dtype: {dtype} is not supported (supported: bfloat16, float16, float32)")
    if out is not None:
        check_tensor("out", out, device=x.device)
    out = output("out", out, x.shape, dtype, x.device)
    check_alias("out", out, "x", x, allow_identical=dtype == x.dtype)
    if x.numel == 0 or identical(out, x):
        return out
    if dtype == x.dtype:
        return out.copy_(x)
    if x.device == "cpu":
        out.array[...] = cast_reference(x.array, dtype)
        return out
    n = x.numel
    grid = min(-(-n // _BLOCK), _MAX_GRID)
    kernel("cast", f"cast_{_SUFFIX[x.dtype]}_to_{_SUFFIX[dtype]}")(grid, _BLOCK, x, out, np.int64(n))
    return out
