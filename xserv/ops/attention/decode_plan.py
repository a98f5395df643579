"""The decode plan: which kernel of the table (decode_kernels.py) runs a batch, and its split-KV grid (num_splits,
chunk_len), from the batch's shape and the device's SMs and shared memory. Host arithmetic only (no GPU): the tests
and tools/dev/sweep_decode_plan.py call it directly. Measurements behind the rules: docs/kernels/attention.md.
"""
from __future__ import annotations

import dataclasses
import functools

from ...runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR
from .decode_kernels import (D256_HEAD_DIMS, D256_MIN_CHUNK, D256_SUBGROUPS, DECODE_KERNELS, DEFAULT_DECODE, MAX_SUBGROUPS, SUBGROUP_MAX_CHUNK,
                             V2_CTAS_PER_SM, V4_CTA_COST_KEYS, V4_MAX_SPLITS, V4_TABLE_CAP, DecodeKernel)


def fast_div(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31 (fast_div in the kernel)."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def decode_plan(num_seqs: int, num_kv_heads: int, max_kv_len: int, multiprocessor_count: int,
                ctas_per_sm: int = V2_CTAS_PER_SM, balance: bool = False,
                max_chunk: int | None = None, min_chunk: int = 256) -> tuple[int, int]:
    """(num_splits, chunk_len): split-KV grid over (sequence x kv head x split), chunk_len a multiple of 64, each
    split at least min_chunk keys (a multiple of 64; head_dim 256 takes 64: D256_MIN_CHUNK). v2 (balance=False): enough CTAs for ~`ctas_per_sm` per multiprocessor. v3/v4
    (balance=True, ctas_per_sm = CTAs resident per SM): the split count whose grid fills the last wave of resident
    CTAs best (within 3% of the best fill, the fewest splits). max_chunk (balance=True): no split longer than this
    (v4's page table), as far as 256 splits allow."""
    max_kv_len = max(int(max_kv_len), 1)
    pairs = max(num_seqs * num_kv_heads, 1)
    limit = max(1, min(-(-max_kv_len // min_chunk), 256))
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


def v4_plan(num_seqs: int, num_kv_heads: int, max_kv_len: int, multiprocessor_count: int, resident: int,
            max_chunk: int) -> tuple[int, int]:
    """(num_splits, chunk_len) of the v4 split-KV grid: chunk_len a multiple of 64, at most V4_MAX_SPLITS splits,
    every split non-empty ((splits - 1) * chunk_len < max_kv_len), no split longer than max_chunk (v4's page table)
    where any split count allows it. The cost of a plan is that of its busiest SM: ceil(CTAs / SMs) CTAs, each
    streaming chunk_len keys plus a fixed cost of V4_CTA_COST_KEYS, 25% more where they exceed the `resident` CTAs
    per SM (a second wave). Plans of more CTAs than SMs are preferred where there are any (one 4-warp CTA on an SM
    keeps too few bytes in flight); the cheapest wins, ties to fewer splits. Measured on an H100 (tools/dev/
    sweep_decode_plan.py): for few sequences the best grid is about two CTAs per SM (1 x 32k: 32 splits of 1024,
    not 64 of 512), and short contexts gain from chunks down to 64 keys (1 x 512: 8 splits, 13.1 -> 7.7 us)."""
    length = max(int(max_kv_len), 1)
    pairs = max(num_seqs * num_kv_heads, 1)
    sms = max(multiprocessor_count, 1)
    plans = {}
    for want in range(1, min(V4_MAX_SPLITS, -(-length // 64)) + 1):
        chunk = -(-(-(-length // want)) // 64) * 64
        splits = -(-length // chunk)
        if (splits, chunk) in plans:
            continue
        per_sm = -(-pairs * splits // sms)
        cost = per_sm * (chunk + V4_CTA_COST_KEYS) * (1.25 if per_sm > resident else 1.0)
        plans[splits, chunk] = (chunk > max_chunk, pairs * splits <= sms, cost, splits)
    fits = [k for k, v in plans.items() if not v[0]]
    if not fits:  # no split count keeps the pages within the table (the caller runs v2): the shortest splits
        return min(plans, key=lambda k: k[1])
    if any(not plans[k][1] for k in fits):
        fits = [k for k in fits if not plans[k][1]]
    return min(fits, key=lambda k: plans[k][2:])


@functools.lru_cache(maxsize=4096)
def plan_decode(variant: str | DecodeKernel, num_seqs: int, num_kv_heads: int, max_kv_len: int, block_size: int,
                head_dim: int, group: int, multiprocessor_count: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
                smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> tuple[DecodeKernel, int, int]:
    """(kernel, num_splits, chunk_len) for `variant` (a DECODE_KERNELS name or a DecodeKernel: a dev registry's) on
    this shape, with the fallbacks applied: v4 (and the dev v4 experiments) plan with v4_plan and run v2 where a
    split would overflow the shared page table; v4 itself runs
    its 8-warp CTAs (v4w8) where the planned grid is one wave of them (at most 2 per SM) and the group is at most 4
    (few sequences: each CTA's keys go out in half the stages; docs/kernels/history/attention.md, "Wide CTAs for short contexts"), a larger
    group split into query-head subgroups of at most 4 where that makes such a grid of short splits
    (DecodeKernel.subgroups; groups of 5, 6 and 8, MAX_SUBGROUPS, SUBGROUP_MAX_CHUNK); the dev v3 needs
    block_size % 16 == 0, else v2. smem_per_block / smem_per_sm: the device's shared memory (sm_90's by default;
    DeviceInfo): a kernel whose CTA asks more than smem_per_block is not planned (the production v4: its 8-warp CTAs
    are skipped, then v2 runs; a variant named outright raises ValueError), and the per-SM total sizes the resident
    CTAs. Every production kernel fits every arch from sm_80 on (v4w8, the largest, asks 70,160 bytes;
    tests/runtime/test_smem_limits.py). Head dim 256 runs v2 (any production variant) with D256_SUBGROUPS[group]
    query-head subgroups. Cached: an eager call pays the search once per shape (it took 100-200 us of host
    time at 1 x 32k-128k, more than the kernel)."""
    k = variant if isinstance(variant, DecodeKernel) else DECODE_KERNELS.get(variant)
    if k is None:
        raise ValueError(f"variant: unknown decode kernel {variant!r}; known: {', '.join(DECODE_KERNELS)}")
    variant = k.variant
    if head_dim in D256_HEAD_DIMS:  # v2's body for every variant that has it (attention_decode_d256.cu)
        if k.dev:
            raise ValueError(f"variant: {variant} has no head_dim {head_dim} kernels (the production v2 body only)")
        k = dataclasses.replace(DECODE_KERNELS["v2"], subgroups=D256_SUBGROUPS[group])
        splits, chunk = decode_plan(num_seqs, num_kv_heads * k.subgroups, max_kv_len, multiprocessor_count,
                                    k.resident(head_dim, group), min_chunk=D256_MIN_CHUNK)
        return k, splits, chunk
    if k.shapes is not None and (head_dim, group) not in k.shapes:
        raise ValueError(f"variant: {variant} is compiled for (head_dim, group) in {sorted(k.shapes)} only, "
                         f"not ({head_dim}, {group})")
    sms = multiprocessor_count
    if not k.fits(head_dim, smem_per_block) and variant != DEFAULT_DECODE:
        raise ValueError(f"variant: {variant} asks {k.smem(head_dim)} bytes of shared memory per CTA, the device "
                         f"allows {smem_per_block}")
    if k.generation == 4 and k.fits(head_dim, smem_per_block):
        max_chunk = (V4_TABLE_CAP - 1) * block_size // 64 * 64
        wide = DECODE_KERNELS.get(k.wide)
        if wide is not None and not wide.fits(head_dim, smem_per_block):
            wide = None  # the 8-warp CTAs do not fit this device: the 4-warp ones at every grid
        for r in _subgroup_counts(group, head_dim, wide):
            g, heads = group // r, num_kv_heads * r
            splits, chunk = v4_plan(num_seqs, heads, max_kv_len, sms, k.resident(head_dim, g, smem_per_sm),
                                    max_chunk)
            if -(-chunk // block_size) + 1 > V4_TABLE_CAP:  # the split's pages overflow the shared page table
                continue
            if (wide is not None and (head_dim, g) in wide.shapes
                    and num_seqs * heads * splits <= wide.resident(head_dim, g, smem_per_sm) * sms
                    and (r == 1 or chunk <= SUBGROUP_MAX_CHUNK)):
                # the same plan (for R x the kv heads), each CTA twice the warps: still one wave
                return (wide if r == 1 else dataclasses.replace(wide, subgroups=r)), splits, chunk
            if r == 1:
                return k, splits, chunk
        k = DECODE_KERNELS["v2"]
    elif k.generation == 3:
        if block_size % 16 == 0:
            splits, chunk = decode_plan(num_seqs, num_kv_heads, max_kv_len, sms,
                                        k.resident(head_dim, group, smem_per_sm), True)
            return k, splits, chunk
        k = DECODE_KERNELS["v2"]
    else:
        k = DECODE_KERNELS["v2"]  # the default v4 where its CTAs do not fit (no sm_80+ device: kept for safety)
    splits, chunk = decode_plan(num_seqs, num_kv_heads, max_kv_len, sms, k.resident(head_dim, group))
    return k, splits, chunk


def _subgroup_counts(group: int, head_dim: int, wide: DecodeKernel | None) -> list[int]:
    """The query-head subgroup counts plan_decode tries, in order: the fewest (<= MAX_SUBGROUPS) that bring a group
    within the wide kernels' shapes, then 1 (the whole group in one CTA)."""
    if wide is None or (head_dim, group) in wide.shapes:
        return [1]
    split = [r for r in range(2, MAX_SUBGROUPS + 1) if group % r == 0 and (head_dim, group // r) in wide.shapes]
    return split[:1] + [1]


def spread_smem(smem: int, ctas: int, multiprocessor_count: int, cta_smem_max: int = SM90_SMEM_PER_BLOCK_OPTIN,
                smem_per_sm: int | None = None) -> int:
    """Dynamic shared memory (>= smem) with which an SM holds at most ceil(ctas / SMs) CTAs of a grid: cta_smem_max
    per CTA at most (the device's opt-in limit: sm_90 227 KB, sm_80 163 KB, sm_86/89/120 99 KB), 1 KB reserved per
    CTA, smem_per_sm per SM (the device's; by default cta_smem_max + 1 KB, which it is on every arch from sm_80)."""
    cap = -(-max(ctas, 1) // max(multiprocessor_count, 1))
    per_sm = cta_smem_max + CTA_SMEM_RESERVED if smem_per_sm is None else smem_per_sm
    fits_one_more = per_sm // (cap + 1) - CTA_SMEM_RESERVED  # (cap + 1) CTAs of this much would fit
    return min(max(smem, -(-(fits_one_more + 1) // 16) * 16), max(smem, cta_smem_max))


def launch_smem(plan: tuple[DecodeKernel, int, int], head_dim: int, num_kv_heads: int, num_seqs: int, fused: bool,
                multiprocessor_count: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
                smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> int:
    """The dynamic shared memory _launch asks for a planned kernel: its own (DecodeKernel.smem), raised by
    spread_smem for the fused entry within the device's per-CTA limit."""
    k, splits, _ = plan
    smem = k.smem(head_dim)
    if fused:
        smem = spread_smem(smem, splits * num_kv_heads * k.subgroups * num_seqs, multiprocessor_count,
                           smem_per_block, smem_per_sm)
    return smem
