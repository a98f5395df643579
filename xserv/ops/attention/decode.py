"""Single-token decode over the paged cache: split-KV ("flash-decoding") with GQA grouping: the ops
(attention_decode; attention_decode_rope with the q/k norm, RoPE and the KV write folded in) and their launch. The
kernel table is decode_kernels.py's, the plan (kernel and split-KV grid) decode_plan.py's; their names are
re-exported here, where the launchers look them up.

Which kernel runs: v4 (cuda_src/attention_decode.cu: v2's CUDA-core math behind a per-lane cp.async ring and a
shared page table, split combine folded in), or v2 (attention_decode_v2.cu, plain loads and a separate combine
kernel) where a split's pages would overflow v4's shared page table (a block size below 8 with a very long context).
The v4 plan (`v4_plan`) balances the keys per SM rather than filling resident slots: few sequences get about two
CTAs per SM, and there (where the group is at most 4, or splits into subgroups of at most 4 query heads) v4 runs
8-warp CTAs (v4w8), twice the bytes in flight per SM. DECODE_KERNELS lists these shipped kernels only; the
development kernels (v3 on tensor cores, the v4 stage-count, 4-warp-only and 16-warp experiments) live in
cuda_src/dev/ or are named by the dev registry tools/dev/kernels.py, whose DecodeKernel the ops take as `variant`.
Head dim 256 (Qwen3.5's gated attention: partial RoPE, the gated qkvg) runs v2's body (attention_decode_d256.cu);
attention_decode_rope there is qk_norm_rope_write_kv then that kernel, two launches. Measurements:
docs/kernels/attention.md.

An FP8 (float8_e4m3fn) cache runs the same plan and grid with the same kernels' e4m3 instantiations
(cuda_src/attention_decode_fp8.cu: attention_decode_fp8_v4_..., attention_decode_fp8_d{D}_g{G} for the v2
fallback; DecodeKernel.fp8_name), which take the layer's k_scale / v_scale after the bf16 kernels' arguments.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...runtime import get_device, kernel
from ...runtime.compiler import piece
from ...runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR  # noqa: F401
from ...tensor import Tensor, bfloat16, float32, int32
from .._checks import check_aligned, check_tensor, output, same_device
from .._launch import check_alias, check_eps, pooled_buffer
from ._args import check_cache, check_tables, is_fp8, query_heads
from .decode_kernels import (D256_FAMILY, D256_HEAD_DIMS, D256_SUBGROUPS, DECODE_KERNELS, DEFAULT_DECODE, FP8_FAMILY,  # noqa: F401
                             MAX_SUBGROUPS, SUBGROUP_MAX_CHUNK, V2_CTAS_PER_SM, V4_CTA_COST_KEYS, V4_FAST_COMBINE,
                             V4_MAX_SPLITS, V4_RING_STAGE_BYTES, V4_ROW_BYTES, V4_TABLE_CAP, DecodeKernel, _mma_form,
                             has_fp8_mma, lean_entry, v4_min_blocks)
from .decode_plan import (_subgroup_counts, decode_plan, fast_div, launch_smem, plan_decode,  # noqa: F401
                          spread_smem, v4_plan)
from .reference import attention_decode_reference

_workspaces: list[Tensor] = []  # kept for the life of the process: CUDA graphs may have captured their addresses
_counters: list[Tensor] = []  # per-(sequence, kv head) split counters: zeroed once, reset by the kernels themselves


def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor, block_tables: Tensor,
                     scale: float, max_kv_len: int, out: Tensor | None = None,
                     num_q_heads: int | None = None, variant: str | DecodeKernel | None = None,
                     k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """One query per sequence at position kv_lens[s] - 1 (its K/V already in the cache): q [B, Hq, D] (or packed
    qkv with num_q_heads), kv_lens int32 [B] (0 <= kv_len <= max_kv_len; 0 gives a zero row), block_tables int32
    [B, max_blocks] -> out bf16 [B, Hq, D]. max_kv_len is a host-side bound that sizes the split-KV grid (no device
    reads). variant: a DECODE_KERNELS name (default v4; the others are for tests and benchmarks) or a DecodeKernel
    (a development kernel of tools/dev/kernels.py). An FP8 cache
    (float8_e4m3fn, with this layer's k_scale / v_scale float32 [Hkv]) runs the planned kernel's e4m3 instantiation
    (attention_decode_fp8.cu; K and V dequantized in registers): the production variants only (DecodeKernel.has_fp8;
    a dev variant raises ValueError)."""
    _, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    num_q_heads = query_heads(q, num_q_heads, num_kv_heads, head_dim)
    num_seqs = q.shape[0]
    check_tables(kv_lens, block_tables, num_seqs)
    device = same_device(q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=kv_lens, block_tables=block_tables, out=out)
    out = output("out", out, (num_seqs, num_q_heads, head_dim), bfloat16, device)
    variant = _check_variant(variant, k_cache)
    if num_seqs == 0:
        return out
    if device == "cpu":
        out.array[...] = attention_decode_reference(
            q.array, k_cache.array, v_cache.array, kv_lens.array, block_tables.array, scale, num_q_heads,
            k_scale=None if k_scale is None else k_scale.array,
            v_scale=None if v_scale is None else v_scale.array).astype(bfloat16)
        return out
    scales = (k_scale, v_scale) if is_fp8(k_cache) else None
    _launch(_plan(variant, num_seqs, num_kv_heads, max_kv_len, block_size, head_dim, num_q_heads // num_kv_heads),
            q, k_cache, v_cache, kv_lens, block_tables, scale, out, num_q_heads, _PLAIN_V4, scales=scales)
    return out


_PLAIN_V4 = (0, 0, 0, np.int32(0), 0, 0, np.float32(0))  # v4's fused-entry arguments of a plain call (nullptr: off)


def _check_variant(variant: str | DecodeKernel | None, k_cache: Tensor) -> str | DecodeKernel:
    """The variant (None: DEFAULT_DECODE), checked: a DECODE_KERNELS name or a DecodeKernel, and one with e4m3
    kernels for an FP8 cache (DecodeKernel.has_fp8)."""
    variant = DEFAULT_DECODE if variant is None else variant
    if isinstance(variant, DecodeKernel):
        k = variant
    elif variant in DECODE_KERNELS:
        k = DECODE_KERNELS[variant]
    else:
        raise ValueError(f"variant: unknown decode kernel {variant!r}; known: {', '.join(DECODE_KERNELS)}")
    if is_fp8(k_cache) and not k.has_fp8:
        raise ValueError(f"variant: {k.variant} has no FP8-cache kernels (attention_decode_fp8.cu instantiates "
                         f"{', '.join(v for v, k in DECODE_KERNELS.items() if k.has_fp8)})")
    return variant


def _plan(variant: str | DecodeKernel, num_seqs: int, num_kv_heads: int, max_kv_len: int, block_size: int,
          head_dim: int, group: int) -> tuple[DecodeKernel, int, int]:
    max_kv_len = int(max_kv_len)
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len: {max_kv_len} < 1")
    info = get_device().info
    k, splits, chunk = plan_decode(variant, num_seqs, num_kv_heads, max_kv_len, block_size, head_dim, group,
                                   info.multiprocessor_count, info.max_shared_memory_per_block_optin,
                                   info.max_shared_memory_per_multiprocessor)
    if k.generation >= 3 and splits > V4_MAX_SPLITS:
        raise ValueError(f"plan: {splits} splits > {V4_MAX_SPLITS}, the folded combine's limit")
    return k, splits, chunk


def _launch(plan: tuple[DecodeKernel, int, int], q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_lens: Tensor,
            block_tables: Tensor, scale: float, out: Tensor, num_q_heads: int, v4_extra: tuple,
            fused: bool = False, scales: tuple[Tensor, Tensor] | None = None) -> None:
    """Launch a planned decode kernel; v4 gets `v4_extra` (its fused-entry arguments: positions, slot_mapping,
    cos_sin, max_pos, q_weight, k_weight, eps; _PLAIN_V4 for plain attention). scales: an FP8 cache's (k_scale,
    v_scale): the kernel's e4m3 instantiation (the FP8 piece), the scales after its other arguments."""
    k, splits, chunk = plan
    num_seqs, _, head_dim = out.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if scales is not None and has_fp8_mma(k, head_dim, group):
        k = _mma_form(k)
        plan = (k, splits, chunk)
    heads = num_kv_heads * k.subgroups  # grid rows: one per query-head subgroup of each kv head
    part_o = part_lse = out  # unused by the kernels when splits == 1
    if splits > 1:
        rows = num_seqs * num_q_heads * splits
        ws = pooled_buffer(_workspaces, rows * (head_dim + 1), float32, 1 << 18)
        part_o, part_lse = ws.ptr, ws.ptr + rows * head_dim * 4
    args = [q, np.int64(q.shape[1] * head_dim), k_cache, v_cache, kv_lens, block_tables,
            np.int32(block_tables.shape[1]), np.int32(block_size), np.int32(num_q_heads), np.int32(num_kv_heads),
            np.float32(scale * math.log2(math.e)), np.int32(chunk), np.int32(splits), out, part_o, part_lse]
    if k.generation >= 3:  # the split combine is folded in: the last CTA of a (sequence, kv head) merges
        args.append(pooled_buffer(_counters, num_seqs * heads, int32, 4096, zeroed=True))
    if k.generation == 4:
        magic, shift = fast_div(block_size)
        args += [np.uint32(magic), np.int32(shift)]
    v4_template = k.generation == 4 and k.fused_args  # v4 and its dev stage counts
    if v4_template:
        args += v4_extra
    if scales is not None:
        args += scales
    grid = (splits, heads, num_seqs)
    pdl = fused or v4_template
    info = get_device().info  # the device's shared memory, not sm_90's: an sm_86/89 CTA gets 99 KB at most
    smem = launch_smem(plan, head_dim, num_kv_heads, num_seqs, fused, info.multiprocessor_count,
                       info.max_shared_memory_per_block_optin, info.max_shared_memory_per_multiprocessor)
    name = (k.name if scales is None else k.fp8_name)(head_dim, group)
    name += "_lean" if fused and lean_entry(k, head_dim, group, splits) else ""
    family = _module(k.family if scales is None else FP8_FAMILY, head_dim, group, scales is not None)
    # v4 waits for the previous kernel itself (pdl_wait): it may be launched with programmatic dependent launch
    kernel(family, name)(grid, (32 * k.warps, 1, 1), *args, smem=smem, pdl=pdl)
    if k.generation == 2 and splits > 1:
        kernel(_module("attention_decode_v2", head_dim, group, scales is not None), "attention_decode_combine")(
            (num_q_heads, num_seqs, 1), (head_dim, 1, 1), part_o, part_lse, kv_lens, np.int32(chunk),
            np.int32(splits), np.int32(head_dim), out)


