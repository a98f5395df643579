"""Single-token decode over the paged cache: split-KV ("flash-decoding") with GQA grouping, and the table of decode
kernels.

Which kernel runs: v4 (cuda_src/attention_decode.cu: v2's CUDA-core math behind a per-lane cp.async ring and a
shared page table, split combine folded in), or
v2 (attention_decode_v2.cu, plain loads and a separate combine kernel) where a split's pages would overflow v4's
shared page table (a block size below 8 with a very long context). The v4 plan (`v4_plan`) balances the keys per
SM rather than filling resident slots: few sequences get about two CTAs per SM, and there (where the group is at
most 4, or splits into subgroups of at most 4 query heads) v4 runs 8-warp CTAs (v4w8), twice the bytes in flight
per SM. DECODE_KERNELS lists these shipped kernels only; the development kernels (v3 on tensor cores, the v4
stage-count and 16-warp experiments) live in cuda_src/dev/ and are named by the dev registry tools/dev/kernels.py,
whose DecodeKernel the ops take as `variant`. Measurements: docs/kernels/attention.md.

An FP8 (float8_e4m3fn) cache runs the same plan and grid with the same kernels' e4m3 instantiations
(cuda_src/attention_decode_fp8.cu: attention_decode_fp8_v4_..., attention_decode_fp8_d{D}_g{G} for the v2
fallback; DecodeKernel.fp8_name), which take the layer's k_scale / v_scale after the bf16 kernels' arguments.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ...runtime import get_device, kernel
from ...runtime.compiler import piece
from ...runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR
from ...tensor import Tensor, bfloat16, float32, int32
from .._checks import check_aligned, check_tensor, output, same_device
from .._launch import check_alias, check_eps, pooled_buffer
from ._args import check_cache, check_tables, is_fp8, query_heads
from .reference import attention_decode_reference

# Mirrors of device constants (tests/ops/test_attention.py reads them back from the sources):
V4_TABLE_CAP = 512  # kV4TabCap (attention_decode.cu): page-table entries a v4 CTA keeps in shared memory
V4_RING_STAGE_BYTES = 16384  # 4 warps x 8 chunks x 32 lanes x 16 bytes: one stage of v4's ring
V4_MAX_SPLITS = 256  # kV4MaxSplits: the folded combine's shared scratch holds G * num_splits weights
V4_FAST_COMBINE = 16  # kV4FastCombine: up to this many splits the combine takes one round trip (the LEAN kernels' limit)
V4_ROW_BYTES = 2560  # kV4RowBytes: v4's shared rows of the fused entry (G <= 8 query rows + the new K and V, bf16)
V4_CTA_COST_KEYS = 64  # a v4 CTA's fixed cost (prologue, merge, partials, combine) in keys streamed (H100 sweep)
V2_CTAS_PER_SM = 4  # v2's split-KV grid aims at this many CTAs per SM
# Shared memory: the planning functions take the device's per-CTA opt-in limit and per-SM total as arguments
# (DeviceInfo; sm_90's 227 KB / 228 KB by default). A kernel that asks more than the per-CTA limit is not planned
# (v4w8 -> v4 -> v2 for the production v4; a dev variant named outright raises); the per-SM total sizes the resident
# CTA counts (DecodeKernel.resident). docs/kernels/portability.md, "Shared memory per arch".
# The fused entry (attention_decode_rope), launched right behind the qkv GEMV: with programmatic dependent launch
# its CTAs start, and do their pre-wait work, while the GEMV still runs; the SMs free up one by one, and the block
# scheduler would stack the early CTAs 2-4 deep on the first free SMs (the GEMV holds nearly all registers of an
# SM), unbalancing a plan that spreads the keys over the SMs. So each CTA asks for enough dynamic shared memory that
# an SM holds at most ceil(CTAs / SMs) of them (spread_smem). Both measured in docs/kernels/attention.md ("QK-norm +
# RoPE + KV write folded into decode v4").
# Query-head subgroups: a group of more than 4 query heads per kv head (Qwen3-14B: 40/8, 32B: 64/8) does not fit the
# 8-warp CTAs' registers, so in the grids where those run (few sequences) the plan may split it into R subgroups of
# at most 4 heads, R CTAs that read the same K/V (DecodeKernel.subgroups). Each subgroup loads and converts every key
# again (from L2), so this pays only where a CTA's keys are few and its latency dominates: splits of at most
# SUBGROUP_MAX_CHUNK keys. At most MAX_SUBGROUPS (groups of 5, 6 and 8; 7 stays whole): the _w8_r{R} kernels.
# Measured on an H200 (docs/kernels/attention.md, "Query-head subgroups"): G = 8, 1 x 512 9.3 -> 6.4 us, 1 x 8192
# 22.8 -> 20.7 us; 1 x 32768 (2048-key splits) 59.3 -> 62.9 us, a loss; G = 5, 1 x 512 7.5 -> 5.3 us.
MAX_SUBGROUPS = 5
SUBGROUP_MAX_CHUNK = 512


def v4_min_blocks(group: int) -> int:
    """XSERV_V4_MINB(G) of attention_decode.cu: the CTAs per SM v4's __launch_bounds__ asks for."""
    return 4 if group <= 4 else 2


