"""Attention over a paged KV cache: writing new K/V into the cache, causal prefill of packed variable-length
query chunks, and single-token decode (split-KV with a log-sum-exp combine), also with the q/k head norm, RoPE and
the new token's KV-cache write folded in (attention_decode_rope: qk_norm_rope_write_kv + attention_decode, one
launch).

Cache layout, per layer: k_cache, v_cache bf16 [num_blocks, block_size, num_kv_heads, head_dim]; token t of
sequence s lives in block block_tables[s, t // block_size] at offset t % block_size. GQA: query head h uses kv head
h // (num_q_heads // num_kv_heads). Queries may be given as q [T, Hq, D] or as the packed qkv projection
[T, Hq + 2 Hkv, D] with `num_q_heads` saying how many of its heads are queries.

Modules: reference (NumPy, float32 for the CPU backend, float64 in tests), kv_write (cuda_src/kv_cache.cu),
prefill and decode (each with its table of the shipped kernels, cuda_src/attention_*.cu; the development ones in
cuda_src/dev/ are named by tools/dev/kernels.py). fp8_kv: the FP8 (e4m3) KV cache, a float8_e4m3fn cache with
per-kv-head float32 k_scale / v_scale that every op above takes (quantized on write, dequantized in registers by
attention_decode_fp8.cu, into a bf16 copy before prefill). gate: the output gate of Qwen3.5's gated attention
(attention_output_gate), whose head_dim 256 layers run prefill and decode on the packed qkvg [T, 2 Hq + 2 Hkv, 256]
(GATED_HEAD_DIMS; partial RoPE: ops/rope.py). Kernel notes and measurements: docs/kernels/attention.md.
"""
from ._args import ALL_HEAD_DIMS, GATED_HEAD_DIMS, HEAD_DIMS, MAX_GQA_GROUP
from .decode import DECODE_KERNELS, attention_decode, attention_decode_rope, decode_plan
from .gate import attention_output_gate, attention_output_gate_reference
from .kv_write import write_kv, write_kv_packed
from .prefill import PREFILL_KERNELS, attention_prefill, default_prefill_variant, prefill_variants
from .reference import (attention_decode_reference, attention_prefill_reference, attention_reference, gather_kv,
                        write_kv_reference)

__all__ = [
    "ALL_HEAD_DIMS", "GATED_HEAD_DIMS", "HEAD_DIMS", "MAX_GQA_GROUP", "DECODE_KERNELS", "attention_output_gate",
    "attention_output_gate_reference", "PREFILL_KERNELS", "attention_decode", "attention_decode_rope",
    "attention_prefill", "attention_decode_reference", "attention_prefill_reference", "attention_reference",
    "decode_plan", "default_prefill_variant", "gather_kv", "prefill_variants", "write_kv", "write_kv_packed", "write_kv_reference",
]
