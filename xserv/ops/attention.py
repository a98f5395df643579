"""Attention over a paged KV cache: writing new K/V into the cache, causal prefill of packed variable-length
query chunks, and single-token decode (split-KV with a log-sum-exp combine).

Cache layout, per layer: k_cache, v_cache bf16 [num_blocks, block_size, num_kv_heads, head_dim]; token t of
sequence s lives in block block_tables[s, t // block_size] at offset t % block_size. GQA: query head h uses kv head
h // (num_q_heads // num_kv_heads). Queries may be given as q [T, Hq, D] or as the packed qkv projection
[T, Hq + 2 Hkv, D] with `num_q_heads` saying how many of its heads are queries.

CUDA: cuda_src/kv_cache.cu, attention_prefill.cu (FlashAttention-2 on mma.sync), attention_decode.cu.
CPU: NumPy references (float32 for the model's CPU backend, float64 in tests), vectorised per sequence.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_aligned, check_tensor, output, same_device

HEAD_DIMS = (64, 128)
MAX_GQA_GROUP = 8  # decode kernels are instantiated for Hq / Hkv = 1..8 (Qwen3 uses 1, 2, 4, 5, 8)

# Prefill kernel: "v5" (wgmma + TMA with a producer warp, sm_90a only; "v5_<variant>" picks one of V5_VARIANTS),
# "v4" (wgmma, sm_90a; "v4_<variant>"), "v3" (mma.sync; "v3_<variant>" picks one of V3_VARIANTS), "fa2" (v2) or
# "simple" (one warp per query row; a GPU cross-check). Default: v5 where the device is sm_90a, else v3. Warps per CTA of the fa2 kernel: 4 (64 query rows per CTA) or 8 (128 rows); 0 = by
# head_dim, as measured on an H200 (docs/kernels/attention.md): 8 for D=128 (+8%), 4 for D=64 (+8%).
PREFILL_IMPL = os.environ.get("XSERV_ATTN_PREFILL", "")
PREFILL_WARPS = int(os.environ.get("XSERV_ATTN_PREFILL_WARPS", "0"))
_BKV = 64  # keys per K/V tile of the fa2 kernel

# ================================================================================================================
# NumPy references
# ================================================================================================================


def write_kv_reference(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       slot_mapping: np.ndarray) -> None:
    """In place: k_cache/v_cache (viewed as [num_slots, Hkv, D]) [slot] = k/v [t] for slot_mapping[t] >= 0."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = np.asarray(slot_mapping, np.int64)
    keep = slots >= 0
    k_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep]
    v_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep]


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table_row: np.ndarray, kv_len: int):
    """The dense K and V [kv_len, Hkv, D] of one sequence, read through its block-table row."""
    block_size = k_cache.shape[1]
    blocks = np.asarray(block_table_row[: -(-kv_len // block_size)], np.int64)
    shape = (-1,) + k_cache.shape[2:]
    return k_cache[blocks].reshape(shape)[:kv_len], v_cache[blocks].reshape(shape)[:kv_len]


def attention_prefill_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cu_seqlens_q: np.ndarray,
                                kv_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                                num_q_heads: int | None = None, dtype=np.float32, q_block: int = 512,
                                causal: bool = True) -> np.ndarray:
    """Causal paged attention in `dtype`: out [T, Hq, D]. Query i of sequence s sits at position
    kv_lens[s] - q_len_s + i and sees keys 0..that position (all kv_len keys with causal=False). Work is vectorised over heads, `q_block` query rows
    at a time (bounds the [Hkv, G, rows, kv_len] score array)."""
    num_q_heads = q.shape[1] if num_q_heads is None else num_q_heads
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = np.zeros((q.shape[0], num_q_heads, head_dim), dtype)
    cu = np.asarray(cu_seqlens_q, np.int64)
    for s in range(len(cu) - 1):
        start, q_len, kv_len = int(cu[s]), int(cu[s + 1] - cu[s]), int(kv_lens[s])
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[s], kv_len)
        kt = k.astype(dtype).transpose(1, 2, 0)[:, None]  # [Hkv, 1, D, kv_len]
        vt = v.astype(dtype).transpose(1, 0, 2)[:, None]  # [Hkv, 1, kv_len, D]
        for r0 in range(0, q_len, q_block):
            r1 = min(q_len, r0 + q_block)
            qs = q[start + r0:start + r1, :num_q_heads].astype(dtype)  # [rows, Hq, D]
            qs = qs.reshape(r1 - r0, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, rows, D]
            scores = (qs @ kt) * dtype(scale)  # [Hkv, G, rows, kv_len]
            pos = kv_len - q_len + np.arange(r0, r1)
            if causal:
                scores[..., np.arange(kv_len)[None, :] > pos[:, None]] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = p @ vt  # [Hkv, G, rows, D]
            out[start + r0:start + r1] = o.transpose(2, 0, 1, 3).reshape(r1 - r0, num_q_heads, head_dim)
    return out


def attention_decode_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, kv_lens: np.ndarray,
                               block_tables: np.ndarray, scale: float, num_q_heads: int | None = None,
                               dtype=np.float32) -> np.ndarray:
    """One query per sequence, at position kv_lens[s] - 1: out [B, Hq, D]."""
    cu = np.arange(q.shape[0] + 1, dtype=np.int32)
    return attention_prefill_reference(q, k_cache, v_cache, cu, kv_lens, block_tables, scale, num_q_heads, dtype)


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, causal: bool = True) -> np.ndarray:
    """Dense float64 attention of one sequence, head by head (independent of the paged code above):
    q [L, Hq, D], k/v [S, Hkv, D] -> [L, Hq, D]; causal with the queries at positions S-L .. S-1."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    L, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    out = np.empty(q.shape, np.float64)
    for h in range(Hq):
        kh = h // (Hq // Hkv)
        scores = q[:, h] @ k[:, kh].T * scale
        if causal:
            scores = np.where(np.arange(S)[None, :] <= (S - L + np.arange(L))[:, None], scores, -np.inf)
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (w / w.sum(axis=1, keepdims=True)) @ v[:, kh]
    return out


# ================================================================================================================
# Argument checks
# ================================================================================================================


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    check_tensor("k_cache", k_cache, dtype=bfloat16, ndim=4)
    check_tensor("v_cache", v_cache, dtype=bfloat16, shape=k_cache.shape)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"k_cache: head_dim {head_dim} not supported; expected one of {HEAD_DIMS}")
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"k_cache: shape {list(k_cache.shape)} has an empty block or no kv heads")
    check_aligned("k_cache", k_cache)
    check_aligned("v_cache", v_cache)
    return num_blocks, block_size, num_kv_heads, head_dim


def _query_heads(q: Tensor, num_q_heads: int | None, num_kv_heads: int, head_dim: int) -> int:
    """Hq, given q [T, Hq, D] or the packed qkv [T, Hq + 2 Hkv, D] with num_q_heads."""
    check_tensor("q", q, dtype=bfloat16, ndim=3)
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} does not match the cache's {head_dim}")
    heads = q.shape[1]
    if num_q_heads is None:
        num_q_heads = heads
    elif heads not in (num_q_heads, num_q_heads + 2 * num_kv_heads):
        raise ValueError(f"q: {heads} heads is neither num_q_heads={num_q_heads} nor the packed "
                         f"num_q_heads + 2 * num_kv_heads = {num_q_heads + 2 * num_kv_heads}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a positive multiple of num_kv_heads {num_kv_heads}")
    if num_q_heads // num_kv_heads > MAX_GQA_GROUP:
        raise ValueError(f"num_q_heads / num_kv_heads = {num_q_heads // num_kv_heads} > {MAX_GQA_GROUP} is not supported")
    check_aligned("q", q)
    return num_q_heads


def _check_tables(kv_lens: Tensor, block_tables: Tensor, num_seqs: int) -> None:
    check_tensor("kv_lens", kv_lens, dtype=int32, shape=(num_seqs,))
    check_tensor("block_tables", block_tables, dtype=int32, ndim=2)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} sequences")


# ================================================================================================================
# KV-cache write
# ================================================================================================================


def _write_kv(k_src: Tensor, k_ptr_offset: int, v_ptr_offset: int, row_stride: int, num_tokens: int,
              k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    from ..runtime import kernel

    _, _, num_kv_heads, head_dim = k_cache.shape
    n = num_tokens * num_kv_heads * (head_dim // 8)
    threads = 256
    kernel("kv_cache", "write_kv_bf16")(
        ((n + threads - 1) // threads, 1, 1), (threads, 1, 1),
        k_src.ptr + k_ptr_offset, k_src.ptr + v_ptr_offset, np.int64(row_stride), k_cache, v_cache, slot_mapping,
        np.int32(num_tokens), np.int32(num_kv_heads), np.int32(head_dim))


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k_cache/v_cache[slot] = k/v[t] for slot = slot_mapping[t] = block * block_size + offset; slot < 0 skips.
    k, v: bf16 [T, Hkv, D]."""
    _, _, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    check_tensor("k", k, dtype=bfloat16, shape=(None, num_kv_heads, head_dim))
    num_tokens = k.shape[0]
    check_tensor("v", v, dtype=bfloat16, shape=k.shape)
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_tokens,))
    device = same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if device == "cpu":
        write_kv_reference(k.array, v.array, k_cache.array, v_cache.array, slot_mapping.array)
        return
    check_aligned("k", k)
    check_aligned("v", v)
    # One kernel for both forms: K and V pointers relative to k's buffer address (v may live anywhere).
    _write_kv(k, 0, v.ptr - k.ptr, num_kv_heads * head_dim, num_tokens, k_cache, v_cache, slot_mapping)


