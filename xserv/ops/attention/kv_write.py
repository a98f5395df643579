"""Writing new K/V rows into the paged cache (cuda_src/kv_cache.cu): slot = block * block_size + offset; a negative
slot skips the token (padding). A bf16 cache takes the rows as they are (write_kv_bf16); an FP8 cache (float8_e4m3fn,
with k_scale / v_scale) takes e4m3(row / scale) (write_kv_fp8; fp8_kv.py)."""
from __future__ import annotations

import numpy as np

from ...runtime import kernel
from ...tensor import Tensor, bfloat16, int32
from .._checks import check_aligned, check_tensor, same_device
from ._args import GATED_HEAD_DIMS, check_cache, is_fp8
from .fp8_kv import launch_write_kv_fp8, write_kv_fp8_reference
from .reference import write_kv_reference

_THREADS = 256


def _write_kv(k_src: Tensor, k_ptr_offset: int, v_ptr_offset: int, row_stride: int, num_tokens: int,
              k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k_scale: Tensor | None = None,
              v_scale: Tensor | None = None) -> None:
    if is_fp8(k_cache):
        launch_write_kv_fp8(k_src, k_ptr_offset, v_ptr_offset, row_stride, num_tokens, k_cache, v_cache,
                            slot_mapping, k_scale, v_scale)
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    n = num_tokens * num_kv_heads * (head_dim // 8)
    kernel("kv_cache", "write_kv_bf16")(
        ((n + _THREADS - 1) // _THREADS, 1, 1), (_THREADS, 1, 1),
        k_src.ptr + k_ptr_offset, k_src.ptr + v_ptr_offset, np.int64(row_stride), k_cache, v_cache, slot_mapping,
        np.int32(num_tokens), np.int32(num_kv_heads), np.int32(head_dim))


def _write_reference(k, v, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k_scale: Tensor | None,
                     v_scale: Tensor | None) -> None:
    if is_fp8(k_cache):
        write_kv_fp8_reference(k, v, k_cache.array, v_cache.array, slot_mapping.array, k_scale.array, v_scale.array)
    else:
        write_kv_reference(k, v, k_cache.array, v_cache.array, slot_mapping.array)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """k_cache/v_cache[slot] = k/v[t] for slot = slot_mapping[t] = block * block_size + offset; slot < 0 skips.
    k, v: bf16 [T, Hkv, D]. An FP8 cache (float8_e4m3fn) stores e4m3(k/v[t] / k_scale/v_scale[h]) (float32 [Hkv])."""
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    check_tensor("k", k, dtype=bfloat16, shape=(None, num_kv_heads, head_dim))
    num_tokens = k.shape[0]
    check_tensor("v", v, dtype=bfloat16, shape=k.shape)
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_tokens,))
    device = same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if device == "cpu":
        _write_reference(k.array, v.array, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    check_aligned("k", k)
    check_aligned("v", v)
    # One kernel for both forms: K and V pointers relative to k's buffer address (v may live anywhere).
    _write_kv(k, 0, v.ptr - k.ptr, num_kv_heads * head_dim, num_tokens, k_cache, v_cache, slot_mapping, k_scale,
              v_scale)


def write_kv_packed(qkv: Tensor, num_q_heads: int, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                    k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """write_kv with K = qkv heads [Hq, Hq + Hkv) and V = heads [Hq + Hkv, Hq + 2 Hkv) of qkv [T, Hq + 2 Hkv, D]
    (head_dim 256: or of the gated qkvg [T, 2 Hq + 2 Hkv, D], whose trailing gate heads are not read)."""
    _, _, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    total = num_q_heads + 2 * num_kv_heads
    if head_dim in GATED_HEAD_DIMS and qkv.ndim == 3 and qkv.shape[1] == total + num_q_heads:
        total += num_q_heads
    check_tensor("qkv", qkv, dtype=bfloat16, shape=(None, total, head_dim))
    num_tokens = qkv.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_tokens,))
    device = same_device(qkv=qkv, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if device == "cpu":
        a = qkv.array
        _write_reference(a[:, num_q_heads:num_q_heads + num_kv_heads],
                         a[:, num_q_heads + num_kv_heads:num_q_heads + 2 * num_kv_heads], k_cache,
                         v_cache, slot_mapping, k_scale, v_scale)
        return
    check_aligned("qkv", qkv)
    elem = qkv.itemsize * head_dim
    _write_kv(qkv, num_q_heads * elem, (num_q_heads + num_kv_heads) * elem, total * head_dim, num_tokens,
              k_cache, v_cache, slot_mapping, k_scale, v_scale)
