"""Harness specs for the attention family: write_kv, attention_prefill (causal and non-causal), attention_decode,
attention_decode_rope (qk_norm_rope_write_kv + attention_decode in one launch).

Shapes (every sequence of a shape has the same lengths; the tests cover mixed ones):
  attention_prefill[_noncausal]  BxHQxHKVxLQxLKVxD[xBLOCK]   B sequences, LQ new queries over LKV cached keys
  attention_decode               BxHQxHKVxLKVxD[xBLOCK]
  attention_decode_rope          BxHQxHKVxLKVxD[xBLOCK]      LKV counts the new token (its q/k/v in the packed qkv)
  write_kv                       TxHQxHKVxD[xBLOCK]          (the packed-qkv form the model calls)
BLOCK is the KV-cache block size (default 16). `--variant NAME` runs one of the op's kernels (a shipped name of
xserv.ops.attention's PREFILL_KERNELS / DECODE_KERNELS or a development one of tools/dev/kernels.py, which compiles on
request), else the default.

FLOPs count the visible (query, key) pairs exactly: 4 * D * HQ * sum over queries of the keys each one sees
(2 D for q.k, 2 D for p.v; the softmax is not counted). Causal LQ = LKV = L gives 4 D HQ L (L+1) / 2.
Bytes: q + K + V + out once each (decode: dominated by K and V, B * LKV * HKV * D * 2 bytes each).
"""
from __future__ import annotations

import math

import numpy as np

from xserv.tensor import bfloat16
from xserv.testing import random_array

from . import OpSpec


def _random_bf16(rng, shape) -> np.ndarray:
    """random_array, but large arrays tile a 4M-value random pool (benchmark inputs of GBs in seconds)."""
    n = math.prod(shape)
    if n <= 1 << 24:
        return random_array(rng, shape, bfloat16)
    pool = random_array(rng, (1 << 22,), bfloat16)
    return np.resize(pool, n).reshape(shape)


def _paged(rng, b, hkv, lkv, d, block):
    """A cache holding b sequences of lkv tokens in randomly permuted blocks (unused slots NaN)."""
    per_seq = -(-lkv // block)
    num_blocks = b * per_seq + 1
    k_cache = _random_bf16(rng, (num_blocks, block, hkv, d))
    v_cache = _random_bf16(rng, (num_blocks, block, hkv, d))
    order = rng.permutation(num_blocks)
    tables = order[: b * per_seq].reshape(b, per_seq).astype(np.int32)
    tail = lkv - (per_seq - 1) * block  # tokens used in each sequence's last block
    k_cache[tables[:, -1], tail:] = np.nan
    v_cache[tables[:, -1], tail:] = np.nan
    k_cache[order[-1]] = np.nan
    v_cache[order[-1]] = np.nan
    return k_cache, v_cache, tables


def _prefill_inputs(rng, shape, causal=True):
    b, hq, hkv, lq, lkv, d, *rest = shape
    block = rest[0] if rest else 16
    k_cache, v_cache, tables = _paged(rng, b, hkv, lkv, d, block)
    return dict(q=_random_bf16(rng, (b * lq, hq, d)), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                cu_seqlens_q=(np.arange(b + 1) * lq).astype(np.int32), kv_lens=np.full(b, lkv, np.int32),
                scale=1.0 / math.sqrt(d), max_q_len=lq, causal=causal)


def _prefill_run(t):
    from tools.dev import kernels
    from xserv.ops.attention import attention_prefill
    from xserv.testing import poisoned

    out = poisoned(t["q"].shape, bfloat16)
    variant = kernels.prefill(t.get("variant"), t["q"].shape[2])
    return attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                             t["scale"], t["max_q_len"], out=out, causal=t["causal"], variant=variant)


def _prefill_reference(x):
    from xserv.ops.attention import attention_prefill_reference

    return attention_prefill_reference(x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["kv_lens"],
                                       x["block_tables"], x["scale"], dtype=np.float64, causal=x["causal"])


def _visible_pairs(lq, lkv, causal):
    if not causal:
        return lq * lkv
    first = lkv - lq + 1  # keys seen by the first query
    return lq * first + lq * (lq - 1) // 2


def _prefill_flops(shape, causal=True):
    b, hq, hkv, lq, lkv, d = shape[:6]
    return 4 * d * hq * b * _visible_pairs(lq, lkv, causal)


