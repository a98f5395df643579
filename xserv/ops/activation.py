"""SwiGLU on the fused [gate; up] projection: out = silu(x[:, :I]) * x[:, I:].

silu in fp32 as g / (1 + exp(-g)); rounding matches Hugging Face's bf16 `act_fn(gate) * up`: the silu output is
rounded to bf16, then the product is rounded to bf16 again (kernel and reference)."""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16
from ._checks import check_tensor, output, same_device
from ._launch import PDL_MAX_ROWS, aligned, cdiv, check_alias, check_int32_range

_BLOCK = 256


def silu_and_mul_reference(x: np.ndarray) -> np.ndarray:
    """x [T, 2I] -> float32 [T, I]."""
    inter = x.shape[-1] // 2
    xf = x.astype(np.float32)
    gate, up = xf[..., :inter], xf[..., inter:]
    with np.errstate(over="ignore"):  # exp(-g) = inf for g < -88 gives silu = -0, as on the GPU
        silu = gate / (np.float32(1) + np.exp(-gate))
    return silu.astype(x.dtype).astype(np.float32) * up


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """x: bf16 [T, 2I] (gate first, up second) -> out: bf16 [T, I]."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    num_tokens, width = x.shape
    if width == 0 or width % 2:
        raise ValueError(f"x: last dimension {width} must be a positive even number (gate and up halves)")
    inter = width // 2
    check_int32_range("x", width)
    device = same_device(x=x, out=out)
    out = output("out", out, (num_tokens, inter), bfloat16, device)
    check_alias("out", out, "x", x, allow_identical=False)
    if num_tokens == 0:
        return out
    if device == "cpu":
        out.array[...] = silu_and_mul_reference(x.array).astype(out.dtype)
        return out
    if inter % 8 == 0 and aligned(x, out):
        work, name = num_tokens * (inter // 8), "silu_and_mul_bf16_vec"
    else:
        work, name = num_tokens * inter, "silu_and_mul_bf16_scalar"
    kernel("activation", name)(cdiv(work, _BLOCK), _BLOCK, x, out, np.int64(num_tokens), np.int32(inter),
                               pdl=num_tokens <= PDL_MAX_ROWS)
    return out
