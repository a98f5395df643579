"""Row argmax (greedy sampling): out[b] = argmax(x[b, :]) as int32.

Ties go to the lowest index. NaN counts as larger than every number, so a row holding NaN returns the index of
its first NaN (what np.argmax and torch.argmax do).

Few float32 rows (greedy decode of a few sequences) spread each row over several CTAs (argmax_f32_vec_split), so the
GPU reads a 150k-entry row in parallel instead of with one CTA."""
from __future__ import annotations

import numpy as np

from ..runtime import get_device, kernel
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, check_int32_range, pooled_buffer, round_up

SPLIT_THREADS = 256
SPLIT_MIN_FLOAT4 = 512  # no split scans fewer float4s than this (2 per thread): below, the reduction dominates
# The split kernel's candidate values and indices and its per-row counters (pooled_buffer: kept for the life of the
# process, as CUDA graphs capture their addresses; the counters are zeroed once and reset by the kernel).
_split_values: list[Tensor] = []
_split_indices: list[Tensor] = []
_split_counters: list[Tensor] = []


def argmax_reference(x: np.ndarray) -> np.ndarray:
    return np.argmax(x.astype(np.float32), axis=-1).astype(np.int32)


def split_plan(batch: int, vocab: int, multiprocessor_count: int) -> int:
    """Splits per row for the float32 vector kernel: about one CTA per SM in all, none scanning fewer than
    SPLIT_MIN_FLOAT4 float4s; 1 runs the one-CTA-per-row kernel."""
    return max(1, min(multiprocessor_count // max(batch, 1), (vocab // 4) // SPLIT_MIN_FLOAT4))


def argmax(x: Tensor, out: Tensor | None = None) -> Tensor:
    """x: float32 or bf16 [B, V] -> out: int32 [B]."""
    check_tensor("x", x, dtype=(float32, bfloat16), ndim=2)
    batch, vocab = x.shape
    if vocab == 0:
        raise ValueError("x: vocabulary dimension is 0")
    check_int32_range("x", vocab)
    device = same_device(x=x, out=out)
    out = output("out", out, (batch,), int32, device)
    check_alias("out", out, "x", x, allow_identical=False)
    if batch == 0:
        return out
    if device == "cpu":
        out.array[...] = argmax_reference(x.array)
        return out
    suffix = "bf16" if x.dtype == bfloat16 else "f32"
    per_vector = 16 // x.itemsize
    if vocab % per_vector == 0 and aligned(x):
        work, name = vocab // per_vector, f"argmax_{suffix}_vec"
        splits = split_plan(batch, vocab, get_device().multiprocessor_count) if suffix == "f32" else 1
        if splits > 1:
            chunk4 = cdiv(vocab // 4, splits)
            splits = cdiv(vocab // 4, chunk4)  # every split non-empty
            values = pooled_buffer(_split_values, batch * splits, float32, 4096)
            indices = pooled_buffer(_split_indices, batch * splits, int32, 4096)
            counters = pooled_buffer(_split_counters, batch, int32, 1024, zeroed=True)
            kernel("argmax", "argmax_f32_vec_split")((splits, batch), SPLIT_THREADS, x, out, np.int32(vocab),
                                                     np.int32(chunk4), values, indices, counters)
            return out
    else:
        work, name = vocab, f"argmax_{suffix}"
    threads = min(1024, round_up(work, 32))
    kernel("argmax", name)(batch, threads, x, out, np.int32(vocab))
    return out