def write_kv_packed(qkv: Tensor, num_q_heads: int, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """write_kv with K = qkv heads [Hq, Hq + Hkv) and V = heads [Hq + Hkv, Hq + 2 Hkv) of qkv [T, Hq + 2 Hkv, D]."""
    _, _, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    total = num_q_heads + 2 * num_kv_heads
    check_tensor("qkv", qkv, dtype=bfloat16, shape=(None, total, head_dim))
    num_tokens = qkv.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_tokens,))
    device = same_device(qkv=qkv, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if device == "cpu":
        a = qkv.array
        write_kv_reference(a[:, num_q_heads:num_q_heads + num_kv_heads], a[:, num_q_heads + num_kv_heads:],
                           k_cache.array, v_cache.array, slot_mapping.array)
        return
    check_aligned("qkv", qkv)
    elem = qkv.itemsize * head_dim
    _write_kv(qkv, num_q_heads * elem, (num_q_heads + num_kv_heads) * elem, total * head_dim, num_tokens,
              k_cache, v_cache, slot_mapping)


# ================================================================================================================
# Prefill
# ================================================================================================================


def attention_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
                      block_tables: Tensor, scale: float, max_q_len: int, out: Tensor | None = None,
                      num_q_heads: int | None = None, causal: bool = True) -> Tensor:
    """Causal attention of packed query chunks against the paged cache (which already holds their K/V).
    q [T, Hq, D] (or packed qkv with num_q_heads), cu_seqlens_q int32 [B+1], kv_lens int32 [B] (>= q_len),
    block_tables int32 [B, max_blocks]; max_q_len >= every q_len (sizes the grid) -> out bf16 [T, Hq, D].
    causal=False (every query sees all kv_len keys) exists for benchmarks against non-causal peers."""
    _, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_q_heads = _query_heads(q, num_q_heads, num_kv_heads, head_dim)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=int32, ndim=1)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q: needs at least one entry")
    _check_tables(kv_lens, block_tables, num_seqs)
    max_q_len = int(max_q_len)
    if max_q_len < 0:
        raise ValueError(f"max_q_len: {max_q_len} < 0")
    device = same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, kv_lens=kv_lens,
                         block_tables=block_tables, out=out)
    num_tokens = q.shape[0]
    out = output("out", out, (num_tokens, num_q_heads, head_dim), bfloat16, device)
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    if device == "cpu":
        out.array[...] = attention_prefill_reference(
            q.array, k_cache.array, v_cache.array, cu_seqlens_q.array, kv_lens.array, block_tables.array, scale,
            num_q_heads, causal=causal).astype(bfloat16)
        return out
    impl = PREFILL_IMPL or default_prefill_impl()
    _prefill_cuda(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, scale, max_q_len, out, num_q_heads,
                  impl if causal or impl != "simple" else "v3", PREFILL_WARPS, causal)
    return out


