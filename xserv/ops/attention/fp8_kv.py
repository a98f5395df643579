"""The FP8 (e4m3) KV cache: quantization on write, dequantization for attention (docs/kernels/attention.md,
"FP8 KV cache").

Format: per layer, k_cache / v_cache float8_e4m3fn [num_blocks, block_size, Hkv, D] (1 byte an element, the bf16
layout otherwise) and k_scale / v_scale float32 [Hkv]: value = float(code) * scale. Written as
code = e4m3(float32(x) / scale) (an IEEE float32 division, then round to nearest even, saturating at +-448: a value
past the range costs accuracy, never a NaN). The engine's scales are all 1.0 (engine/kv_cache.py says why); the
kernels and these references take any positive scale.

Here: the NumPy references (the CPU backend runs them; the tests compare the CUDA kernels with them), the soft
float -> e4m3 conversion of cuda_src/e4m3.cuh re-implemented word for word (tested against ml_dtypes), and the
launchers of cuda_src/kv_cache.cu's write_kv_fp8 / dequantize_kv_blocks_fp8 (decode attention over an FP8 cache:
decode.py, which launches cuda_src/attention_decode_fp8.cu's e4m3 instantiations of the bf16 kernels).
"""
from __future__ import annotations

import math

import numpy as np

from ...runtime import kernel
from ...tensor import Tensor, bfloat16, float8_e4m3fn
from .._launch import pooled_buffer

E4M3_MAX = 448.0
_THREADS = 256


# ---- NumPy: the conversions --------------------------------------------------------------------------------------
def quantize_e4m3_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn codes, round to nearest even, saturating at +-448 (ml_dtypes rounds, the clip
    saturates; NaN stays NaN)."""
    x = np.asarray(x, np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(float8_e4m3fn)


def float_to_e4m3_soft(x: np.ndarray) -> np.ndarray:
    """cuda_src/e4m3.cuh's float_to_e4m3_soft in NumPy, bit for bit: float32 -> uint8 codes (the GPU below sm_89
    runs this arithmetic; tests compare it with quantize_e4m3_reference over every float class)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    rounded = mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))
    normal = (rounded >> np.uint32(20)) - np.uint32(120 << 3)
    tiny = mag < np.uint32(0x3C800000)
    small = np.rint(np.where(tiny, mag, 0).view(np.float32) * np.float32(512)).astype(np.uint32)  # half to even
    code = np.where(tiny, small, normal)
    code = np.where(mag > np.uint32(0x43E00000), np.uint32(0x7E), code)
    code = sign | code
    code = np.where(mag > np.uint32(0x7F800000), np.uint32(0x7F), code)
    return code.astype(np.uint8)


def dequantize_kv_reference(codes: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """float(code) * scale[h] for codes [..., Hkv, D] (float8_e4m3fn), scale [Hkv]: the values an FP8 cache holds, in
    `dtype` (float32: the kernels' product; float64 in tests)."""
    return codes.astype(np.float32).astype(dtype) * np.asarray(scale, np.float32).astype(dtype)[:, None]


def quantize_kv_reference(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The codes write_kv_fp8 stores for rows x [..., Hkv, D] (bf16 or float32) with scale [Hkv]."""
    return quantize_e4m3_reference(np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None])


def write_kv_fp8_reference(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                           slot_mapping: np.ndarray, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
    """In place: the FP8 caches (viewed as [num_slots, Hkv, D]) [slot] = e4m3(k/v [t] / scale) for slot >= 0."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = np.asarray(slot_mapping, np.int64)
    keep = slots >= 0
    k_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = quantize_kv_reference(k[keep], k_scale)
    v_cache.reshape(-1, num_kv_heads, head_dim)[slots[keep]] = quantize_kv_reference(v[keep], v_scale)


# ---- CUDA launchers ----------------------------------------------------------------------------------------------
def launch_write_kv_fp8(src: Tensor, k_ptr_offset: int, v_ptr_offset: int, row_stride: int, num_tokens: int,
                        k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, k_scale: Tensor,
                        v_scale: Tensor) -> None:
    """write_kv_fp8 (kv_cache.cu): K and V at src's address plus the byte offsets, row_stride elements a token."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    n = num_tokens * num_kv_heads * (head_dim // 8)
    kernel("kv_cache", "write_kv_fp8")(
        ((n + _THREADS - 1) // _THREADS, 1, 1), (_THREADS, 1, 1),
        src.ptr + k_ptr_offset, src.ptr + v_ptr_offset, np.int64(row_stride), k_cache, v_cache, slot_mapping,
        k_scale, v_scale, np.int32(num_tokens), np.int32(num_kv_heads), np.int32(head_dim))


def dequantize_kv_blocks(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor, kv_lens: Tensor,
                         block_tables: Tensor, k_out: Tensor, v_out: Tensor) -> None:
    """k_out / v_out (bf16, the caches' shape) [b] = the dequantized blocks b that the batch's sequences hold
    (block_tables[s, j] for j * block_size < kv_lens[s]); other blocks of the outputs are left as they are."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    if num_seqs == 0 or max_blocks == 0:
        return
    if k_cache.device == "cpu":
        tables, lens = block_tables.array, kv_lens.array
        for s in range(num_seqs):
            blocks = np.asarray(tables[s, : -(-int(lens[s]) // block_size)], np.int64)
            k_out.array[blocks] = dequantize_kv_reference(k_cache.array[blocks], k_scale.array).astype(bfloat16)
            v_out.array[blocks] = dequantize_kv_reference(v_cache.array[blocks], v_scale.array).astype(bfloat16)
        return
    kernel("kv_cache", "dequantize_kv_blocks_fp8")(
        (max_blocks, num_seqs, 1), (_THREADS, 1, 1), k_cache, v_cache, k_scale, v_scale, kv_lens, block_tables,
        np.int32(max_blocks), np.int32(block_size), np.int32(num_kv_heads), np.int32(head_dim), k_out, v_out)


_scratch: list[Tensor] = []  # the bf16 copy for prefill when the caller passes none (tests): kept, graph-safe


def prefill_scratch(k_cache: Tensor, scratch: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """The bf16 (K, V) copy prefill reads over an FP8 cache: the caller's (KVCache.prefill_scratch: bf16, the layer
    cache's shape), checked, or a pooled one of that shape."""
    shape = tuple(k_cache.shape)
    if scratch is not None:
        for name, t in zip(("kv_scratch[0]", "kv_scratch[1]"), scratch):
            if not isinstance(t, Tensor) or t.dtype != bfloat16 or tuple(t.shape) != shape or t.device != k_cache.device:
                got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name}: {got}, expected bfloat16 {list(shape)} on {k_cache.device}")
        return scratch
    count = math.prod(shape)
    if k_cache.device == "cpu":
        return Tensor.zeros(shape, bfloat16, "cpu"), Tensor.zeros(shape, bfloat16, "cpu")
    buf = pooled_buffer(_scratch, 2 * count, bfloat16, 1 << 20)
    return buf[:count].view(*shape), buf[count:2 * count].view(*shape)


__all__ = ["E4M3_MAX", "quantize_e4m3_reference", "float_to_e4m3_soft", "dequantize_kv_reference",
           "quantize_kv_reference", "write_kv_fp8_reference", "dequantize_kv_blocks", "prefill_scratch",
           "launch_write_kv_fp8"]
