"""Argument checks shared by the attention ops (shapes, dtypes, alignment; a wrong call raises ValueError)."""
from __future__ import annotations

from ...tensor import Tensor, bfloat16, float8_e4m3fn, float32, int32
from .._checks import check_aligned, check_tensor

HEAD_DIMS = (64, 128)  # every attention kernel family has these (Qwen3, Llama)
MAX_GQA_GROUP = 8  # kernels are instantiated for Hq / Hkv = 1..8 (Qwen3 uses 1, 2, 4, 5, 8)
# Qwen3.5's gated attention: head_dim 256 with these groups only (8:2, 16:4, 24:4, 16:2, 32:2 heads), on the portable
# kernels (v3 prefill, the v2 decode of attention_decode_d256.cu), partial RoPE and the gated qkvg (ops/rope.py).
GATED_HEAD_DIMS = {256: (4, 6, 8, 16)}
ALL_HEAD_DIMS = HEAD_DIMS + tuple(GATED_HEAD_DIMS)


def check_cache(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None = None,
                v_scale: Tensor | None = None) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of a checked K/V cache pair: bf16, or float8_e4m3fn (the FP8
    KV cache) with this layer's k_scale and v_scale, float32 [num_kv_heads] (a bf16 cache takes none)."""
    check_tensor("k_cache", k_cache, dtype=(bfloat16, float8_e4m3fn), ndim=4)
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=k_cache.shape)
    if k_cache.dtype is float8_e4m3fn or k_cache.dtype == float8_e4m3fn:
        if k_scale is None or v_scale is None:
            raise ValueError("k_cache: a float8_e4m3fn (FP8) cache needs k_scale and v_scale, float32 [num_kv_heads]")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, t, dtype=float32, shape=(k_cache.shape[2],), device=k_cache.device)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale: given for a {k_cache.dtype} cache; only an FP8 cache takes scales")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in ALL_HEAD_DIMS:
        raise ValueError(f"k_cache: head_dim {head_dim} not supported; expected one of {ALL_HEAD_DIMS}")
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"k_cache: shape {list(k_cache.shape)} has an empty block or no kv heads")
    check_aligned("k_cache", k_cache)
    check_aligned("v_cache", v_cache)
    return num_blocks, block_size, num_kv_heads, head_dim


def query_heads(q: Tensor, num_q_heads: int | None, num_kv_heads: int, head_dim: int) -> int:
    """Hq, given q [T, Hq, D] or the packed qkv [T, Hq + 2 Hkv, D] with num_q_heads (head_dim 256: also the gated
    qkvg [T, 2 Hq + 2 Hkv, D], whose trailing Hq heads are the output gate's)."""
    check_tensor("q", q, dtype=bfloat16, ndim=3)
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} does not match the cache's {head_dim}")
    heads = q.shape[1]
    if num_q_heads is None:
        num_q_heads = heads
    elif heads not in (num_q_heads, num_q_heads + 2 * num_kv_heads) and not (
            head_dim in GATED_HEAD_DIMS and heads == 2 * num_q_heads + 2 * num_kv_heads):
        raise ValueError(f"q: {heads} heads is neither num_q_heads={num_q_heads} nor the packed "
                         f"num_q_heads + 2 * num_kv_heads = {num_q_heads + 2 * num_kv_heads}"
                         + (" nor the gated 2 * (num_q_heads + num_kv_heads)" if head_dim in GATED_HEAD_DIMS else ""))
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if head_dim in GATED_HEAD_DIMS:
        if group not in GATED_HEAD_DIMS[head_dim]:
            raise ValueError(f"num_q_heads / num_kv_heads = {group} is not supported at head_dim {head_dim} "
                             f"(supported: {GATED_HEAD_DIMS[head_dim]})")
    elif group > MAX_GQA_GROUP:
        raise ValueError(f"num_q_heads / num_kv_heads = {group} > {MAX_GQA_GROUP} is not supported")
    check_aligned("q", q)
    return num_q_heads


def check_tables(kv_lens: Tensor, block_tables: Tensor, num_seqs: int) -> None:
    check_tensor("kv_lens", kv_lens, dtype=int32, shape=(num_seqs,))
    check_tensor("block_tables", block_tables, dtype=int32, ndim=2)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} sequences")


def is_fp8(cache: Tensor) -> bool:
    """Is this a float8_e4m3fn (FP8) KV cache?"""
    return cache.dtype == float8_e4m3fn
