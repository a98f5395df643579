"""Elementwise ops on same-shape tensors (flattened): add."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias

_BLOCK = 256


def add_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 sum (the caller rounds it to the dtype once)."""
    return a.astype(np.float32) + b.astype(np.float32)


def add(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """out = a + b; a, b: same shape, bf16 or float32. `out` may be `a` or `b`."""
    check_tensor("a", a, dtype=(bfloat16, float32))
    check_tensor("b", b, dtype=a.dtype, shape=a.shape)
    device = same_device(a=a, b=b, out=out)
    out = output("out", out, a.shape, a.dtype, device)
    check_alias("out", out, "a", a, allow_identical=True)
    check_alias("out", out, "b", b, allow_identical=True)
    n = a.numel
    if n == 0:
        return out
    if device == "cpu":
        out.array[...] = add_reference(a.array, b.array).astype(out.dtype)
        return out
    suffix = "bf16" if a.dtype == bfloat16 else "f32"
    per_vector = 16 // a.itemsize
    if n % per_vector == 0 and aligned(a, b, out):
        count, name = n // per_vector, f"add_{suffix}_vec"
    else:
        count, name = n, f"add_{suffix}_scalar"
    kernel("elementwise", name)(cdiv(count, _BLOCK), _BLOCK, a, b, out, np.int64(count))
    return out
