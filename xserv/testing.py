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


def paged_kv_from_dense(rng: np.random.Generator, ks: list[np.ndarray], vs: list[np.ndarray], block_size: int,
                        spare_blocks: int = 2, fill=np.nan, unused_entry: int = -1):
    """Scatter per-sequence dense K/V ([kv_len_s, Hkv, D] each) into a paged cache whose blocks are randomly
    permuted (non-contiguous, out of order). Returns (k_cache, v_cache, block_tables) as NumPy arrays; cache slots
    no sequence owns hold `fill` and block-table entries past a sequence's blocks hold `unused_entry`."""
    num_kv_heads, head_dim = ks[0].shape[1:]
    counts = [-(-k.shape[0] // block_size) for k in ks]
    num_blocks = sum(counts) + spare_blocks
    order = rng.permutation(num_blocks)
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_dim), fill, ks[0].dtype)
    v_cache = np.full_like(k_cache, fill)
    tables = np.full((len(ks), max(max(counts), 1)), unused_entry, np.int32)
    nxt = 0
    for s, (k, v) in enumerate(zip(ks, vs)):
        blocks = order[nxt:nxt + counts[s]]
        nxt += counts[s]
        tables[s, :counts[s]] = blocks
        for i, b in enumerate(blocks):
            rows = slice(i * block_size, min((i + 1) * block_size, k.shape[0]))
            n = rows.stop - rows.start
            k_cache[b, :n] = k[rows]
            v_cache[b, :n] = v[rows]
    return k_cache, v_cache, tables


def agree_until_near_tie(alone, together, gap: float) -> bool:
    """Two RequestOutputs of the same greedy request (run alone, run in a batch) give the same tokens up to the
    first position where the alone run's top two log-probabilities are within `gap` nats (that position itself may
    differ): the batch-invariance check of the GPU tests (`alone` needs logprobs with the top two)."""
    for entry, a, b in zip(alone.logprobs, alone.token_ids, together.token_ids):
        top = entry["top"]
        if len(top) >= 2 and top[0][1] - top[1][1] < gap:
            return True
        if a != b:
            return False
    return len(alone.token_ids) == len(together.token_ids)
