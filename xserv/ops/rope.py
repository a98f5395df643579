"""Rotary position embedding (Qwen3 / Llama / GPT-NeoX rotate-half layout), its cos/sin table (default, YaRN or
Llama 3 scaling, as Hugging Face transformers computes them), and RoPE applied in place to the q and k heads of the
packed QKV, with the q/k head-RMSNorm fused in (Qwen3: qk_norm_rope) or without it (Llama: qk_rope).

Partial RoPE (Qwen3.5's gated attention, head_dim 256): only the first rotary_dim = cos_sin.shape[1] values of a head
rotate (rotate-half within that slice, pairs (i, i + rotary_dim/2)); the table is rope_cos_sin_table(rotary_dim, ...)
(rotary_dim/2 frequencies theta^(-2i/rotary_dim), as transformers computes them). qk_norm_rope_write_kv and
attention_decode_rope take it for head_dim 256 (PARTIAL_ROTARY), on the packed qkv or the gated qkvg
[T, 2 Hq + 2 Hkv, D] whose trailing Hq gate heads they leave untouched.

For a head vector v of D values at position p, with c_i = cos_sin[p, i], s_i = cos_sin[p, D/2 + i], i < D/2:
    out[i] = v[i] c_i - v[i + D/2] s_i,    out[i + D/2] = v[i + D/2] c_i + v[i] s_i.
Positions live on the device, so the CUDA launcher cannot check them: a position outside [0, max_pos) makes the
kernel write NaN into that head row (it never reads outside the table); the CPU path raises ValueError.
"""
from __future__ import annotations

import math

import numpy as np

from ..runtime import kernel
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_aligned, check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, check_eps, check_int32_range
from .attention._args import check_cache, is_fp8
from .attention.fp8_kv import write_kv_fp8_reference
from .attention.kv_write import write_kv_packed
from .attention.reference import write_kv_reference
from .rmsnorm import HEAD_DIMS, head_rmsnorm_reference

_BLOCK = 256  # 8 warps
_ROWS_PER_WARP = 2  # kRowsPerWarp in rope.cu (warp-per-row kernels)
_FUSED_STEPS = 1  # qk_norm_rope_write_kv: row groups of 32 / (D / 16) rows per warp (its kernels' _s suffix)
# head_dim -> the rotary_dim its partial-RoPE kernels are compiled for (rope.cu: qk_norm_rope_write_kv_d256_r64_s1;
# head norms only). These head dims take the gated qkvg as well.
PARTIAL_ROTARY = {256: 64}


# ---- the table ---------------------------------------------------------------------------------------------------
# The one implementation of the inverse frequencies (configs validate rope_scaling; they do not compute with it).
# Each scaled variant follows transformers' ROPE_INIT_FUNCTIONS, in float32 where transformers computes in float32.
ROPE_TYPES = ("default", "yarn", "llama3")


def _scaling_number(scaling: dict, key: str, rope_type: str) -> float:
    value = scaling.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"rope_scaling: {rope_type} needs a number {key!r}, got {value!r}")
    return float(value)