@dataclass(frozen=True)
class DecodeKernel:
    """A decode kernel family member: generation 2 or 4 (3: the dev registry's tensor-core kernels, which plan as v4
    does but need block_size % 16 == 0), ring stages, name suffix, the (head_dim, group) shapes it is compiled for
    (None: every supported one), whether it takes v4's fused-entry arguments, its warps per CTA (8 for v4w8), and
    `wide`: the variant the plan runs instead where its grid is one wave of that variant's CTAs (v4 -> v4w8), and
    `subgroups` (set by the plan, not in DECODE_KERNELS): R CTAs per (sequence, kv head, split), each over group / R
    of the kv head's query heads. `lean`: the (head_dim, query heads per CTA, subgroups) shapes that also have a
    _lean entry (LEAN in attention_decode.cu: the fused entry only, at most V4_FAST_COMBINE splits), which the fused
    op launches where it can (lean_entry)."""

    variant: str
    generation: int
    family: str
    stages: int = 2
    suffix: str = ""
    shapes: frozenset | None = None
    fused_args: bool = True
    warps: int = 4
    wide: str | None = None
    subgroups: int = 1
    lean: frozenset = frozenset()

    @property
    def dev(self) -> bool:
        return self.family.startswith("dev/")

    def name(self, head_dim: int, group: int) -> str:
        """The kernel for `group` query heads per kv head (each CTA runs group / subgroups of them: _r{R})."""
        if self.generation == 2:
            return f"attention_decode_d{head_dim}_g{group}"
        sub = f"_r{self.subgroups}" if self.subgroups > 1 else ""
        return (f"attention_decode_v{self.generation}_d{head_dim}_g{group // self.subgroups}_s{self.stages}"
                f"{self.suffix}{sub}")

    @property
    def has_fp8(self) -> bool:
        """Does attention_decode_fp8.cu instantiate this kernel for an e4m3 cache (the production v4 and v2 bodies)?"""
        return self.family in _FP8_BODIES

    def fp8_name(self, head_dim: int, group: int) -> str:
        """The e4m3 cache's instantiation of name(head_dim, group) (attention_decode_fp8.cu)."""
        return "attention_decode_fp8_" + self.name(head_dim, group)[len("attention_decode_"):]

    def has_lean(self, head_dim: int, group: int) -> bool:
        """Is name(head_dim, group) + "_lean" compiled (its query heads per CTA and subgroups in `lean`)?"""
        return group % self.subgroups == 0 and (head_dim, group // self.subgroups, self.subgroups) in self.lean

    def smem(self, head_dim: int) -> int:
        """Dynamic shared memory: v4's ring + page table + a flag + the fused entry's rows; v2 none."""
        if self.generation == 4:  # a ring stage per warp: V4_RING_STAGE_BYTES is 4 warps' stage
            return self.stages * V4_RING_STAGE_BYTES * self.warps // 4 + V4_TABLE_CAP * 4 + 16 + V4_ROW_BYTES
        return 0

    def fits(self, head_dim: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN) -> bool:
        """Does a CTA's dynamic shared memory fit a device that allows smem_per_block per CTA?"""
        return self.smem(head_dim) <= smem_per_block

    def resident(self, head_dim: int, group: int, smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> int:
        """CTAs resident per SM (sizes the split-KV grid): launch bounds and shared memory (an SM's smem_per_sm,
        each CTA's dynamic shared memory + the 1 KB reserved per CTA; at least 1)."""
        by_smem = max(1, smem_per_sm // (self.smem(head_dim) + CTA_SMEM_RESERVED))
        if self.generation == 4:  # launch bounds: the 4-warp CTAs' count scaled by 4 / warps (16 / W for G <= 4)
            bound = v4_min_blocks(group) * 4 // self.warps
            return min(bound, by_smem)
        return V2_CTAS_PER_SM


_WIDE_SHAPES = frozenset((d, g) for d in (64, 128) for g in (1, 2, 3, 4))  # 8 warps: 16 / 8 CTAs per SM for G <= 4
# The 8-warp kernel's _lean entries (Qwen3's head_dim) as (head_dim, query heads per CTA, subgroups): groups 1-4
# whole, and the subgroup kernels of groups 5 (5 x 1), 6 (2 x 3) and 8 (2 x 4: Qwen3-32B, and the 30B-A3B's 32/4).
_LEAN_SHAPES = frozenset({(128, g, 1) for g in (1, 2, 3, 4)} | {(128, 1, 5), (128, 3, 2), (128, 4, 2)})
# The fused op launches a kernel's _lean entry where it has one and the plan allows it (lean_entry; the full entry
# gives the same bits).
DECODE_KERNELS = {k.variant: k for k in (
    DecodeKernel("v4", 4, "attention_decode", wide="v4w8"),
    DecodeKernel("v4w4", 4, "attention_decode"),  # v4 with 4-warp CTAs at every grid (for A/B runs)
    DecodeKernel("v4w8", 4, "attention_decode", suffix="_w8", shapes=_WIDE_SHAPES, warps=8, lean=_LEAN_SHAPES),
    DecodeKernel("v2", 2, "attention_decode_v2"),
)}
DEFAULT_DECODE = "v4"
# On an FP8 (e4m3) cache, the 4-warp v4 kernel's scores and values on tensor cores (attention_decode_fp8.cu's _mma
# entries: head_dim 128, groups of at most 8). The CUDA-core loop read K/V at ~55% of copy bandwidth at large batches;
# this form took the 8B-FP8 + FP8-KV offline workload from 9,573 to 10,593 output tok/s on an H100
# (docs/kernels/attention.md, "FP8 KV cache on tensor cores"). The other FP8 kernels keep the CUDA-core loop.
# The families whose bodies attention_decode_fp8.cu instantiates for an e4m3 cache (KvChunksE4m3), and that piece's
# family: every production kernel (v4, v4w4, v4w8 and its subgroups and lean entries; v2), none of the dev ones.
_FP8_BODIES = frozenset({"attention_decode", "attention_decode_v2"})
FP8_FAMILY = "attention_decode_fp8"

_workspaces: list[Tensor] = []  # kept for the life of the process: CUDA graphs may have captured their addresses
_counters: list[Tensor] = []  # per-(sequence, kv head) split counters: zeroed once, reset by the kernels themselves


def fast_div(d: int) -> tuple[int, int]:
    """(magic, shift) with n // d == (umulhi(n, magic) + n) >> shift for 0 <= n < 2**31 (fast_div in the kernel)."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def decode_plan(num_seqs: int, num_kv_heads: int, max_kv_len: int, multiprocessor_count: int,
                ctas_per_sm: int = V2_CTAS_PER_SM, balance: bool = False,
                max_chunk: int | None = None) -> tuple[int, int]:
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
    (few sequences: each CTA's keys go out in half the stages; docs/kernels/attention.md, "Wide CTAs"), a larger
    group split into query-head subgroups of at most 4 where that makes such a grid of short splits
    (DecodeKernel.subgroups; groups of 5, 6 and 8, MAX_SUBGROUPS, SUBGROUP_MAX_CHUNK); the dev v3 needs
    block_size % 16 == 0, else v2. smem_per_block / smem_per_sm: the device's shared memory (sm_90's by default;
    DeviceInfo): a kernel whose CTA asks more than smem_per_block is not planned (the production v4: its 8-warp CTAs
    are skipped, then v2 runs; a variant named outright raises ValueError), and the per-SM total sizes the resident
    CTAs. Every production kernel fits every arch from sm_80 on (v4w8, the largest, asks 70,160 bytes;
    tests/runtime/test_smem_limits.py). Cached: an eager call pays the search once per shape (it took 100-200 us of host
    time at 1 x 32k-128k, more than the kernel)."""
    k = variant if isinstance(variant, DecodeKernel) else DECODE_KERNELS.get(variant)
    if k is None:
        raise ValueError(f"variant: unknown decode kernel {variant!r}; known: {', '.join(DECODE_KERNELS)}")
    variant = k.variant
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


def spread_smem(smem: int, ctas: int, multiprocessor_count: int, cta_smem_max: int = SM90_SMEM_PER_BLOCK_OPTIN,
                smem_per_sm: int | None = None) -> int:
    """Dynamic shared memory (>= smem) with which an SM holds at most ceil(ctas / SMs) CTAs of a grid: cta_smem_max
    per CTA at most (the device's opt-in limit: sm_90 227 KB, sm_80 163 KB, sm_86/89/120 99 KB), 1 KB reserved per
    CTA, smem_per_sm per SM (the device's; by default cta_smem_max + 1 KB, which it is on every arch from sm_80)."""
    cap = -(-max(ctas, 1) // max(multiprocessor_count, 1))
    per_sm = cta_smem_max + CTA_SMEM_RESERVED if smem_per_sm is None else smem_per_sm
    fits_one_more = per_sm // (cap + 1) - CTA_SMEM_RESERVED  # (cap + 1) CTAs of this much would fit
    return min(max(smem, -(-(fits_one_more + 1) // 16) * 16), max(smem, cta_smem_max))


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
    family = _module(k.family if scales is None else FP8_FAMILY, head_dim, group)
    # v4 waits for the previous kernel itself (pdl_wait): it may be launched with programmatic dependent launch
    kernel(family, name)(grid, (32 * k.warps, 1, 1), *args, smem=smem, pdl=pdl)
    if k.generation == 2 and splits > 1:
        kernel(_module("attention_decode_v2", head_dim, group), "attention_decode_combine")(  # both formats
            (num_q_heads, num_seqs, 1), (head_dim, 1, 1), part_o, part_lse, kv_lens, np.int32(chunk),
            np.int32(splits), np.int32(head_dim), out)


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


@functools.lru_cache(maxsize=None)
def _module(family: str, head_dim: int, group: int) -> str:
    """What the kernels of `family` for this shape load from: attention_decode and attention_decode_v2 are compiled
    per (head dim, query heads per kv head) as the pieces "attention_decode:d128_g4" (runtime/compiler.py; a start-up
    compiles the model's, another shape compiles on first use), attention_decode_fp8 likewise (kvfp8=1: an FP8-cache
    model's start-up compiles it); the dev family whole."""
    return piece(family, head_dim=head_dim, group=group, kvfp8=1)


@functools.lru_cache(maxsize=None)
def _mma_form(k: DecodeKernel) -> DecodeKernel:
    """k's FP8 tensor-core form (the _mma entries; made once per kernel, not per launch)."""
    return replace(k, suffix="_mma")


def has_fp8_mma(k: DecodeKernel, head_dim: int, group: int) -> bool:
    """Does k have an FP8-cache tensor-core form for this shape (attention_decode_fp8.cu's _mma entries, which an FP8
    launch takes): the 4-warp v4 kernel on whole groups of at most 8, head_dim 128."""
    return k.variant in ("v4", "v4w4") and k.subgroups == 1 and head_dim == 128 and group <= 8


def lean_entry(k: DecodeKernel, head_dim: int, group: int, splits: int) -> bool:
    """Does the fused op launch k's _lean entry for this plan (k has one for the shape and its query-head subgroups,
    at most V4_FAST_COMBINE splits)?"""
    return k.has_lean(head_dim, group) and splits <= V4_FAST_COMBINE


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
    and the FP8 v2 kernel.
    """
    _, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    rope = _rope()
    rope.check_packed_qkv(qkv, positions, cos_sin, num_q_heads, num_kv_heads)
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