def _prefill_bytes(shape):
    b, hq, hkv, lq, lkv, d = shape[:6]
    return 2 * d * b * (2 * lq * hq + 2 * lkv * hkv)


def _dense_kv(t, lkv):
    """Dense [B, Hkv, L, D] K and V gathered from the paged cache once per input set (cached in the dict, so
    that the timed calls are SDPA alone)."""
    if "_dense" not in t:
        kc, vc, tables = t["k_cache"], t["v_cache"], t["block_tables"].long()
        b = tables.shape[0]
        k = kc[tables].reshape(b, -1, kc.shape[2], kc.shape[3])[:, :lkv].transpose(1, 2).contiguous()
        v = vc[tables].reshape(b, -1, vc.shape[2], vc.shape[3])[:, :lkv].transpose(1, 2).contiguous()
        t["_dense"] = (k, v)
    return t["_dense"]


def _sdpa(q, k, v, scale, causal):
    import torch.nn.functional as F

    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _prefill_torch(t):
    """SDPA on dense tensors (PyTorch picks its backend). Its causal mask is top-left aligned, which equals ours
    only when LQ == LKV; the bench shapes keep to that or are non-causal."""
    b = t["block_tables"].shape[0]
    lq = t["max_q_len"]
    if "_lkv" not in t:
        t["_lkv"] = int(t["kv_lens"][0])  # a host read, once
    k, v = _dense_kv(t, t["_lkv"])
    if "_q" not in t:
        t["_q"] = t["q"].reshape(b, lq, -1, t["q"].shape[-1]).transpose(1, 2).contiguous()
    return _sdpa(t["_q"], k, v, t["scale"], t["causal"])


def _decode_inputs(rng, shape):
    b, hq, hkv, lkv, d, *rest = shape
    block = rest[0] if rest else 16
    k_cache, v_cache, tables = _paged(rng, b, hkv, lkv, d, block)
    return dict(q=_random_bf16(rng, (b, hq, d)), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                kv_lens=np.full(b, lkv, np.int32), scale=1.0 / math.sqrt(d), max_kv_len=lkv)


def _decode_run(t):
    from tools.dev import kernels
    from xserv.ops.attention import attention_decode
    from xserv.testing import poisoned

    out = poisoned(t["q"].shape, bfloat16)
    return attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"],
                            t["max_kv_len"], out=out, variant=kernels.decode(t.get("variant")))


def _decode_reference(x):
    from xserv.ops.attention import attention_decode_reference

    return attention_decode_reference(x["q"], x["k_cache"], x["v_cache"], x["kv_lens"], x["block_tables"],
                                      x["scale"], dtype=np.float64)


def _decode_bytes(shape):
    b, hq, hkv, lkv, d = shape[:5]
    return 2 * d * b * (2 * hq + 2 * lkv * hkv)


def _decode_torch(t):
    k, v = _dense_kv(t, t["max_kv_len"])
    if "_q" not in t:
        t["_q"] = t["q"][:, :, None, :]
    return _sdpa(t["_q"], k, v, t["scale"], False)


_ROPE_EPS = 1e-6


def _decode_rope_inputs(rng, shape):
    """A decode batch for attention_decode_rope: the cache holds each sequence's LKV - 1 older tokens (the new
    token's slot NaN until the op writes it), the packed qkv the new token's raw q/k/v, Qwen3's head-norm weights."""
    from xserv.ops.rope import rope_cos_sin_table

    b, hq, hkv, lkv, d, *rest = shape
    block = rest[0] if rest else 16
    k_cache, v_cache, tables = _paged(rng, b, hkv, lkv, d, block)
    slots = (tables[:, (lkv - 1) // block] * block + (lkv - 1) % block).astype(np.int32)
    k_cache.reshape(-1, hkv, d)[slots] = np.nan
    v_cache.reshape(-1, hkv, d)[slots] = np.nan
    return dict(qkv=_random_bf16(rng, (b, hq + 2 * hkv, d)), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                kv_lens=np.full(b, lkv, np.int32), positions=np.full(b, lkv - 1, np.int32), slot_mapping=slots,
                cos_sin=rope_cos_sin_table(d, lkv + 8, 1e6),
                q_weight=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3),
                k_weight=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3),
                num_q_heads=hq, scale=1.0 / math.sqrt(d), max_kv_len=lkv)