@functools.lru_cache(maxsize=None)
def _module(family: str, head_dim: int, group: int, fp8: bool = False) -> str:
    """What the kernels of `family` for this shape load from: attention_decode and attention_decode_v2 are compiled
    per (head dim, query heads per kv head) as the pieces "attention_decode:d128_g4" (runtime/compiler.py; a start-up
    compiles the model's, another shape compiles on first use), attention_decode_fp8 likewise (kvfp8=1: an FP8-cache
    model's start-up compiles it); head dim 256's kernels (v2's body and its combine, both formats) are
    attention_decode_d256's pieces "attention_decode_d256:d256_g6_k0" (fp8: _k1); the dev family whole."""
    if head_dim in D256_HEAD_DIMS and not family.startswith("dev/"):
        return piece(D256_FAMILY, head_dim=head_dim, group=group, kvfp8=int(fp8))
    return piece(family, head_dim=head_dim, group=group, kvfp8=1)


_rope_module = None


def _rope():
    """xserv.ops.rope, imported on first use (it imports this package: a module-level import would be circular)."""
    global _rope_module
    if _rope_module is None:
        from .. import rope

        _rope_module = rope
    return _rope_module


def attention_decode_rope(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, positions: Tensor,
                          cos_sin: Tensor, num_q_heads: int, eps: float, k_cache: Tensor, v_cache: Tensor,
                          slot_mapping: Tensor, kv_lens: Tensor, block_tables: Tensor, scale: float, max_kv_len: int,
                          out: Tensor | None = None, variant: str | DecodeKernel | None = None,
                          k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """qk_norm_rope_write_kv (q_weight, k_weight given: Qwen3's head norms; both None: Llama) followed by
    attention_decode, for a decode batch (one new token per sequence), in one launch with the same results:
    qkv bf16 [B, Hq + 2 Hkv, D] packed (16-byte aligned), positions and slot_mapping int32 [B] (slot < 0: nothing
    written), cos_sin float32 [max_pos, D] (16-byte aligned), caches, kv_lens and block_tables as attention_decode
    (kv_len counts the new token) -> out bf16 [B, Hq, D]. The new K/V go into the cache at slot_mapping; qkv is read
    only by the fused kernel (its q and k heads stay unrotated; the v2 fallback's two launches rotate them in place,
    so afterwards they are unspecified). The fused kernel attends over the new key as it wrote it when slot_mapping[s]
    is the slot the block table gives position kv_len - 1 (any batch xserv builds), else as the cache holds it there,
    as attention_decode would. variant: as attention_decode; a plan that runs v2 (variant "v2", or block_size < 8
    with very long contexts) runs qk_norm_rope_write_kv and attention_decode, two launches. An FP8 cache (with
    k_scale / v_scale) runs the same kernels' e4m3 instantiations: the fused entry quantizes the new K/V as the
    quantizing write does (the same bits), the v2 fallback's two launches are qk_norm_rope_write_kv's quantizing kernel
    and the FP8 v2 kernel. Head dim 256 (Qwen3.5's gated attention: head norms required): cos_sin [max_pos, 64]
    (partial RoPE, rope.PARTIAL_ROTARY), qkv may be the gated qkvg [B, 2 Hq + 2 Hkv, D] (gate heads untouched), and
    the plan runs v2: qk_norm_rope_write_kv then the v2 kernel, two launches (qkv's q and k heads rotated in place).
    """
    _, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    rope = _rope()
    rope.check_packed_qkv(qkv, positions, cos_sin, num_q_heads, num_kv_heads, partial=True)
    if not cos_sin.shape[0]:
        raise ValueError(f"cos_sin: shape {list(cos_sin.shape)}, expected [max_positions > 0, {head_dim}]")
    num_q_heads = int(num_q_heads)
    query_heads(qkv, num_q_heads, num_kv_heads, head_dim)  # head_dim against the cache's, group size, alignment
    num_seqs = qkv.shape[0]
    norm = rope.check_head_norms(q_weight, k_weight, head_dim)
    check_tensor("slot_mapping", slot_mapping, dtype=int32, shape=(num_seqs,))
    check_tables(kv_lens, block_tables, num_seqs)
    eps32 = check_eps(eps)
    device = same_device(qkv=qkv, q_weight=q_weight, k_weight=k_weight, positions=positions, cos_sin=cos_sin,
                         k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, kv_lens=kv_lens,
                         block_tables=block_tables, out=out)
    out = output("out", out, (num_seqs, num_q_heads, head_dim), bfloat16, device)
    for name, t, other_name, other in (("k_cache", k_cache, "qkv", qkv), ("v_cache", v_cache, "qkv", qkv),
                                       ("out", out, "qkv", qkv), ("v_cache", v_cache, "k_cache", k_cache),
                                       ("out", out, "k_cache", k_cache), ("out", out, "v_cache", v_cache)):
        check_alias(name, t, other_name, other, allow_identical=False)
    variant = _check_variant(variant, k_cache)
    if num_seqs == 0:
        return out
    if device == "cpu":  # the composition of the references (qkv itself is left as it is)
        scales = {} if k_scale is None else {"k_scale": k_scale.array, "v_scale": v_scale.array}
        rotated = rope.qk_norm_rope_write_kv_reference(
            qkv.array, q_weight.array if norm else None, k_weight.array if norm else None, positions.array,
            cos_sin.array, num_q_heads, num_kv_heads, eps32, k_cache.array, v_cache.array, slot_mapping.array,
            **scales)
        out.array[...] = attention_decode_reference(rotated, k_cache.array, v_cache.array, kv_lens.array,
                                                    block_tables.array, scale, num_q_heads,
                                                    **scales).astype(bfloat16)
        return out
    check_aligned("cos_sin", cos_sin)
    scales = (k_scale, v_scale) if is_fp8(k_cache) else None
    plan = _plan(variant, num_seqs, num_kv_heads, max_kv_len, block_size, head_dim, num_q_heads // num_kv_heads)
    if plan[0].generation != 4 or not plan[0].fused_args:  # v2 (or a dev kernel without the entry): the two ops
        rope.qk_norm_rope_write_kv(qkv, q_weight, k_weight, positions, cos_sin, num_q_heads, num_kv_heads, eps32,
                                   k_cache, v_cache, slot_mapping, pdl=True, k_scale=k_scale, v_scale=v_scale)
        _launch(plan, qkv, k_cache, v_cache, kv_lens, block_tables, scale, out, num_q_heads, _PLAIN_V4,
                scales=scales)
        return out
    _launch(plan, qkv, k_cache, v_cache, kv_lens, block_tables, scale, out, num_q_heads,
            (positions, slot_mapping, cos_sin, np.int32(cos_sin.shape[0]), q_weight if norm else 0,
             k_weight if norm else 0, eps32), fused=True, scales=scales)
    return out
