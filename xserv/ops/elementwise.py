"""Elementwise ops on same-shape tensors (flattened): add."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, same_or_disjoint

_BLOCK = 256
# dtype -> (vectorised kernel, values per 16-byte vector, scalar kernel)
_ADD_KERNELS = {bfloat16: ("add_bf16_vec", 8, "add_bf16_scalar"), float32: ("add_f32_vec", 4, "add_f32_scalar")}


def add_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 sum (the caller rounds it to the dtype once)."""
    return a.astype(np.float32) + b.astype(np.float32)


def add(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """out = a + b; a, b: same shape, bf16 or float32. `out` may be `a` or `b`."""
    # The usual eager call (CUDA tensors of one supported dtype and shape; `out` new, or `a`, `b` or disjoint from
    # both) is checked in one expression; anything else takes the full checks, which name what is wrong.
    if (type(a) is Tensor and type(b) is Tensor and a.device == "cuda" and b.device == "cuda"
            and a.dtype is b.dtype and a.shape == b.shape):
        names = _ADD_KERNELS.get(a.dtype)
        if names is not None:
            if out is None:
                out = a.empty_like()  # a new block: it overlaps neither input
            elif not (type(out) is Tensor and out.device == "cuda" and out.dtype is a.dtype and out.shape == a.shape
                      and same_or_disjoint(out.ptr, a.ptr, a.nbytes) and same_or_disjoint(out.ptr, b.ptr, a.nbytes)):
                return _add_checked(a, b, out)
            n = a.numel
            if n:
                vec, per_vector, scalar = names
                if n % per_vector == 0 and not (a.ptr | b.ptr | out.ptr) & 15:
                    count = n // per_vector
                    kernel("elementwise", vec)(-(-count // _BLOCK), _BLOCK, a, b, out, count)
                else:
                    kernel("elementwise", scalar)(-(-n // _BLOCK), _BLOCK, a, b, out, n)
            return out
    return _add_checked(a, b, out)


def _add_checked(a: Tensor, b: Tensor, out: Tensor | None) -> Tensor:
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
    vec, per_vector, scalar = _ADD_KERNELS[a.dtype]
    if n % per_vector == 0 and aligned(a, b, out):
        count, name = n // per_vector, vec
    else:
        count, name = n, scalar
    # count is a Python int: the kernel's `long long` parameter takes it as an 8-byte value (see Kernel)
    kernel("elementwise", name)(cdiv(count, _BLOCK), _BLOCK, a, b, out, count)
    return out