def _decode_rope_run(t):
    from tools.dev import kernels
    from xserv.ops.attention import attention_decode_rope
    from xserv.testing import poisoned

    b, hq, d = t["qkv"].shape[0], t["num_q_heads"], t["qkv"].shape[2]
    return attention_decode_rope(t["qkv"], t["q_weight"], t["k_weight"], t["positions"], t["cos_sin"], hq, _ROPE_EPS,
                                 t["k_cache"], t["v_cache"], t["slot_mapping"], t["kv_lens"], t["block_tables"],
                                 t["scale"], t["max_kv_len"], out=poisoned((b, hq, d), bfloat16),
                                 variant=kernels.decode(t.get("variant")))


def _decode_rope_reference(x):
    from xserv.ops.attention import attention_decode_reference
    from xserv.ops.rope import qk_norm_rope_write_kv_reference

    hq, hkv = x["num_q_heads"], x["k_cache"].shape[2]
    kc, vc = x["k_cache"].copy(), x["v_cache"].copy()
    rotated = qk_norm_rope_write_kv_reference(x["qkv"], x["q_weight"], x["k_weight"], x["positions"], x["cos_sin"],
                                              hq, hkv, _ROPE_EPS, kc, vc, x["slot_mapping"])
    return attention_decode_reference(rotated, kc, vc, x["kv_lens"], x["block_tables"], x["scale"], hq,
                                      dtype=np.float64)


