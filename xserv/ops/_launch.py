"""Small helpers shared by the kernel launchers of xserv.ops (grid arithmetic, alignment and aliasing tests)."""
from __future__ import annotations

import math

import numpy as np

from ..tensor import Tensor

# The row-wise kernels between a decode step's projections (RMSNorm, SiLU-and-mul) launch with programmatic
# dependent launch up to this many rows, so that the GEMV after them starts early (rmsnorm.cu, activation.ptx).
PDL_MAX_ROWS = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def aligned(*tensors: Tensor | None, nbytes: int = 16) -> bool:
    """True when every given CUDA tensor's device address is a multiple of `nbytes`."""
    for t in tensors:
        if t is not None and t.ptr % nbytes:
            return False
    return True


def _start(t: Tensor) -> int:
    return t.ptr if t.device == "cuda" else t.array.__array_interface__["data"][0]


def overlaps(a: Tensor, b: Tensor) -> bool:
    """Do the memory ranges of two tensors (same device) intersect?"""
    if a is b:
        return a.nbytes != 0
    if a.device != b.device or a.nbytes == 0 or b.nbytes == 0:
        return False
    a0, b0 = (a.ptr, b.ptr) if a.device == "cuda" else (_start(a), _start(b))
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def same_or_disjoint(p: int, q: int, nbytes: int) -> bool:
    """Two ranges of `nbytes` bytes starting at device addresses p and q are the same range or do not intersect
    (the ops' fast paths: check_alias(allow_identical=True) for two same-size CUDA tensors, as one expression)."""
    return p == q or p + nbytes <= q or q + nbytes <= p


def disjoint(p: int, p_nbytes: int, q: int, q_nbytes: int) -> bool:
    """The ranges [p, p + p_nbytes) and [q, q + q_nbytes) do not intersect (an empty range intersects nothing)."""
    return p + p_nbytes <= q or q + q_nbytes <= p or not p_nbytes or not q_nbytes


def identical(a: Tensor, b: Tensor) -> bool:
    """Same device, same first byte, same size: one is the other (possibly as a different view)."""
    return a is b or (a.device == b.device and a.nbytes == b.nbytes and _start(a) == _start(b))


def check_alias(name: str, out: Tensor, other_name: str, other: Tensor, allow_identical: bool) -> None:
    """`out` must not overlap `other`, except (when allowed) by being exactly the same memory."""
    if overlaps(out, other) and not (allow_identical and identical(out, other)):
        how = "partially overlaps" if allow_identical else "overlaps"
        raise ValueError(f"{name}: {how} {other_name}" + (f" (only {name} is {other_name} is allowed)" if allow_identical else ""))


def check_eps(eps) -> np.float32:
    if type(eps) is float and 0.0 <= eps < math.inf:  # the usual call, checked in one comparison chain
        return np.float32(eps)
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    return np.float32(eps)


def check_int32_range(name: str, value: int) -> None:
    if value >= 2**31:
        raise ValueError(f"{name}: {value} does not fit the kernel's int32 index")


_pools: dict[int, list] = {}  # every pool pooled_buffer() has allocated into, by id


def pooled_buffer(pool: list[Tensor], count: int, dtype, minimum: int, zeroed: bool = False) -> Tensor:
    """A CUDA buffer of at least `count` elements from `pool`, allocated (`minimum` at least) when none is large
    enough and kept in the pool until `release_pooled_buffers()`: CUDA graphs may have captured its address. zeroed:
    filled with zeros when allocated (counters that the kernels reset themselves)."""
    for t in pool:
        if t.shape[0] >= count:
            return t
    _pools[id(pool)] = pool
    shape = (max(count, minimum),)
    t = Tensor.zeros(shape, dtype, "cuda") if zeroed else Tensor.empty(shape, dtype, "cuda")
    pool.append(t)
    return t


def release_pooled_buffers() -> None:
    """Empty every pool of pooled_buffer(): only when no CUDA graph that may hold their addresses is left (the last
    LLM has been closed)."""
    for pool in _pools.values():
        pool.clear()
