"""Causal prefill of packed variable-length query chunks against the paged cache, and the table of prefill kernels.

Which kernel runs: v5 (wgmma + a TMA producer warp) on sm_90a, v4 (wgmma, cp.async where the TMA cannot copy) on
sm_90a when the cache's block size rules out v5's TMA copies, v3 (mma.sync) on any other architecture. `simple`
(one warp per query row) is an independent GPU cross-check. PREFILL_KERNELS lists these shipped kernels only; the
development kernels (v2 "fa2", the v3/v4/v5 tuning points that lost) live in cuda_src/dev/ and are named by the dev
registry tools/dev/kernels.py, whose PrefillKernel the op takes as `variant`. Measurements: docs/kernels/attention.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...runtime import get_device, get_runtime, kernel
from ...runtime.arch import KernelPath, arch_path, default_variant
from ...runtime.compiler import piece
from ...runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR
from ...runtime.tma import kv_cache_tensor_map
from ...tensor import Tensor, bfloat16, int32
from .._checks import check_tensor, output, same_device
from ._args import HEAD_DIMS, check_cache, check_tables, is_fp8, query_heads
from .fp8_kv import dequantize_kv_blocks, prefill_scratch
from .reference import attention_prefill_reference

_TILE_ALIGN = 1024  # sm_90a kernels align their tiles to 1 KB (the 128-byte swizzle works on address bits)
_MBARRIER = 8  # bytes


@dataclass(frozen=True)
class PrefillKernel:
    """One compiled prefill kernel: its name, where it lives and how it is launched.

    rows: query rows per CTA; keys: keys per K/V tile; smem: dynamic shared memory bytes (the kernel traps when
    given less than its layout needs); tma: "none", "optional" (v4: K/V tensor maps, or null for cp.async only)
    or "required" (v5); q_tiles_first: grid (q tiles, Hq, B) instead of (Hq, B, q tiles)."""

    variant: str
    head_dim: int
    family: str
    name: str
    rows: int
    threads: int
    smem: int
    keys: int = 64
    tma: str = "none"
    q_tiles_first: bool = False
    causal_only: bool = False

    @property
    def dev(self) -> bool:
        return self.family.startswith("dev/")

    def tma_rows(self, block_size: int) -> int | None:
        """Keys per TMA copy for this cache block size, or None where the TMA cannot copy (a block size that is not
        a multiple of 8, or that neither divides the key tile nor is a multiple of it)."""
        if self.tma == "none" or block_size % 8 or (self.keys % block_size and block_size % self.keys):
            return None
        return min(block_size, self.keys)

    def grid(self, num_q_heads: int, num_seqs: int, max_q_len: int) -> tuple[int, int, int]:
        q_tiles = -(-max_q_len // self.rows)
        return (q_tiles, num_q_heads, num_seqs) if self.q_tiles_first else (num_q_heads, num_seqs, q_tiles)


def _family(d):
    """Where the portable kernels of head_dim d live: head_dim 256 (Qwen3.5) in its own family, compiled per shape
    (attention_prefill_d256.cu), so that models of other head dims never compile it."""
    return "attention_prefill_d256" if d == 256 else "attention_prefill"


def _simple(d):
    return PrefillKernel("simple", d, _family(d), f"attention_prefill_simple_d{d}", rows=4, threads=128,
                         smem=0, q_tiles_first=True, causal_only=True)


# The constructors below give a kernel's launch shape from its template parameters (the layouts of
# attention_prefill*.cu); the dev registry builds the dev/ tuning points with them and then renames the variant and
# family, so that a layout is described once.
def _v3(d, tag, variant="v3"):
    """tag "m{m-tiles per warp}w{warps}[q]_b{ldmatrix ring}[_k32]" (q: Q fragments kept in registers)."""
    mt, warps, keys = int(tag[1]), int(tag[3]), 32 if tag.endswith("_k32") else 64
    rows = 16 * mt * warps
    return PrefillKernel(variant, d, _family(d), f"attention_prefill_v3_d{d}_{tag}", rows=rows,
                         threads=32 * warps, smem=(rows + 4 * keys) * d * 2, keys=keys)


def _v4(d, warpgroups, keys):
    rows = 64 * warpgroups
    return PrefillKernel("v4", d, "attention_prefill_sm90", f"attention_prefill_v4_d{d}_w{warpgroups}_k{keys}",
                         rows=rows, threads=128 * warpgroups,
                         smem=(rows + 4 * keys) * d * 2 + _TILE_ALIGN + 4 * _MBARRIER, keys=keys, tma="optional")


def _v5(d, warpgroups, keys, stages):
    rows = 64 * warpgroups
    return PrefillKernel("v5", d, "attention_prefill_sm90",
                         f"attention_prefill_v5_d{d}_w{warpgroups}_k{keys}_s{stages}", rows=rows,
                         threads=128 * warpgroups + 128,
                         smem=(rows + 2 * stages * keys) * d * 2 + _TILE_ALIGN + 3 * stages * _MBARRIER, keys=keys,
                         tma="required")


def _table(kernels) -> dict[str, dict[int, PrefillKernel]]:
    table: dict[str, dict[int, PrefillKernel]] = {}
    for k in kernels:
        table.setdefault(k.variant, {})[k.head_dim] = k
    return table


# variant -> head_dim -> kernel: the shipped kernels (cuda_src/attention_prefill*.cu).
PREFILL_KERNELS = _table([
    _simple(64), _simple(128), _simple(256),
    _v3(128, "m2w8_b3"), _v3(64, "m1w8q_b3"),
    _v3(256, "m1w4_b3_k32"),  # Qwen3.5's gated attention, every arch (96 KB: fits sm_86 / sm_89 / sm_120; _family)
    _v3(128, "m2w8_b3_k32", variant="v3_m2w8_b3_k32"),  # d128 where m2w8_b3 does not fit (99 KB arches)
    _v4(128, 2, 128), _v4(64, 3, 128),
    _v5(128, 2, 128, 3), _v5(64, 2, 128, 3),
])


def prefill_variants(head_dim: int) -> list[str]:
    """The variant names compiled for head_dim."""
    return [v for v, by_dim in PREFILL_KERNELS.items() if head_dim in by_dim]


def default_prefill_variant(head_dim: int | None = None) -> str:
    """The device's kernel path's variant (runtime/arch.py KERNEL_PATHS): v5 on the hopper path (v4 where the block size
    rules out the TMA; see select_prefill_kernel), v3 on the portable one; v3 on every path for a head_dim the path's
    variant has no kernel for (256: the wgmma kernels are sized for head dims up to 128)."""
    variant = default_variant("attention_prefill", get_device().arch)
    if head_dim is not None and head_dim not in PREFILL_KERNELS.get(variant, {}):
        return "v3"
    return variant


# The shipped v3 kernels by their measured speed (H200, d128 causal: m2w8_b3 229 TFLOP/s, m2w8_b3_k32 201;
# docs/kernels/history/attention.md, "v3 prefill"): fit_v3 prefers the faster one among those that keep as many warps
# resident per SM where the shipped v3 does not fit a device's shared memory (d128 m2w8_b3 asks 131,072 bytes;
# sm_86 / sm_89 / sm_120 allow 101,376 per CTA).
V3_BY_SPEED = {128: ("v3", "v3_m2w8_b3_k32"), 64: ("v3",)}


def v3_warps_per_sm(k: PrefillKernel, smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> int:
    """Warps of a v3 kernel resident per SM: its launch bounds (256 threads per SM: 2 CTAs of 4 warps or 1 of 8)
    and an SM's shared memory (each CTA's + the 1 KB reserved)."""
    warps = k.threads // 32
    return warps * min(256 // k.threads, smem_per_sm // (k.smem + CTA_SMEM_RESERVED))


def fit_v3(head_dim: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
           smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> PrefillKernel:
    """The v3 kernel the portable path runs for head_dim on a device with these shared memory limits: the shipped
    one where its CTA fits smem_per_block (every arch for d64; sm_80, sm_90, sm_100 for d128), else the shipped tuning
    point (attention_prefill.cu; never a dev/ one: those are not in the wheel) that fits and keeps the most warps
    resident per SM, the faster one (V3_BY_SPEED) among equals: d128 on sm_86 / sm_89 / sm_120 -> m2w8_b3_k32
    (98,304 bytes, 8 warps). Raises ValueError where none fits."""
    shipped = PREFILL_KERNELS["v3"][head_dim]
    if shipped.smem <= smem_per_block:
        return shipped
    order = V3_BY_SPEED.get(head_dim, ("v3",))
    fits = [PREFILL_KERNELS[v][head_dim] for v in order
            if head_dim in PREFILL_KERNELS.get(v, {}) and PREFILL_KERNELS[v][head_dim].smem <= smem_per_block]
    if not fits:
        raise ValueError(f"attention_prefill: no v3 kernel for head_dim {head_dim} fits {smem_per_block} bytes of "
                         f"shared memory per CTA")
    return max(fits, key=lambda k: (v3_warps_per_sm(k, smem_per_sm), -order.index(k.variant)))


def select_prefill_kernel(variant: str | PrefillKernel, head_dim: int, block_size: int, use_tma: bool = True,
                          smem_per_block: int | None = None, smem_per_sm: int | None = None) -> PrefillKernel:
    """The kernel that runs `variant` (a PREFILL_KERNELS name, or a PrefillKernel: a dev registry's) for this
    head_dim and block size: v5 needs the TMA, so without it (the block size, or use_tma=False in tests) its place
    is taken by v4; v3 where its CTA does not fit the device's shared memory (smem_per_block / smem_per_sm, by
    default the device's) by fit_v3's choice. Another variant asking more than smem_per_block raises ValueError
    (the runtime would at launch)."""
    if isinstance(variant, PrefillKernel):
        if variant.head_dim != head_dim:
            raise ValueError(f"variant: {variant.name} is for head_dim {variant.head_dim}, not {head_dim}")
        k = variant
    else:
        by_dim = PREFILL_KERNELS.get(variant)
        if by_dim is None or head_dim not in by_dim:
            raise ValueError(f"variant: no prefill kernel {variant!r} for head_dim {head_dim}; "
                             f"known: {', '.join(prefill_variants(head_dim))}")
        k = by_dim[head_dim]
    if k.tma == "required" and (not use_tma or k.tma_rows(block_size) is None):
        k = PREFILL_KERNELS["v4"][head_dim]
    if k.tma != "none" and arch_path(get_device().arch) is not KernelPath.HOPPER:
        raise ValueError(f"variant: {variant} prefill needs sm_90a (wgmma), the device's kernels are for "
                         f"{get_device().arch}")
    if smem_per_block is None or smem_per_sm is None:
        # the device's limits (a stand-in device without a DeviceInfo, as some CPU tests use: sm_90's)
        info = getattr(get_device(), "info", None)
        block = getattr(info, "max_shared_memory_per_block_optin", SM90_SMEM_PER_BLOCK_OPTIN)
        sm = getattr(info, "max_shared_memory_per_multiprocessor", SM90_SMEM_PER_MULTIPROCESSOR)
        smem_per_block = block if smem_per_block is None else smem_per_block
        smem_per_sm = sm if smem_per_sm is None else smem_per_sm
    if k.variant == "v3":
        return fit_v3(head_dim, smem_per_block, smem_per_sm)
    if k.smem > smem_per_block:
        raise ValueError(f"variant: the {variant} prefill kernel for head_dim {head_dim} asks {k.smem} bytes of "
                         f"shared memory per CTA, the device allows {smem_per_block}")
    return k


def attention_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, kv_lens: Tensor,
                      block_tables: Tensor, scale: float, max_q_len: int, out: Tensor | None = None,
                      num_q_heads: int | None = None, causal: bool = True,
                      variant: str | PrefillKernel | None = None,
                      use_tma: bool = True, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                      kv_scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal attention of packed query chunks against the paged cache (which already holds their K/V).
    q [T, Hq, D] (or packed qkv with num_q_heads; head_dim 256: also the gated qkvg [T, 2 Hq + 2 Hkv, D]), cu_seqlens_q int32 [B+1], kv_lens int32 [B] (>= q_len),
    block_tables int32 [B, max_blocks]; max_q_len >= every q_len (sizes the grid) -> out bf16 [T, Hq, D].
    causal=False (every query sees all kv_len keys) exists for benchmarks against non-causal peers.
    variant: a PREFILL_KERNELS name (default: default_prefill_variant()) or a PrefillKernel (a development kernel of
    tools/dev/kernels.py); use_tma=False keeps v4/v5 off the TMA (cp.async copies only), for tests of that path.
    FP8 cache (float8_e4m3fn, with this layer's k_scale / v_scale): on CUDA the blocks the batch reads are first
    dequantized into kv_scratch (bf16 (K, V) of the cache's shape, same block indices: KVCache.prefill_scratch; None:
    a pooled one), which the bf16 kernels then read through the batch's own block tables (fp8_kv.py,
    dequantize_kv_blocks); on the CPU the reference dequantizes as it gathers."""
    _, block_size, num_kv_heads, head_dim = check_cache(k_cache, v_cache, k_scale, v_scale)
    num_q_heads = query_heads(q, num_q_heads, num_kv_heads, head_dim)
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=int32, ndim=1)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens_q: needs at least one entry")
    check_tables(kv_lens, block_tables, num_seqs)
    max_q_len = int(max_q_len)
    if max_q_len < 0:
        raise ValueError(f"max_q_len: {max_q_len} < 0")
    device = same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, kv_lens=kv_lens,
                         block_tables=block_tables, out=out)
    num_tokens = q.shape[0]
    out = output("out", out, (num_tokens, num_q_heads, head_dim), bfloat16, device)
    if device == "cpu":
        if num_tokens and num_seqs and max_q_len:
            out.array[...] = attention_prefill_reference(
                q.array, k_cache.array, v_cache.array, cu_seqlens_q.array, kv_lens.array, block_tables.array, scale,
                num_q_heads, causal=causal, k_scale=None if k_scale is None else k_scale.array,
                v_scale=None if v_scale is None else v_scale.array).astype(bfloat16)
        return out
    k = select_prefill_kernel(variant or default_prefill_variant(head_dim), head_dim, block_size, use_tma)
    if k.causal_only and not causal:
        raise ValueError(f"variant: the {k.variant} prefill kernel is causal only")
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    if is_fp8(k_cache):
        k_bf16, v_bf16 = prefill_scratch(k_cache, kv_scratch)
        dequantize_kv_blocks(k_cache, v_cache, k_scale, v_scale, kv_lens, block_tables, k_bf16, v_bf16)
        k_cache, v_cache = k_bf16, v_bf16
    args = [q, np.int64(q.shape[1] * head_dim), k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables,
            np.int32(block_tables.shape[1]), np.int32(block_size), np.int32(num_q_heads), np.int32(num_kv_heads),
            np.float32(scale * math.log2(math.e)), out, np.int32(bool(causal))]
    if k.tma != "none":
        rows = k.tma_rows(block_size) if use_tma else None
        runtime = get_runtime()
        args += [0, 0] if rows is None else [kv_cache_tensor_map(runtime, c.ptr, c.shape, rows)
                                             for c in (k_cache, v_cache)]
    kernel(piece(k.family, head_dim=head_dim), k.name)(k.grid(num_q_heads, num_seqs, max_q_len), (k.threads, 1, 1),
                                                      *args, smem=k.smem)
    return out
