"""Argument checks shared by every op launcher: a wrong call raises ValueError naming the argument and never
reaches the GPU. Each check runs on every eager launch, so the passing case is a few comparisons; the messages are
built only on the way to raising."""
from __future__ import annotations

from ..tensor import Tensor


def check_tensor(name: str, t, *, dtype=None, ndim: int | None = None, shape: tuple | None = None,
                 device: str | None = None) -> Tensor:
    """`dtype` may be one dtype or a tuple/list of them; `shape` may hold None for a free dimension."""
    if type(t) is not Tensor and not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype is not dtype:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: dtype {t.dtype}, expected {' or '.join(str(d) for d in allowed)}")
    if ndim is not None and len(t.shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {t.shape}")
    if shape is not None and t.shape != shape:  # equal tuples pass at once; a None in `shape` takes the loop
        if len(shape) != len(t.shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: shape {list(t.shape)}, expected {want}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    return t


def same_device(**tensors: Tensor) -> str:
    """The one device of the given tensors (None values skipped)."""
    device = None
    for t in tensors.values():
        if t is not None:
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError("tensors on different devices: "
                                 + ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if t is not None))
    return device


def check_aligned(name: str, t: Tensor, nbytes: int = 16) -> None:
    if t.device == "cuda" and t.ptr % nbytes:
        raise ValueError(f"{name}: device address 0x{t.ptr:x} is not {nbytes}-byte aligned")


def output(name: str, out: Tensor | None, shape: tuple, dtype, device: str) -> Tensor:
    """The given output tensor, checked, or a new one."""
    if out is None:
        return Tensor.empty(shape, dtype, device)
    return check_tensor(name, out, dtype=dtype, shape=shape, device=device)
