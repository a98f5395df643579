"""NumPy references of the attention ops (float32 for the model's CPU backend, float64 in tests): the KV-cache
write, paged prefill and decode (vectorised per sequence), and an independent dense formula to check them by."""
from __future__ import annotations

import numpy as np


def write_kv_reference(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                       slot_mapping: np.ndarray) -> None:
    """In place: k_cache/v_cache (viewed as [num_slots, Hkv, D]) [slot] = k/v [t] for slot_mapping[t] >= 0."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = np.asarray(slot_mapping, np.int64)
    keep = slots >= 0
    k_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = k[keep]
    v_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = v[keep]


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table_row: np.ndarray, kv_len: int,
              k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None):
    """The dense K and V [kv_len, Hkv, D] of one sequence, read through its block-table row; an FP8 cache (codes,
    with k_scale / v_scale [Hkv]) gives float32(code) * scale (what the kernels compute)."""
    block_size = k_cache.shape[1]
    blocks = np.asarray(block_table_row[: -(-kv_len // block_size)], np.int64)
    shape = (-1,) + k_cache.shape[2:]
    k, v = k_cache[blocks].reshape(shape)[:kv_len], v_cache[blocks].reshape(shape)[:kv_len]
    if k_scale is not None:
        k = k.astype(np.float32) * np.asarray(k_scale, np.float32)[:, None]
        v = v.astype(np.float32) * np.asarray(v_scale, np.float32)[:, None]
    return k, v


def attention_prefill_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cu_seqlens_q: np.ndarray,
                                kv_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                                num_q_heads: int | None = None, dtype=np.float32, q_block: int = 512,
                                causal: bool = True, k_scale: np.ndarray | None = None,
                                v_scale: np.ndarray | None = None) -> np.ndarray:
    """Causal paged attention in `dtype`: out [T, Hq, D]. Query i of sequence s sits at position
    kv_lens[s] - q_len_s + i and sees keys 0..that position (all kv_len keys with causal=False). Work is vectorised over heads, `q_block` query rows
    at a time (bounds the [Hkv, G, rows, kv_len] score array). FP8 caches: with k_scale / v_scale (gather_kv)."""
    num_q_heads = q.shape[1] if num_q_heads is None else num_q_heads
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = np.zeros((q.shape[0], num_q_heads, head_dim), dtype)
    cu = np.asarray(cu_seqlens_q, np.int64)
    for s in range(len(cu) - 1):
        start, q_len, kv_len = int(cu[s]), int(cu[s + 1] - cu[s]), int(kv_lens[s])
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[s], kv_len, k_scale, v_scale)
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
                               dtype=np.float32, k_scale: np.ndarray | None = None,
                               v_scale: np.ndarray | None = None) -> np.ndarray:
    """One query per sequence, at position kv_lens[s] - 1: out [B, Hq, D]."""
    cu = np.arange(q.shape[0] + 1, dtype=np.int32)
    return attention_prefill_reference(q, k_cache, v_cache, cu, kv_lens, block_tables, scale, num_q_heads, dtype,
                                       k_scale=k_scale, v_scale=v_scale)


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
