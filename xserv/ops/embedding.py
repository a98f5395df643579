"""Token embedding gather: out[t] = table[ids[t]]. An id outside [0, vocab) gives a zero row on both backends
(the engine validates ids before this point; the kernel never reads outside the table)."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, check_alias, check_int32_range, round_up


def embedding_reference(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids).astype(np.int64)
    valid = (ids >= 0) & (ids < table.shape[0])
    out = np.zeros((ids.shape[0], table.shape[1]), table.dtype)
    out[valid] = table[ids[valid]]
    return out


def embedding(ids: Tensor, table: Tensor, out: Tensor | None = None) -> Tensor:
    """ids: int32 [T], table: bf16 [V, H] -> out: bf16 [T, H], or float32 when `out` is float32 (the rows widened
    exactly: the decoder's fp32 residual stream starts from them)."""
    check_tensor("ids", ids, dtype=int32, ndim=1)
    check_tensor("table", table, dtype=bfloat16, ndim=2)
    device = same_device(ids=ids, table=table, out=out)
    (num_tokens,), (vocab, hidden) = ids.shape, table.shape
    check_int32_range("table", vocab)
    check_int32_range("table", hidden)
    out = output("out", out, (num_tokens, hidden), out.dtype if out is not None else bfloat16, device)
    if out.dtype not in (bfloat16, float32):
        raise ValueError(f"out: dtype {out.dtype}, expected bfloat16 or float32")
    check_alias("out", out, "table", table, allow_identical=False)
    check_alias("out", out, "ids", ids, allow_identical=False)
    if num_tokens == 0 or hidden == 0:
        return out
    if device == "cpu":
        out.array[...] = embedding_reference(ids.array, table.array)
        return out
    if out.dtype == float32:
        if hidden % 8 or not aligned(table, out):
            raise ValueError("embedding into float32: needs hidden % 8 == 0 and 16-byte aligned table and out")
        chunks = hidden // 8
        kernel("embedding", "embedding_bf16_to_f32_vec")(
            num_tokens, min(256, round_up(chunks, 32)), ids, table, out, np.int32(vocab), np.int32(chunks))
        return out
    if hidden % 8 == 0 and aligned(table, out):
        chunks = hidden // 8
        kernel("embedding", "embedding_bf16_vec")(
            num_tokens, min(256, round_up(chunks, 32)), ids, table, out, np.int32(vocab), np.int32(chunks))
    else:
        kernel("embedding", "embedding_bf16_scalar")(
            num_tokens, min(256, round_up(hidden, 32)), ids, table, out, np.int32(vocab), np.int32(hidden))
    return out
