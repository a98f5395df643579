"""The table of the shipped decode kernels (DecodeKernel, DECODE_KERNELS) and the device constants the launchers
mirror. The plan (which kernel, how many splits) is decode_plan.py's; the launch and the ops are decode.py's.

Head dim 256 (Qwen3.5's gated attention) runs v2's body from its own family (cuda_src/attention_decode_d256.cu,
D256_FAMILY), a group of 16 as D256_SUBGROUPS[16] = 2 subgroups of 8 query heads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ...runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR

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
# an SM holds at most ceil(CTAs / SMs) of them (spread_smem). Both measured in docs/kernels/history/attention.md ("QK-norm +
# RoPE + KV write folded into decode v4").
# Query-head subgroups: a group of more than 4 query heads per kv head (Qwen3-14B: 40/8, 32B: 64/8) does not fit the
# 8-warp CTAs' registers, so in the grids where those run (few sequences) the plan may split it into R subgroups of
# at most 4 heads, R CTAs that read the same K/V (DecodeKernel.subgroups). Each subgroup loads and converts every key
# again (from L2), so this pays only where a CTA's keys are few and its latency dominates: splits of at most
# SUBGROUP_MAX_CHUNK keys. At most MAX_SUBGROUPS (groups of 5, 6 and 8; 7 stays whole): the _w8_r{R} kernels.
# Measured on an H200 (docs/kernels/history/attention.md, "Query-head subgroups for groups of 5, 6 and 8"): G = 8, 1 x 512 9.3 -> 6.4 us, 1 x 8192
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
    DecodeKernel("v4w8", 4, "attention_decode", suffix="_w8", shapes=_WIDE_SHAPES, warps=8, lean=_LEAN_SHAPES),
    DecodeKernel("v2", 2, "attention_decode_v2"),
)}
DEFAULT_DECODE = "v4"
# On an FP8 (e4m3) cache, the 4-warp v4 kernel's scores and values on tensor cores (attention_decode_fp8.cu's _mma
# entries: head_dim 128, groups of at most 8). The CUDA-core loop read K/V at ~55% of copy bandwidth at large batches;
# this form took the 8B-FP8 + FP8-KV offline workload from 9,573 to 10,593 output tok/s on an H100
# (docs/kernels/history/attention.md, "FP8 KV cache on tensor cores"). The other FP8 kernels keep the CUDA-core loop.
# The families whose bodies attention_decode_fp8.cu instantiates for an e4m3 cache (KvChunksE4m3), and that piece's
# family: every production kernel (v4, v4w8 and its subgroups and lean entries; v2), none of the dev ones.
_FP8_BODIES = frozenset({"attention_decode", "attention_decode_v2"})
FP8_FAMILY = "attention_decode_fp8"


# Head dim 256: the family of its kernels (both cache formats; kvfp8 0 / 1 pieces), and the query-head subgroups of
# the groups whose query and accumulator registers would not fit one CTA (attention_decode_d256.cu's entries).
D256_FAMILY = "attention_decode_d256"
D256_HEAD_DIMS = (256,)
D256_SUBGROUPS = {4: 1, 6: 1, 8: 1, 16: 2}
# Its splits may be as short as 64 keys (v2's 256 at d64 / d128): a key is 1 KB of K and V here, and a warp streams
# one key a step (32 lanes a row), 4 in flight, so a 256-key split is 16 dependent load rounds per warp; at batch 1
# the shorter splits put more CTAs on the SMs.
D256_MIN_CHUNK = 64


@functools.lru_cache(maxsize=None)
def _mma_form(k: DecodeKernel) -> DecodeKernel:
    """k's FP8 tensor-core form (the _mma entries; made once per kernel, not per launch)."""
    return replace(k, suffix="_mma")


def has_fp8_mma(k: DecodeKernel, head_dim: int, group: int) -> bool:
    """Does k have an FP8-cache tensor-core form for this shape (attention_decode_fp8.cu's _mma entries, which an FP8
    launch takes): the 4-warp v4 kernel (v4 where its plan keeps 4 warps, and the dev registry's v4w4) on whole groups
    of at most 8, head_dim 128."""
    return (k.family == "attention_decode" and k.warps == 4 and not k.suffix and k.stages == 2
            and k.subgroups == 1 and head_dim == 128 and group <= 8)


def lean_entry(k: DecodeKernel, head_dim: int, group: int, splits: int) -> bool:
    """Does the fused op launch k's _lean entry for this plan (k has one for the shape and its query-head subgroups,
    at most V4_FAST_COMBINE splits)?"""
    return k.has_lean(head_dim, group) and splits <= V4_FAST_COMBINE
