"""Row gather of int32 values with a keep marker: out[i] = src[index[i]] where index[i] >= 0, else unchanged.
The engine uses it to feed one step's sampled tokens into the next step's input ids on the device."""
from __future__ import annotations

import numpy as np

from ..tensor import Tensor, int32
from ._checks import check_tensor, same_device
from ._launch import cdiv, check_alias

_BLOCK = 256


def gather_reference(src: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
    result = out.copy()
    take = index >= 0
    result[take] = src[index[take]]
    return result


def gather(src: Tensor, index: Tensor, out: Tensor) -> Tensor:
    """src int32 [m], index int32 [n] (values in [-1, m)), out int32 [n], updated in place. Indices are not
    range-checked on the device (they come from the engine); the CPU path checks them."""
    check_tensor("src", src, dtype=int32, ndim=1)
    check_tensor("index", index, dtype=int32, ndim=1)
    check_tensor("out", out, dtype=int32, shape=index.shape)
    device = same_device(src=src, index=index, out=out)
    check_alias("out", out, "src", src, allow_identical=False)
    check_alias("out", out, "index", index, allow_identical=False)
    n = index.shape[0]
    if n == 0:
        return out
    if device == "cpu":
        idx = index.array
        if np.any(idx >= src.shape[0]) or np.any(idx < -1):
            raise ValueError(f"index: values must be in [-1, {src.shape[0]})")
        out.array[...] = gather_reference(src.array, idx, out.array)
        return out
    from ..runtime import kernel

    kernel("gather", "gather_i32")(cdiv(n, _BLOCK), _BLOCK, src, index, out, np.int32(n))
    return out
