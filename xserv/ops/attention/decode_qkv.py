"""Decode attention with the qkv projection folded in: rmsnorm_linear(residual, norm_weight, eps, w_qkv) followed by
attention_decode_rope, for the one-token forward (one sequence), in one launch where the folded kernel applies.

The folded kernel (attention_decode_v4_d128_g2_s2_q, a development kernel in cuda_src/dev/attention_decode_dev.cu;
qkv_rows and combine_splits_cluster in cuda_src/attention_decode.cu) runs one thread-block cluster of
V4_CLUSTER_MAX CTAs per kv head. The (G + 2) x D rows of W_qkv that a kv head needs are divided over its cluster:
each CTA bulk-copies its rows into shared memory before it waits for the kernel before (the weights do not depend on
it), applies the RMSNorm to x, computes its rows in rmsnorm_linear's order (the bits it would write into qkv) and
writes them into every CTA of the cluster; then each CTA is one split of decode attention v4 (the q/k head norms,
RoPE and the new token's KV write folded in), and the splits are combined through the cluster's shared memory. What
it removes: the qkv GEMV's launch and its boundary with the attention kernel (whose CTAs could only start as the
GEMV's left), the q rows' round trip through global memory, and the split hand-off through L2.

It applies to one sequence, head_dim 128, G = 2, and rows of the kv head that fit one cluster's shared memory (the
Qwen3-0.6B shape: 16 q / 8 kv heads, hidden 1024), on sm_90 with a context whose pages fit v4's shared page table;
anything else runs the two ops. Measurements: docs/kernels/attention.md.
"""
from __future__ import annotations

import functools

import numpy as np

from ...runtime import get_device
from ...tensor import Tensor, bfloat16, float32
from .._checks import check_aligned, check_tensor, same_device
from .._launch import check_alias
from ..gemv import plan as gemv_plan
from ..gemv import rmsnorm_linear
from . import decode as D

FOLDED = D.DecodeKernel("v4q", 4, "dev/attention_decode_dev", suffix="_q", shapes=frozenset({(128, 2)}), cluster=True)
_SMEM_MAX = 227 * 1024