def _yarn_inv_freq(dim: int, base: float, scaling: dict, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' `_compute_yarn_parameters`."""
    factor = _scaling_number(scaling, "factor", "yarn")
    original = _scaling_number(scaling, "original_max_position_embeddings", "yarn")

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = np.float32(1) - ramp.astype(np.float32)
    inv_extrapolation = np.float32(1) / pos_freqs
    inv_interpolation = np.float32(1) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_interpolation * (np.float32(1) - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3_inv_freq(scaling: dict, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' `_compute_llama3_parameters`: wavelengths shorter than original / high_freq_factor keep their
    frequency, those longer than original / low_freq_factor are divided by `factor`, and the band between
    interpolates smoothly. No attention factor."""
    factor = _scaling_number(scaling, "factor", "llama3")
    low_freq_factor = _scaling_number(scaling, "low_freq_factor", "llama3")
    high_freq_factor = _scaling_number(scaling, "high_freq_factor", "llama3")
    original = _scaling_number(scaling, "original_max_position_embeddings", "llama3")
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"rope_scaling: llama3 needs high_freq_factor > low_freq_factor, got {high_freq_factor} "
                         f"and {low_freq_factor}")
    inv_freq = np.float32(1) / pos_freqs
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > np.float32(original / low_freq_factor), inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(original) / wavelen - np.float32(low_freq_factor)) / np.float32(high_freq_factor - low_freq_factor)
    smoothed = (np.float32(1) - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < np.float32(original / high_freq_factor)) & ~(wavelen > np.float32(original / low_freq_factor))
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies float32 [head_dim // 2], attention factor that scales cos and sin) for rope_scaling None
    or {"rope_type": "default" | "yarn" | "llama3", ...}, as transformers computes them."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even number, got {head_dim}")
    if not theta > 1:
        raise ValueError(f"theta: expected > 1, got {theta}")
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32)
    rope_type = None if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return np.float32(1) / pos_freqs, 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, float(theta), rope_scaling, pos_freqs)
    if rope_type == "llama3":
        return _llama3_inv_freq(rope_scaling, pos_freqs)
    raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def rope_cos_sin_table(head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None = None) -> np.ndarray:
    """float32 [max_positions, head_dim]: cos(p * inv_freq_i) in the first half, sin in the second (times YaRN's
    attention factor). Computed like transformers' rotary embedding in float32: inv_freq in float32, the angle
    p * inv_freq rounded to float32, then cos/sin of that angle."""
    if max_positions <= 0:
        raise ValueError(f"max_positions: expected > 0, got {max_positions}")
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, rope_scaling)
    angle = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    cos = np.cos(angle.astype(np.float64)).astype(np.float32)
    sin = np.sin(angle.astype(np.float64)).astype(np.float32)
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return np.ascontiguousarray(np.concatenate([cos, sin], axis=1), dtype=np.float32)


# ---- references --------------------------------------------------------------------------------------------------
def rope_reference(x: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray) -> np.ndarray:
    """x [T, H, D] -> float32 [T, H, D]; cos_sin [max_pos, R] with R <= D rotates the first R values of each head
    (partial RoPE), the rest pass through."""
    positions = np.asarray(positions).astype(np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= cos_sin.shape[0]):
        raise ValueError(f"positions: values must lie in [0, {cos_sin.shape[0]}), got [{positions.min()}, {positions.max()}]")
    rotary = cos_sin.shape[1]
    half = rotary // 2
    table = cos_sin.astype(np.float32)[positions][:, None, :]  # [T, 1, R]
    c, s = table[..., :half], table[..., half:]
    xf = x.astype(np.float32)
    lo, hi = xf[..., :half], xf[..., half:rotary]
    return np.concatenate([lo * c - hi * s, hi * c + lo * s, xf[..., rotary:]], axis=-1)


def qk_rope_reference(qkv: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray, num_q_heads: int,
                      num_kv_heads: int) -> np.ndarray:
    """The new packed qkv (its dtype): RoPE on the q and k heads, v heads unchanged."""
    out = qkv.copy()
    qk = num_q_heads + num_kv_heads
    out[:, :qk] = rope_reference(qkv[:, :qk], positions, cos_sin).astype(qkv.dtype)
    return out


def qk_norm_rope_reference(qkv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, positions: np.ndarray,
                           cos_sin: np.ndarray, num_q_heads: int, num_kv_heads: int, eps: float) -> np.ndarray:
    """The new packed qkv (its dtype): head RMSNorm rounded to the dtype (as HF's q_norm/k_norm), then RoPE."""
    out = qkv.copy()
    for start, stop, weight in ((0, num_q_heads, q_weight), (num_q_heads, num_q_heads + num_kv_heads, k_weight)):
        normed = head_rmsnorm_reference(qkv[:, start:stop], weight, eps).astype(qkv.dtype)
        out[:, start:stop] = rope_reference(normed, positions, cos_sin).astype(qkv.dtype)
    return out


def qk_norm_rope_write_kv_reference(qkv: np.ndarray, q_weight: np.ndarray | None, k_weight: np.ndarray | None,
                                    positions: np.ndarray, cos_sin: np.ndarray, num_q_heads: int, num_kv_heads: int,
                                    eps: float, k_cache: np.ndarray, v_cache: np.ndarray,
                                    slot_mapping: np.ndarray, k_scale: np.ndarray | None = None,
                                    v_scale: np.ndarray | None = None) -> np.ndarray:
    """The composition qk_norm_rope (or qk_rope when both weights are None), then write_kv_packed: returns the new
    packed qkv and writes k_cache / v_cache in place (an FP8 cache, with k_scale / v_scale: quantized). A gated qkvg
    (heads past Hq + 2 Hkv: the output gate's) keeps those heads as they are."""
    if q_weight is None:
        out = qk_rope_reference(qkv, positions, cos_sin, num_q_heads, num_kv_heads)
    else:
        out = qk_norm_rope_reference(qkv, q_weight, k_weight, positions, cos_sin, num_q_heads, num_kv_heads, eps)
    k, v = out[:, num_q_heads:num_q_heads + num_kv_heads], out[:, num_q_heads + num_kv_heads:num_q_heads + 2 * num_kv_heads]
    if k_scale is None:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_fp8_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return out


# ---- ops ---------------------------------------------------------------------------------------------------------
def _check_head_dim(name: str, head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {head_dim} is not supported (supported: {HEAD_DIMS})")


def _check_positions_table(positions: Tensor, cos_sin: Tensor, num_tokens: int, rotary_dim: int) -> None:
    check_tensor("positions", positions, dtype=int32, shape=(num_tokens,))
    check_tensor("cos_sin", cos_sin, dtype=float32, ndim=2)
    if cos_sin.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin: shape {list(cos_sin.shape)}, expected [max_positions, {rotary_dim}]")
    check_int32_range("cos_sin", cos_sin.shape[0])


def rope(x: Tensor, positions: Tensor, cos_sin: Tensor, out: Tensor | None = None) -> Tensor:
    """x: bf16 [T, num_heads, D], positions: int32 [T], cos_sin: float32 [max_pos, D] -> out (may be x)."""
    check_tensor("x", x, dtype=bfloat16, ndim=3)
    num_tokens, num_heads, head_dim = x.shape
    _check_head_dim("x", head_dim)
    _check_positions_table(positions, cos_sin, num_tokens, head_dim)
    check_int32_range("x", num_heads)
    device = same_device(x=x, positions=positions, cos_sin=cos_sin, out=out)
    out = output("out", out, x.shape, bfloat16, device)
    check_alias("out", out, "x", x, allow_identical=True)
    rows = num_tokens * num_heads
    if rows == 0:
        return out
    if device == "cpu":
        out.array[...] = rope_reference(x.array, positions.array, cos_sin.array).astype(out.dtype)
        return out
    args = (x, positions, cos_sin, out, np.int64(rows), np.int32(num_heads), np.int32(cos_sin.shape[0]))
    if aligned(x, out, cos_sin, nbytes=16):  # 16-byte accesses, D/16 threads per row
        kernel("rope", f"rope_d{head_dim}_bf16_vec16")(cdiv(rows * (head_dim // 16), _BLOCK), _BLOCK, *args)
        return out
    name = f"rope_d{head_dim}_bf16"
    if head_dim == 128 and not aligned(x, out, nbytes=4):
        name += "_scalar"
    kernel("rope", name)(cdiv(rows, _ROWS_PER_WARP * _BLOCK // 32), _BLOCK, *args)
    return out


def check_packed_qkv(qkv: Tensor, positions: Tensor, cos_sin: Tensor, num_q_heads: int, num_kv_heads: int,
                     partial: bool = False) -> int:
    """Checks shared by the ops that take the packed qkv with positions (qk_rope, qk_norm_rope, attention_decode_rope);
    returns head_dim. partial=True (qk_norm_rope_write_kv, attention_decode_rope) also admits the head dims of
    PARTIAL_ROTARY, whose cos_sin is [max_pos, rotary_dim] and whose qkv may be the gated qkvg [T, 2 Hq + 2 Hkv, D]."""
    check_tensor("qkv", qkv, dtype=bfloat16, ndim=3)
    num_tokens, all_heads, head_dim = qkv.shape
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    gated = partial and head_dim in PARTIAL_ROTARY
    if all_heads != num_q_heads + 2 * num_kv_heads and not (gated and all_heads == 2 * num_q_heads + 2 * num_kv_heads):
        raise ValueError(f"qkv: {all_heads} heads, expected num_q_heads + 2 * num_kv_heads = "
                         f"{num_q_heads + 2 * num_kv_heads}" + (f" (or {2 * num_q_heads + 2 * num_kv_heads} with "
                                                                f"the gate heads)" if gated else ""))
    if not gated:
        _check_head_dim("qkv", head_dim)
    check_int32_range("qkv", all_heads)
    _check_positions_table(positions, cos_sin, num_tokens, PARTIAL_ROTARY[head_dim] if gated else head_dim)
    return head_dim


def check_head_norms(q_weight: Tensor | None, k_weight: Tensor | None, head_dim: int) -> bool:
    """Both head-RMSNorm weights (Qwen3) or neither (Llama); True when given."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight, k_weight: give both (Qwen3's head norms) or neither (Llama)")
    if q_weight is None:
        return False
    check_tensor("q_weight", q_weight, dtype=bfloat16, shape=(head_dim,))
    check_tensor("k_weight", k_weight, dtype=bfloat16, shape=(head_dim,))
    return True


def _launch_packed(family_kernel: str, qkv: Tensor, num_q_heads: int, num_kv_heads: int, *args) -> None:
    """Launch a qk_rope / qk_norm_rope kernel: one warp per (token, q-or-k head) row, kRowsPerWarp rows a warp."""
    num_tokens, _, head_dim = qkv.shape
    check_int32_range("qkv", num_tokens)
    name = f"{family_kernel}_d{head_dim}_bf16"
    if head_dim == 128 and not aligned(qkv, nbytes=4):
        name += "_scalar"
    rows = num_tokens * (num_q_heads + num_kv_heads)
    kernel("rope", name)(cdiv(rows, _ROWS_PER_WARP * _BLOCK // 32), _BLOCK, qkv, *args)


def qk_rope(qkv: Tensor, positions: Tensor, cos_sin: Tensor, num_q_heads: int, num_kv_heads: int) -> Tensor:
    """In place on the packed QKV projection qkv: bf16 [T, Hq + 2 Hkv, D]: RoPE on heads [0, Hq + Hkv) (q and k),
    the v heads untouched (Llama: no head norms). Returns qkv."""
    check_packed_qkv(qkv, positions, cos_sin, num_q_heads, num_kv_heads)
    device = same_device(qkv=qkv, positions=positions, cos_sin=cos_sin)
    for name, t in (("positions", positions), ("cos_sin", cos_sin)):
        check_alias(name, t, "qkv", qkv, allow_identical=False)
    if qkv.shape[0] == 0:
        return qkv
    if device == "cpu":
        qkv.array[...] = qk_rope_reference(qkv.array, positions.array, cos_sin.array, int(num_q_heads),
                                           int(num_kv_heads))
        return qkv
    _launch_packed("qk_rope", qkv, num_q_heads, num_kv_heads, positions, cos_sin, np.int32(qkv.shape[0]),
                   np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(cos_sin.shape[0]))
    return qkv


def qk_norm_rope(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, cos_sin: Tensor,
                 num_q_heads: int, num_kv_heads: int, eps: float) -> Tensor:
    """In place on the packed QKV projection qkv: bf16 [T, Hq + 2 Hkv, D]: heads [0, Hq) get head-RMSNorm(q_weight)
    then RoPE, heads [Hq, Hq + Hkv) head-RMSNorm(k_weight) then RoPE, the v heads are untouched. Returns qkv."""
    head_dim = check_packed_qkv(qkv, positions, cos_sin, num_q_heads, num_kv_heads)
    check_tensor("q_weight", q_weight, dtype=bfloat16, shape=(head_dim,))
    check_tensor("k_weight", k_weight, dtype=bfloat16, shape=(head_dim,))
    eps32 = check_eps(eps)
    device = same_device(qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions, cos_sin=cos_sin)
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight), ("positions", positions), ("cos_sin", cos_sin)):
        check_alias(name, t, "qkv", qkv, allow_identical=False)
    if qkv.shape[0] == 0:
        return qkv
    if device == "cpu":
        qkv.array[...] = qk_norm_rope_reference(qkv.array, q_weight.array, k_weight.array, positions.array,
                                                cos_sin.array, int(num_q_heads), int(num_kv_heads), eps32)
        return qkv
    _launch_packed("qk_norm_rope", qkv, num_q_heads, num_kv_heads, q_weight, k_weight, positions, cos_sin,
                   np.int32(qkv.shape[0]), np.int32(num_q_heads), np.int32(num_kv_heads),
                   np.int32(cos_sin.shape[0]), eps32)
    return qkv


def qk_norm_rope_write_kv(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, positions: Tensor,
                          cos_sin: Tensor, num_q_heads: int, num_kv_heads: int, eps: float, k_cache: Tensor,
                          v_cache: Tensor, slot_mapping: Tensor, pdl: bool = False, k_scale: Tensor | None = None,
                          v_scale: Tensor | None = None) -> Tensor:
    """qk_norm_rope (q_weight, k_weight given: Qwen3) or qk_rope (both None: Llama) in place on the packed qkv
    bf16 [T, Hq + 2 Hkv, D], then write_kv_packed of its (rotated) k heads and its v heads into the paged cache
    (k_cache, v_cache bf16 [num_blocks, block_size, Hkv, D]; slot_mapping int32 [T], slot < 0 skips the token), in one
    launch; the results are bit-identical to the two ops run one after the other. qkv's v heads are not written.
    qkv, cos_sin and the caches must be 16-byte aligned (the kernel's accesses are 16 bytes wide).
    pdl=True launches it with programmatic dependent launch (the kernel waits before reading qkv). Returns qkv.
    An FP8 cache (float8_e4m3fn, with this layer's k_scale / v_scale float32 [Hkv]): the same one launch, its cache
    store quantizing as write_kv_fp8 does (the bits of qk_norm_rope / qk_rope then write_kv_packed quantizing).
    Head dims of PARTIAL_ROTARY (256: Qwen3.5's gated attention; head norms required): cos_sin [max_pos, rotary_dim]
    (rope_cos_sin_table(rotary_dim, ...)) rotates the first rotary_dim values of each q/k head; qkv may be the gated
    qkvg [T, 2 Hq + 2 Hkv, D] (q | k | v | gate heads), whose gate heads are neither read nor written."""
    head_dim = check_packed_qkv(qkv, positions, cos_sin, num_q_heads, num_kv_heads, partial=True)
    norm = check_head_norms(q_weight, k_weight, head_dim)
    rotary_dim = PARTIAL_ROTARY.get(head_dim)
    if rotary_dim is not None and not norm:
        raise ValueError(f"q_weight, k_weight: head_dim {head_dim} (partial RoPE) has kernels with the head norms only")
    eps32 = check_eps(eps)
    _, _, cache_kv_heads, cache_head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    if (cache_kv_heads, cache_head_dim) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache: {cache_kv_heads} kv heads of {cache_head_dim}, expected {num_kv_heads} of "
                         f"{head_dim} (qkv)")
    num_tokens = qkv.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_tokens,))
    device = same_device(qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions, cos_sin=cos_sin,
                         k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    named = [("positions", positions), ("cos_sin", cos_sin), ("k_cache", k_cache), ("v_cache", v_cache),
             ("slot_mapping", slot_mapping)] + ([("q_weight", q_weight), ("k_weight", k_weight)] if norm else [])
    for name, t in named:
        check_alias(name, t, "qkv", qkv, allow_identical=False)
    check_alias("v_cache", v_cache, "k_cache", k_cache, allow_identical=False)
    if num_tokens == 0:
        return qkv
    if device == "cpu":
        qkv.array[...] = qk_norm_rope_write_kv_reference(
            qkv.array, q_weight.array if norm else None, k_weight.array if norm else None, positions.array,
            cos_sin.array, int(num_q_heads), int(num_kv_heads), eps32, k_cache.array, v_cache.array,
            slot_mapping.array, None if k_scale is None else k_scale.array, None if v_scale is None else v_scale.array)
        return qkv
    check_aligned("qkv", qkv)
    check_aligned("cos_sin", cos_sin)
    rows = num_tokens * (num_q_heads + 2 * num_kv_heads)  # gate heads are not visited
    check_int32_range("qkv", num_tokens)
    grid = cdiv(rows, _FUSED_STEPS * (32 // (head_dim // 16)) * _BLOCK // 32)
    tail = (k_cache, v_cache, slot_mapping, np.int32(num_tokens), np.int32(num_q_heads), np.int32(num_kv_heads),
            np.int32(cos_sin.shape[0]))
    fp8 = is_fp8(k_cache)  # the same kernel with the quantizing store (rope.cu, KvE4m3): scales after the arguments
    scales = (k_scale, v_scale) if fp8 else ()
    suffix = "_fp8" if fp8 else ""
    if rotary_dim is not None:
        gate_heads = np.int32(qkv.shape[1] - num_q_heads - 2 * num_kv_heads)
        kernel("rope", f"qk_norm_rope_write_kv{suffix}_d{head_dim}_r{rotary_dim}_s{_FUSED_STEPS}")(
            grid, _BLOCK, qkv, q_weight, k_weight, positions, cos_sin, *tail, eps32, *scales, gate_heads, pdl=pdl)
    elif norm:
        kernel("rope", f"qk_norm_rope_write_kv{suffix}_d{head_dim}_s{_FUSED_STEPS}")(
            grid, _BLOCK, qkv, q_weight, k_weight, positions, cos_sin, *tail, eps32, *scales, pdl=pdl)
    else:
        kernel("rope", f"qk_rope_write_kv{suffix}_d{head_dim}_s{_FUSED_STEPS}")(
            grid, _BLOCK, qkv, positions, cos_sin, *tail, *scales, pdl=pdl)
    return qkv
