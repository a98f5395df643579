"""Token embedding gather: out[t] = table[ids[t]]. An id outside [0, vocab) gives a zero row on both backends
(the engine validates ids before this point; the kernel never reads outside the table). With `feed`, the engine's
token feedback: row t's id is feed_src[feed_index[t]] where feed_index[t] >= 0 (a step launched before the previous
step's sampled tokens reached the host reads them on the device)."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, check_alias, check_int32_range, round_up


def fed_ids(ids: np.ndarray, feed_src: np.ndarray, feed_index: np.ndarray) -> np.ndarray:
    """The ids after the token feedback: feed_src[feed_index[t]] where feed_index[t] >= 0, else ids[t]."""
    ids = np.asarray(ids).copy()
    take = feed_index >= 0
    ids[take] = feed_src[feed_index[take]]
    return ids


def embedding_reference(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids).astype(np.int64)
    valid = (ids >= 0) & (ids < table.shape[0])
    out = np.zeros((ids.shape[0], table.shape[1]), table.dtype)
    out[valid] = table[ids[valid]]
    return out


def embedding(ids: Tensor, table: Tensor, out: Tensor | None = None,
              feed: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """ids: int32 [T], table: bf16 [V, H] -> out: bf16 [T, H], or float32 when `out` is float32 (the rows widened
    exactly: the decoder's fp32 residual stream starts from them). feed = (feed_src int32 [m], feed_index int32 [T]):
    the token feedback (module doc); feed_index values in [-1, m), range-checked on the CPU path only (they come
    from the engine)."""
    check_tensor("ids", ids, dtype=int32, ndim=1)
    check_tensor("table", table, dtype=bfloat16, ndim=2)
    feed_src, feed_index = feed if feed is not None else (None, None)
    if feed is not None:
        check_tensor("feed_src", feed_src, dtype=int32, ndim=1)
        check_tensor("feed_index", feed_index, dtype=int32, shape=ids.shape)
    device = same_device(ids=ids, table=table, out=out, feed_src=feed_src, feed_index=feed_index)
    (num_tokens,), (vocab, hidden) = ids.shape, table.shape
    check_int32_range("table", vocab)
    check_int32_range("table", hidden)
    out = output("out", out, (num_tokens, hidden), out.dtype if out is not None else bfloat16, device)
    if out.dtype not in (bfloat16, float32):
        raise ValueError(f"out: dtype {out.dtype}, expected bfloat16 or float32")
    check_alias("out", out, "table", table, allow_identical=False)
    check_alias("out", out, "ids", ids, allow_identical=False)
    if feed is not None:
        check_alias("out", out, "feed_src", feed_src, allow_identical=False)
        check_alias("out", out, "feed_index", feed_index, allow_identical=False)
    if num_tokens == 0 or hidden == 0:
        return out
    if device == "cpu":
        row_ids = ids.array
        if feed is not None:
            idx = feed_index.array
            if np.any(idx < -1) or np.any(idx >= feed_src.shape[0]):
                raise ValueError(f"feed_index: values must be in [-1, {feed_src.shape[0]})")
            row_ids = fed_ids(row_ids, feed_src.array, idx)
        out.array[...] = embedding_reference(row_ids, table.array)
        return out
    fed = (feed_src, feed_index) if feed is not None else (0, 0)  # null pointers: no feedback
    # programmatic dependent launch: the kernels wait for what wrote the ids (the next kernel's launch goes first)
    if out.dtype == float32:
        if hidden % 8 or not aligned(table, out):
            raise ValueError("embedding into float32: needs hidden % 8 == 0 and 16-byte aligned table and out")
        chunks = hidden // 8
        kernel("embedding", "embedding_bf16_to_f32_vec")(
            num_tokens, min(256, round_up(chunks, 32)), ids, table, out, np.int32(vocab), np.int32(chunks), *fed,
            pdl=True)
        return out
    if hidden % 8 == 0 and aligned(table, out):
        chunks = hidden // 8
        kernel("embedding", "embedding_bf16_vec")(
            num_tokens, min(256, round_up(chunks, 32)), ids, table, out, np.int32(vocab), np.int32(chunks), *fed,
            pdl=True)
    else:
        kernel("embedding", "embedding_bf16_scalar")(
            num_tokens, min(256, round_up(hidden, 32)), ids, table, out, np.int32(vocab), np.int32(hidden), *fed,
            pdl=True)
    return out