def default_prefill_impl() -> str:
    """v5 (wgmma + TMA, producer warp; v4 where the block size rules out the TMA) on sm_90a, v3 (mma.sync) on any
    other architecture."""
    from ..runtime import get_device

    return "v5" if get_device().arch == "sm_90a" else "v3"


def _prefill_cuda(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, scale, max_q_len, out, num_q_heads,
                  impl: str = "fa2", warps: int = 4, causal: bool = True) -> None:
    from ..runtime import kernel

    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    args = (q, np.int64(q.shape[1] * head_dim), k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables,
            np.int32(block_tables.shape[1]), np.int32(block_size), np.int32(num_q_heads), np.int32(num_kv_heads),
            np.float32(scale * math.log2(math.e)), out, np.int32(bool(causal)))
    if impl == "simple":
        if not causal:
            raise ValueError("the simple prefill kernel is causal only")
        kernel("attention_prefill", f"attention_prefill_simple_d{head_dim}")(
            ((max_q_len + 3) // 4, num_q_heads, num_seqs), (128, 1, 1), *args)
        return
    if impl.startswith("v5"):  # "v5" or "v5_<variant>"; needs the TMA (block size), else runs v4's default
        variant = impl[3:] or V5_DEFAULT[head_dim]
        warpgroups, bkv, stages = _v5_shape(variant)
        if PREFILL_TMA and block_size % 8 == 0 and (bkv % block_size == 0 or block_size % bkv == 0):
            rows = 64 * warpgroups
            kernel("attention_prefill_sm90", f"attention_prefill_v5_d{head_dim}_{variant}")(
                (num_q_heads, num_seqs, (max_q_len + rows - 1) // rows), (128 * warpgroups + 128, 1, 1), *args,
                _kv_tensor_map(k_cache, min(block_size, bkv)), _kv_tensor_map(v_cache, min(block_size, bkv)),
                smem=(rows + 2 * stages * bkv) * head_dim * 2 + 1024 + 24 * stages)
            return
        impl = "v4"
    if impl.startswith("v4"):  # "v4", "v4_<variant>", or a timing probe "v4probe<N>_<variant>" (wrong results)
        family, _, variant = impl.partition("_")
        variant = variant or V4_DEFAULT[head_dim]
        warpgroups, bkv = _v4_shape(variant)
        rows = 64 * warpgroups
        k_map = v_map = 0  # no tensor maps: every K/V row through cp.async
        if PREFILL_TMA and block_size % 8 == 0 and (bkv % block_size == 0 or block_size % bkv == 0):
            k_map = _kv_tensor_map(k_cache, min(block_size, bkv))
            v_map = _kv_tensor_map(v_cache, min(block_size, bkv))
        kernel("attention_prefill_sm90", f"attention_prefill_{family}_d{head_dim}_{variant}")(
            (num_q_heads, num_seqs, (max_q_len + rows - 1) // rows), (128 * warpgroups, 1, 1), *args, k_map, v_map,
            np.int32(PREFILL_TMA_SPREAD), smem=(rows + 4 * bkv) * head_dim * 2 + 1024 + 32)
        return
    if impl.startswith("v3"):
        variant = impl[3:].lstrip(":_") or V3_DEFAULT[head_dim]
        mt, nwarps, bkv = _v3_shape(variant)
        rows = 16 * mt * nwarps
        kernel("attention_prefill", f"attention_prefill_v3_d{head_dim}_{variant}")(
            (num_q_heads, num_seqs, (max_q_len + rows - 1) // rows), (32 * nwarps, 1, 1), *args,
            smem=(rows + 4 * bkv) * head_dim * 2)
        return
    if warps == 0:
        warps = 8 if head_dim == 128 else 4
    if impl != "fa2" or warps not in (4, 8):
        raise ValueError(f"unknown prefill kernel {impl!r} with {warps} warps")
    rows = 16 * warps
    smem = (rows + 4 * _BKV) * head_dim * 2
    kernel("attention_prefill", f"attention_prefill_fa2_d{head_dim}_w{warps}")(
        ((max_q_len + rows - 1) // rows, num_q_heads, num_seqs), (32 * warps, 1, 1), *args, smem=smem)


# v3 kernel variants compiled into attention_prefill.cu, as "m{m-tiles per warp}w{warps}[q]_b{ldmatrix ring}"
# (q: Q fragments resident in registers); the default per head_dim as measured (docs/kernels/attention.md).
V3_VARIANTS = {128: ("m2w4_b2", "m2w4_b3", "m2w4_b3_k32", "m2w8_b3", "m2w8_b3_k32", "m1w4q_b3", "m1w8q_b3"),
               64: ("m2w4q_b3", "m1w4q_b3", "m1w8q_b3", "m1w8q_b3_k32")}
V3_DEFAULT = {128: "m2w8_b3", 64: "m1w8q_b3"}


# v4 copies K/V tiles with the TMA where the block size allows (XSERV_ATTN_TMA=0: cp.async only, for comparison).
PREFILL_TMA = os.environ.get("XSERV_ATTN_TMA", "1") != "0"
# Which threads issue a tile's TMA copies: 1 = spread over the warps (one lane each), 0 = the lanes of warp 0.
PREFILL_TMA_SPREAD = int(os.environ.get("XSERV_ATTN_TMA_SPREAD", "1"))
_tensor_maps: dict[tuple, Tensor] = {}  # (cache address, shape, rows) -> CUtensorMap in device memory


def _kv_tensor_map(cache: Tensor, rows: int) -> int:
    """Device address of a TMA descriptor for one K or V cache [num_blocks, block_size, Hkv, D] bf16, seen as the
    3-D tensor (D, Hkv, slot) with boxes of 64 x 1 x `rows` (one 128-byte swizzled panel of `rows` keys). Built
    once per cache buffer and kept (128 bytes each)."""
    key = (cache.ptr, cache.shape, rows)
    t = _tensor_maps.get(key)
    if t is None:
        import ctypes

        from cuda.bindings import driver

        from ..runtime.errors import check_driver

        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        u64, u32 = driver.cuuint64_t, driver.cuuint32_t
        err, tmap = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, cache.ptr,
            [u64(head_dim), u64(num_kv_heads), u64(num_blocks * block_size)],
            [u64(head_dim * 2), u64(num_kv_heads * head_dim * 2)],
            [u32(64), u32(1), u32(rows)], [u32(1), u32(1), u32(1)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        check_driver((err,), "cuTensorMapEncodeTiled")
        raw = np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), np.uint8).copy()
        t = _tensor_maps[key] = Tensor.from_numpy(raw, "cuda")
    return t.ptr


# v4 kernel variants compiled into attention_prefill_sm90.cu, as "w{warpgroups}_k{keys per tile}".
V4_VARIANTS = {128: ("w2_k128", "w2_k64", "w3_k64"), 64: ("w2_k128", "w2_k64", "w3_k128")}
V4_DEFAULT = {128: "w2_k128", 64: "w3_k128"}


# v5 (producer warp + TMA ring) variants, as "w{warpgroups}_k{keys per tile}_s{stages}".
V5_VARIANTS = {128: ("w2_k128_s3", "w2_k128_s2", "w2_k64_s4", "w3_k64_s3"), 64: ("w2_k128_s3", "w3_k128_s3")}
V5_DEFAULT = {128: "w2_k128_s3", 64: "w2_k128_s3"}


def _v5_shape(variant: str) -> tuple[int, int, int]:
    """(warpgroups per CTA, keys per tile, stages) of a v5 variant name."""
    import re

    m = re.fullmatch(r"w(\d)_k(\d+)_s(\d)", variant)
    if not m:
        raise ValueError(f"unknown v5 prefill variant {variant!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _v4_shape(variant: str) -> tuple[int, int]:
    """(warpgroups per CTA, keys per tile) of a v4 variant name."""
    import re

    m = re.fullmatch(r"w(\d)_k(\d+)", variant)
    if not m:
        raise ValueError(f"unknown v4 prefill variant {variant!r}")
    return int(m.group(1)), int(m.group(2))


def _v3_shape(variant: str) -> tuple[int, int, int]:
    """(m-tiles per warp, warps per CTA, keys per tile) of a v3 variant name."""
    import re

    m = re.fullmatch(r"m(\d)w(\d)q?_b\d(_k32)?", variant)
    if not m:
        raise ValueError(f"unknown v3 prefill variant {variant!r}")
    return int(m.group(1)), int(m.group(2)), 32 if m.group(3) else 64


# ================================================================================================================
# Decode
# ================================================================================================================

_workspaces: list[Tensor] = []  # kept for the life of the process: CUDA graphs may have captured their addresses
_counters: list[Tensor] = []  # v3's per-(sequence, kv head) split counters: zeroed once, reset by the kernel itself

# Decode kernel: "v4" (the default: v2's CUDA-core math fed by a per-lane cp.async ring of 2 stages and a per-CTA
# page table in shared memory, split combine folded in; 1.3-1.5x v2 on every measured shape), "v2" (CUDA cores,
# plain loads, separate combine), "v3" (tensor cores, per-lane cp.async staging, 2 stages) or "v3s3" (3 stages).
# v3 needs block_size % 16 == 0 and falls back to v2 otherwise. Experiments, compiled for the benchmark's
# (head_dim, group) shapes only (_V4_EXPERIMENT_SHAPES): "v4s3" / "v4s4" (3 / 4 stages), "v4n" (v2's butterfly
# reduce), "v4p" (a load-only probe with a wrong result: benchmark only).
# Measured on an H200: docs/kernels/attention.md ("v3 decode", "v4 decode").
DECODE_IMPL = os.environ.get("XSERV_ATTN_DECODE", "v4")
DECODE_VARIANTS = ("v2", "v3", "v3s2", "v3s3", "v4", "v4s2", "v4s3", "v4s4", "v4n", "v4p")
# v2's split-KV grid aims at this many CTAs per SM (tuning knob for tools/bench_attention sweeps).
DECODE_CTAS_PER_SM = int(os.environ.get("XSERV_ATTN_DECODE_CTAS_PER_SM", "4"))
_V3_WARPS = 4
# CTAs of 128 threads resident per SM for (head_dim, stages), from shared memory (4 * stages * head_dim * 64 bytes
# per CTA) and registers (138 for d128, <= 96 for d64): they size the split-KV grid.
_V3_RESIDENT = {(128, 2): 3, (128, 3): 2, (64, 2): 5, (64, 3): 4}
_V4_TAB_CAP = 512  # kV4TabCap: page-table entries a v4 CTA keeps in shared memory
_V4_EXPERIMENT_SHAPES = {(128, 4), (128, 2), (64, 2)}  # (head_dim, group) with the v4 experiment kernels


def _v4_config(variant: str) -> tuple[int, str]:
    """(stages, kernel-name suffix) of a v4 variant name."""
    return {"v4": (2, ""), "v4s2": (2, ""), "v4s3": (3, ""), "v4s4": (4, ""), "v4n": (2, "_n"),
            "v4p": (2, "_p")}[variant]


def _v4_resident(group: int, stages: int) -> int:
    """v4 CTAs resident per SM: __launch_bounds__ (4 for G <= 4, else 2) and shared memory (stages * 16 KB + 2 KB)."""
    return min(4 if group <= 4 else 2, (227 * 1024) // (stages * 16384 + _V4_TAB_CAP * 4 + 16 + 1024))


def _fast_div(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31 (fast_div in the kernel)."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _workspace(nbytes: int) -> Tensor:
    for t in _workspaces:
        if t.nbytes >= nbytes:
            return t
    t = Tensor.empty((max(nbytes, 1 << 20) // 4,), float32, "cuda")
    _workspaces.append(t)
    return t


def _counter_workspace(count: int) -> Tensor:
    for t in _counters:
        if t.shape[0] >= count:
            return t
    t = Tensor.zeros((max(count, 4096),), int32, "cuda")
    _counters.append(t)
    return t


def decode_plan(num_seqs: int, num_kv_heads: int, max_kv_len: int, multiprocessor_count: int,
                ctas_per_sm: int = 4, balance: bool = False, max_chunk: int | None = None) -> tuple[int, int]:
    """(num_splits, chunk_len): split-KV grid over (sequence x kv head x split), chunk_len a multiple of 64, each
    split at least 256 keys. v2 (balance=False): enough CTAs for ~`ctas_per_sm` per multiprocessor. v3/v4
    (balance=True, ctas_per_sm = CTAs resident per SM): the split count whose grid fills the last wave of resident
    CTAs best (within 3% of the best fill, the fewest splits). max_chunk (balance=True): no split longer than this
    (v4's page table), as far as 256 splits allow."""
    max_kv_len = max(int(max_kv_len), 1)
    pairs = max(num_seqs * num_kv_heads, 1)
    limit = max(1, min(-(-max_kv_len // 256), 256))
    lowest = 1 if max_chunk is None else max(1, min(limit, -(-max_kv_len // max_chunk)))

    def shape(splits: int) -> tuple[int, int]:
        chunk = -(-max_kv_len // splits)
        chunk = -(-chunk // 64) * 64
        return -(-max_kv_len // chunk), chunk

    if not balance:
        want = -(-ctas_per_sm * multiprocessor_count // pairs)
        return shape(max(1, min(want, limit)))
    slots = max(ctas_per_sm * multiprocessor_count, 1)
    fills = {}
    for want in range(lowest, limit + 1):
        splits, chunk = shape(want)
        ctas = pairs * splits
        fills.setdefault((splits, chunk), ctas / (-(-ctas // slots) * slots))
        if ctas >= 8 * slots:
            break
    best = max(fills.values())
    return min(k for k, f in fills.items() if f >= best - 0.03)


def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, block_tables: Tensor,
                     scale: float, max_kv_len: int, out: Tensor | None = None,
                     num_q_heads: int | None = None, variant: str | None = None) -> Tensor:
    """One query per sequence at position kv_lens[s] - 1 (its K/V already in the cache): q [B, Hq, D] (or packed
    qkv with num_q_heads), kv_lens int32 [B] (0 <= kv_len <= max_kv_len; 0 gives a zero row), block_tables int32
    [B, max_blocks] -> out bf16 [B, Hq, D]. max_kv_len is a host-side bound that sizes the split-KV grid (no device
    reads). variant: one of DECODE_VARIANTS (default XSERV_ATTN_DECODE, else v4)."""
    _, block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    num_q_heads = _query_heads(q, num_q_heads, num_kv_heads, head_dim)
    num_seqs = q.shape[0]
    _check_tables(kv_lens, block_tables, num_seqs)
    device = same_device(q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=kv_lens, block_tables=block_tables, out=out)
    out = output("out", out, (num_seqs, num_q_heads, head_dim), bfloat16, device)
    variant = DECODE_IMPL if variant is None else variant
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant: unknown decode kernel {variant!r}")
    if num_seqs == 0:
        return out
    if device == "cpu":
        out.array[...] = attention_decode_reference(q.array, k_cache.array, v_cache.array, kv_lens.array,
                                                    block_tables.array, scale, num_q_heads).astype(bfloat16)
        return out
    from ..runtime import get_device, kernel

    max_kv_len = int(max_kv_len)
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len: {max_kv_len} < 1")
    group = num_q_heads // num_kv_heads
    sms = get_device().multiprocessor_count
    v4 = None
    if variant.startswith("v4"):
        stages, suffix = _v4_config(variant)
        if suffix or stages != 2:
            if (head_dim, group) not in _V4_EXPERIMENT_SHAPES:
                raise ValueError(f"variant: {variant} is compiled for (head_dim, group) in "
                                 f"{sorted(_V4_EXPERIMENT_SHAPES)} only, not ({head_dim}, {group})")
        splits, chunk = decode_plan(num_seqs, num_kv_heads, max_kv_len, sms, _v4_resident(group, stages), True,
                                    max_chunk=(_V4_TAB_CAP - 1) * block_size // 64 * 64)
        if -(-chunk // block_size) + 1 <= _V4_TAB_CAP:  # the split's pages fit the shared page table
            v4 = (stages, suffix)
        else:  # (a block_size below 8 with a very long context): v2
            variant = "v2"
    v3 = variant.startswith("v3") and block_size % 16 == 0
    if v4:
        pass
    elif v3:
        stages = int(variant[3:]) if len(variant) > 2 else 2
        splits, chunk = decode_plan(num_seqs, num_kv_heads, max_kv_len, sms, _V3_RESIDENT[head_dim, stages], True)
    else:
        splits, chunk = decode_plan(num_seqs, num_kv_heads, max_kv_len, sms, DECODE_CTAS_PER_SM)
    part_o = part_lse = out  # unused by the kernel when splits == 1
    if splits > 1:
        rows = num_seqs * num_q_heads * splits
        ws = _workspace(rows * (head_dim + 1) * 4)
        part_o, part_lse = ws.ptr, ws.ptr + rows * head_dim * 4
    args = (q, np.int64(q.shape[1] * head_dim), k_cache, v_cache, kv_lens, block_tables,
            np.int32(block_tables.shape[1]), np.int32(block_size), np.int32(num_q_heads), np.int32(num_kv_heads),
            np.float32(scale * math.log2(math.e)), np.int32(chunk), np.int32(splits), out, part_o, part_lse)
    if v4:
        stages, suffix = v4
        magic, shift = _fast_div(block_size)
        counters = _counter_workspace(num_seqs * num_kv_heads)
        kernel("attention_decode", f"attention_decode_v4_d{head_dim}_g{group}_s{stages}{suffix}")(
            (splits, num_kv_heads, num_seqs), (128, 1, 1), *args, counters, np.uint32(magic), np.int32(shift),
            smem=stages * 16384 + _V4_TAB_CAP * 4 + 16)
        return out
    if v3:
        counters = _counter_workspace(num_seqs * num_kv_heads)
        kernel("attention_decode", f"attention_decode_v3_d{head_dim}_g{group}_s{stages}")(
            (splits, num_kv_heads, num_seqs), (32 * _V3_WARPS, 1, 1), *args, counters,
            smem=_V3_WARPS * stages * head_dim * 64 + 16)
        return out
    kernel("attention_decode", f"attention_decode_d{head_dim}_g{group}")(
        (splits, num_kv_heads, num_seqs), (128, 1, 1), *args)
    if splits > 1:
        kernel("attention_decode", "attention_decode_combine")(
            (num_q_heads, num_seqs, 1), (head_dim, 1, 1), part_o, part_lse, kv_lens, np.int32(chunk),
            np.int32(splits), np.int32(head_dim), out)
    return out


# ================================================================================================================
# Building a paged cache from dense K/V (tests, harness, benchmarks)
# ================================================================================================================


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