def folded_smem(head_dim: int, group: int, hidden: int) -> int:
    """Dynamic shared memory of the folded kernel (decode_split_v4 with QKV, kQkv* in attention_decode.cu): v4's
    layout, then one mbarrier per 16-row piece of the CTA's weight rows (128-aligned) and the RMS scratch (16 bytes),
    the raw q/k/v rows (kV4RowBytes), the CTA's weight rows (128-aligned) and the staged x row."""
    rows = (group + 2) * head_dim // D.V4_CLUSTER_MAX
    bars = -(-FOLDED.smem(head_dim) // 128) * 128
    raw = bars + -(-(rows // 16 * 8) // 16) * 16 + 16
    weights = -(-(raw + D.V4_ROW_BYTES) // 128) * 128
    return weights + (rows + 1) * hidden * 2


@functools.lru_cache(maxsize=64)
def folded_applies(hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int, arch: str) -> bool:
    """Whether the folded kernel is compiled for this shape and its shared memory fits (one sequence)."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads or arch != "sm_90a" or hidden % 8:
        return False
    group = num_q_heads // num_kv_heads
    rows = (group + 2) * head_dim
    return ((head_dim, group) in FOLDED.shapes and rows % (D.V4_CLUSTER_MAX * 16) == 0
            and folded_smem(head_dim, group, hidden) <= _SMEM_MAX)


def folded_plan(max_kv_len: int, block_size: int) -> tuple[int, int] | None:
    """(num_splits, chunk_len) of the folded kernel: always one full cluster (every CTA computes its share of the
    rows), chunk_len the bound of the per-sequence chunk the kernel computes; None where the pages of the whole
    context do not fit v4's shared page table (the two ops run)."""
    splits = D.V4_CLUSTER_MAX
    chunk = max(16, -(-(-(-max(int(max_kv_len), 1) // splits)) // 16) * 16)
    return (splits, chunk) if -(-splits * chunk // block_size) + 1 <= D.V4_TABLE_CAP else None


def rmsnorm_qkv_attention_decode(residual: Tensor, norm_weight: Tensor, eps: float, w_qkv: Tensor, qkv: Tensor,
                                 q_weight: Tensor | None, k_weight: Tensor | None, positions: Tensor,
                                 cos_sin: Tensor, num_q_heads: int, k_cache: Tensor, v_cache: Tensor,
                                 slot_mapping: Tensor, kv_lens: Tensor, block_tables: Tensor, scale: float,
                                 max_kv_len: int, out: Tensor | None = None, folded: bool = True) -> Tensor:
    """rmsnorm_linear(residual, norm_weight, eps, w_qkv, out=qkv) then attention_decode_rope(qkv, q_weight,
    k_weight, positions, cos_sin, num_q_heads, eps, k_cache, v_cache, slot_mapping, kv_lens, block_tables, scale,
    max_kv_len, out) (one eps for the three norms, as Qwen3 has it), with the same results (out and the caches),
    in one launch where the folded kernel applies (module docstring; folded=False: never). residual fp32 [B, hidden],
    norm_weight bf16 [hidden], w_qkv bf16 [(Hq + 2 Hkv) * D, hidden], qkv bf16 [B, Hq + 2 Hkv, D]: the packed buffer
    the two ops use (the folded kernel leaves it unwritten). The two ops run the cluster combine (v4c) where it is
    compiled, as the folded kernel does, so that the forms agree bit for bit."""
    check_tensor("residual", residual, dtype=float32, ndim=2)
    num_seqs, hidden = residual.shape
    check_tensor("norm_weight", norm_weight, dtype=bfloat16, shape=(hidden,))
    out, _, eps32, _ = D.check_decode_rope_call(qkv, q_weight, k_weight, positions, cos_sin, num_q_heads, eps,
                                                k_cache, v_cache, slot_mapping, kv_lens, block_tables, out, None)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = int(num_q_heads)
    check_tensor("w_qkv", w_qkv, dtype=bfloat16, shape=((num_q_heads + 2 * num_kv_heads) * head_dim, hidden))
    for name, t in (("residual", residual), ("w_qkv", w_qkv)):
        check_aligned(name, t)  # bulk copies and 16-byte loads
    if qkv.shape[0] != num_seqs:
        raise ValueError(f"qkv: {qkv.shape[0]} rows for the residual's {num_seqs}")
    device = same_device(residual=residual, norm_weight=norm_weight, w_qkv=w_qkv, qkv=qkv, out=out)
    check_alias("qkv", qkv, "residual", residual, allow_identical=False)
    if int(max_kv_len) < 1:
        raise ValueError(f"max_kv_len: {max_kv_len} < 1")
    plan = folded_plan(max_kv_len, block_size) if num_seqs == 1 and folded and device == "cuda" else None
    if plan is None or not folded_applies(hidden, num_q_heads, num_kv_heads, head_dim, get_device().arch):
        rmsnorm_linear(residual, norm_weight, eps32, w_qkv, out=qkv.view(num_seqs, -1))
        cluster = (head_dim, num_q_heads // num_kv_heads) in D.DECODE_KERNELS["v4c"].shapes
        return D.attention_decode_rope(qkv, q_weight, k_weight, positions, cos_sin, num_q_heads, eps32, k_cache,
                                       v_cache, slot_mapping, kv_lens, block_tables, scale, max_kv_len, out=out,
                                       variant="v4c" if cluster else None)
    _, _, gemv_split, _ = gemv_plan(1, w_qkv.shape[0], get_device().multiprocessor_count, k=hidden)
    norm = q_weight is not None
    D._launch((FOLDED, *plan), residual, k_cache, v_cache, kv_lens, block_tables, scale, out, num_q_heads,
              (positions, slot_mapping, cos_sin, np.int32(cos_sin.shape[0]), q_weight if norm else 0,
               k_weight if norm else 0, eps32), fused=True,
              tail_args=(residual, norm_weight, w_qkv, np.int32(hidden), np.int32(gemv_split)),
              smem=folded_smem(head_dim, num_q_heads // num_kv_heads, hidden))
    return out

