"""Row argmax (greedy sampling): out[b] = argmax(x[b, :]) as int32.

Ties go to the lowest index. NaN counts as larger than every number, so a row holding NaN returns the index of
its first NaN (what np.argmax and torch.argmax do)."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, check_alias, check_int32_range, round_up


def argmax_reference(x: np.ndarray) -> np.ndarray:
    return np.argmax(x.astype(np.float32), axis=-1).astype(np.int32)


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
    else:
        work, name = vocab, f"argmax_{suffix}"
    threads = min(1024, round_up(work, 32))
    kernel("argmax", name)(batch, threads, x, out, np.int32(vocab))
    return out