def _decode_rope_bytes(shape):
    b, hq, hkv, lkv, d = shape[:5]
    # the new token's q, k, v rows read, its K/V written, the older K/V read, out written; per sequence its cos/sin
    # row, position, slot, kv_len and table entries; the two norm weights
    return 2 * d * b * ((hq + 2 * hkv) + 2 * hkv + 2 * (lkv - 1) * hkv + hq) + b * (4 * d + 12 + 4 * -(-lkv // 16)) \
        + 4 * d


def _write_kv_inputs(rng, shape):
    tokens, hq, hkv, d, *rest = shape
    block = rest[0] if rest else 16
    num_blocks = -(-tokens // block) + 2
    slots = rng.permutation(num_blocks * block)[:tokens].astype(np.int32)
    slots[::7] = -1  # padding tokens
    # K and V caches as the two halves of one array, so that one output holds both
    return dict(qkv=random_array(rng, (tokens, hq + 2 * hkv, d), bfloat16), num_q_heads=hq, slot_mapping=slots,
                kv_cache=np.zeros((2, num_blocks, block, hkv, d), bfloat16))


def _write_kv_run(t):
    from xserv.ops.attention import write_kv_packed

    write_kv_packed(t["qkv"], t["num_q_heads"], t["kv_cache"][0], t["kv_cache"][1], t["slot_mapping"])
    return t["kv_cache"]


def _write_kv_reference(x):
    from xserv.ops.attention import write_kv_reference

    kv = x["kv_cache"].copy()
    hq, hkv = x["num_q_heads"], kv.shape[3]
    write_kv_reference(x["qkv"][:, hq:hq + hkv], x["qkv"][:, hq + hkv:], kv[0], kv[1], x["slot_mapping"])
    return kv.astype(np.float64)


def _write_kv_bytes(shape):
    tokens, hq, hkv, d = shape[:4]
    return 2 * tokens * hkv * d * 2 * 2  # K and V: read once, written once


def _write_kv_torch(t):
    hq = t["num_q_heads"]
    kv = t["kv_cache"]
    hkv, d = kv.shape[3], kv.shape[4]
    if "_slots" not in t:
        keep = t["slot_mapping"] >= 0
        t["_slots"] = (keep, t["slot_mapping"][keep].long())
    keep, slots = t["_slots"]
    kv[0].view(-1, hkv, d)[slots] = t["qkv"][keep, hq:hq + hkv]
    kv[1].view(-1, hkv, d)[slots] = t["qkv"][keep, hq + hkv:]
    return kv


# the sm_90a defaults (v3 in attention_prefill runs on other archs)
_PREFILL_KERNELS = ("attention_prefill_v5_d128_w2_k128_s3", "attention_prefill_v5_d64_w2_k128_s3",
                    "attention_prefill_v4_d128_w2_k128", "attention_prefill_v4_d64_w3_k128")

SPECS = [
    OpSpec(
        name="attention_prefill", family="attention_prefill_sm90",
        kernels=_PREFILL_KERNELS,
        make_inputs=_prefill_inputs, run=_prefill_run, reference=_prefill_reference, tolerance=1e-2,
        check_shapes=[(1, 4, 4, 1, 1, 64), (3, 8, 2, 65, 65, 128), (2, 8, 2, 63, 1000, 64, 32),
                      (1, 16, 2, 200, 700, 128, 256), (1, 8, 8, 1000, 1000, 128),
                      (2, 24, 4, 70, 300, 256)],  # head_dim 256 (Qwen3.5's gated attention: v3 on every arch)
        bench_shapes=[(1, 32, 32, 4096, 4096, 128), (1, 32, 8, 4096, 4096, 128), (4, 32, 8, 1024, 1024, 128, 256)],
        bytes_moved=_prefill_bytes, flops=_prefill_flops, torch_peer=_prefill_torch,
        shape_help="BxHQxHKVxLQxLKVxD[xBLOCK]"),
    OpSpec(
        name="attention_prefill_noncausal", family="attention_prefill_sm90",
        kernels=_PREFILL_KERNELS,
        make_inputs=lambda rng, shape: _prefill_inputs(rng, shape, causal=False), run=_prefill_run,
        reference=_prefill_reference, tolerance=1e-2,
        check_shapes=[(2, 8, 2, 70, 300, 128), (1, 4, 4, 33, 33, 64)],
        bench_shapes=[(1, 8, 8, 4096, 8192, 128)],
        bytes_moved=_prefill_bytes, flops=lambda shape: _prefill_flops(shape, causal=False), torch_peer=_prefill_torch,
        shape_help="BxHQxHKVxLQxLKVxD[xBLOCK]"),
    OpSpec(
        name="attention_decode", family="attention_decode",
        kernels=("attention_decode_v4_d128_g4_s2", "attention_decode_v4_d128_g4_s2_w8"),
        make_inputs=_decode_inputs, run=_decode_run, reference=_decode_reference, tolerance=1e-2,
        check_shapes=[(1, 4, 4, 1, 64), (5, 32, 8, 1000, 128), (3, 16, 2, 4097, 64, 256), (1, 40, 8, 32768, 128),
                      (3, 24, 4, 1000, 256), (2, 32, 2, 3000, 256)],  # head_dim 256: v2's body, G = 6 and 16
        bench_shapes=[(64, 32, 8, 4096, 128), (1, 32, 8, 32768, 128), (1, 32, 8, 131072, 128),
                      (64, 32, 8, 4096, 128, 256), (64, 24, 4, 4096, 256)],
        bytes_moved=_decode_bytes, torch_peer=_decode_torch, shape_help="BxHQxHKVxLKVxD[xBLOCK]"),
    OpSpec(
        name="attention_decode_rope", family="attention_decode",
        kernels=("attention_decode_v4_d128_g4_s2", "attention_decode_v4_d128_g2_s2",
                 "attention_decode_v4_d128_g4_s2_w8", "attention_decode_v4_d128_g2_s2_w8"),
        make_inputs=_decode_rope_inputs, run=_decode_rope_run, reference=_decode_rope_reference, tolerance=1e-2,
        check_shapes=[(1, 4, 4, 1, 64), (5, 32, 8, 1000, 128), (3, 16, 2, 4097, 64, 256), (1, 40, 8, 32768, 128),
                      (2, 16, 8, 520, 128, 8)],
        bench_shapes=[(1, 16, 8, 520, 128), (1, 32, 8, 520, 128), (1, 32, 8, 32768, 128), (64, 32, 8, 4096, 128),
                      (64, 16, 8, 520, 128)],
        bytes_moved=_decode_rope_bytes, shape_help="BxHQxHKVxLKVxD[xBLOCK]"),
    OpSpec(
        name="write_kv", family="kv_cache", kernels=("write_kv_bf16",),
        make_inputs=_write_kv_inputs, run=_write_kv_run, reference=_write_kv_reference, tolerance=0.0,
        check_shapes=[(1, 4, 2, 64), (37, 32, 8, 128, 16), (513, 16, 8, 128, 256)],
        bench_shapes=[(4096, 32, 8, 128), (64, 32, 8, 128)],
        bytes_moved=_write_kv_bytes, torch_peer=_write_kv_torch,
        shape_help="TxHQxHKVxD[xBLOCK]"),
]
