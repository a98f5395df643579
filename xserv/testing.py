"""Helpers for checking kernels against their references (used by tests and the kernel harness)."""
from __future__ import annotations

import contextlib

import numpy as np

from .tensor import Tensor


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere in `out` gives inf."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {out.shape} vs {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def random_array(rng: np.random.Generator, shape, dtype, mean: float = 0.1, std: float = 1.0) -> np.ndarray:
    """Normal values with the mean shifted off 0, rounded to `dtype` (so references see exactly the inputs)."""
    return (rng.standard_normal(shape) * std + mean).astype(np.float32).astype(dtype)


_poisoning = True


@contextlib.contextmanager
def no_poisoning():
    """Within this block `poisoned` returns plain uninitialised buffers: benchmarks must not time the fill."""
    global _poisoning
    saved, _poisoning = _poisoning, False
    try:
        yield
    finally:
        _poisoning = saved


def poisoned(shape, dtype, device="cuda") -> Tensor:
    """An output buffer filled with NaN (or -1 for integers) so that unwritten elements show."""
    dt = np.dtype(dtype)
    if not _poisoning:
        return Tensor.empty(shape, dt, device)
    fill = -1 if np.issubdtype(dt, np.integer) else np.nan
    return Tensor.full(shape, fill, dt, device)


def misaligned(array: np.ndarray, device: str = "cuda") -> Tensor:
    """A copy of `array` whose first element sits one element past an allocation's start (2 bytes for bf16, so
    not 16-byte aligned): makes launchers take their unaligned (scalar) kernels."""
    flat = Tensor.from_numpy(np.concatenate([np.zeros(1, array.dtype), array.reshape(-1)]), device)
    return flat[1:].view(*array.shape)
