"""The output gate of Qwen3.5's gated attention (cuda_src/attention_gate.cu): out = attn * sigmoid(gate) element-wise,
gate = the trailing Hq heads of the packed qkvg [T, 2 Hq + 2 Hkv, D] (columns [q | k | v | gate], head-major like
attn), before o_proj. fp32 math, one rounding to bf16."""
from __future__ import annotations

import numpy as np

from ...runtime import kernel
from ...tensor import Tensor, bfloat16
from .._checks import check_aligned, check_tensor, output, same_device
from .._launch import cdiv, check_alias

_THREADS = 256


def attention_output_gate_reference(attn: np.ndarray, gate: np.ndarray, dtype=np.float32) -> np.ndarray:
    """attn * sigmoid(gate) in `dtype` (attn, gate [T, Hq, D])."""
    a, g = attn.astype(dtype), gate.astype(dtype)
    return a / (dtype(1) + np.exp(-g))


def attention_output_gate(attn: Tensor, qkvg: Tensor, num_q_heads: int, num_kv_heads: int,
                          out: Tensor | None = None) -> Tensor:
    """attn bf16 [T, Hq, D] (the attention output), qkvg bf16 [T, 2 Hq + 2 Hkv, D] -> out bf16 [T, Hq, D] =
    attn * sigmoid(qkvg[:, Hq + 2 Hkv:]); out may be attn itself (in place), not any other overlap. All 16-byte
    aligned on the GPU."""
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    check_tensor("attn", attn, dtype=bfloat16, ndim=3)
    num_tokens, heads, head_dim = attn.shape
    if heads != num_q_heads:
        raise ValueError(f"attn: {heads} heads, expected num_q_heads = {num_q_heads}")
    if head_dim % 8:
        raise ValueError(f"attn: head_dim {head_dim} is not a multiple of 8")
    gate_head = num_q_heads + 2 * num_kv_heads
    check_tensor("qkvg", qkvg, dtype=bfloat16, shape=(num_tokens, gate_head + num_q_heads, head_dim))
    device = same_device(attn=attn, qkvg=qkvg, out=out)
    out = output("out", out, attn.shape, bfloat16, device)
    check_alias("out", out, "attn", attn, allow_identical=True)
    check_alias("out", out, "qkvg", qkvg, allow_identical=False)
    if num_tokens == 0:
        return out
    if device == "cpu":
        out.array[...] = attention_output_gate_reference(attn.array, qkvg.array[:, gate_head:]).astype(bfloat16)
        return out
    for name, t in (("attn", attn), ("qkvg", qkvg), ("out", out)):
        check_aligned(name, t)
    row = num_q_heads * head_dim
    kernel("attention_gate", "attention_output_gate_bf16")(
        cdiv(num_tokens * row // 8, _THREADS), _THREADS, attn, qkvg, out, np.int64(num_tokens), np.int32(row),
        np.int64(qkvg.shape[1] * head_dim), np.int64(gate_head * head_dim))
    return out
