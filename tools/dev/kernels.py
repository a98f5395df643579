"""The development kernels of the attention ops: what cuda_src/dev/ instantiates and how each is launched.

xserv's own tables (xserv.ops.attention.prefill.PREFILL_KERNELS, decode.DECODE_KERNELS) list the kernels that ship;
the variants here are the ones that lost or that measure something (llm.c keeps its `dev/cuda/` apart from the
library the same way). Each is a PrefillKernel / DecodeKernel that the ops take as `variant`, so a dev kernel runs
through the production launcher, its checks and its plan. The kernel harness (`--variant`), its attention spec,
tools/bench_attention.py, tools/dev/sweep_decode_plan.py and the tests marked `dev` look names up here:

    from tools.dev import kernels
    attention_prefill(..., variant=kernels.prefill("v4_w2_k64", head_dim=128))
    attention_decode(..., variant=kernels.decode("v3s3"))

A name of a shipped kernel resolves to the production table's entry, so one lookup serves both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from xserv.ops.attention import decode as D
from xserv.ops.attention import prefill as P
from xserv.ops.attention._args import HEAD_DIMS
from xserv.ops.attention.decode import DecodeKernel
from xserv.ops.attention.prefill import PrefillKernel

PREFILL_FAMILY = "dev/attention_prefill_dev"  # includes attention_prefill.cu: fa2 and the v3 tuning points
PREFILL_SM90_FAMILY = "dev/attention_prefill_sm90_dev"  # includes attention_prefill_sm90.cu: v4 / v5 tuning points
DECODE_FAMILY = "dev/attention_decode_dev"  # includes attention_decode.cu: v3 and the v4 experiments


def _fa2(d: int, warps: int) -> PrefillKernel:
    """v2 "fa2" (FlashAttention-2 on mma.sync, the baseline v3 was tuned from): 16 rows per warp, 64-key tiles."""
    rows = 16 * warps
    return PrefillKernel(f"fa2_w{warps}", d, PREFILL_FAMILY, f"attention_prefill_fa2_d{d}_w{warps}", rows=rows,
                         threads=32 * warps, smem=(rows + 4 * 64) * d * 2, q_tiles_first=True)


# The tuning points take the shipped templates' layouts (prefill._v3 / _v4 / _v5) under a dev name and family.
def _v3(d: int, tag: str) -> PrefillKernel:
    return replace(P._v3(d, tag, variant="v3_" + tag), family=PREFILL_FAMILY)


def _v4(d: int, warpgroups: int, keys: int) -> PrefillKernel:
    return replace(P._v4(d, warpgroups, keys), variant=f"v4_w{warpgroups}_k{keys}", family=PREFILL_SM90_FAMILY)


def _v5(d: int, warpgroups: int, keys: int, stages: int) -> PrefillKernel:
    return replace(P._v5(d, warpgroups, keys, stages), variant=f"v5_w{warpgroups}_k{keys}_s{stages}",
                   family=PREFILL_SM90_FAMILY)


# variant -> head_dim -> kernel, as prefill.PREFILL_KERNELS (docs/kernels/history/attention.md, "v2 prefill" to
# "v5 prefill")
DEV_PREFILL: dict[str, dict[int, PrefillKernel]] = P._table([
    *(_fa2(d, w) for d in HEAD_DIMS for w in (4, 8)),
    *(_v3(128, t) for t in ("m2w4_b2", "m2w4_b3", "m2w4_b3_k32", "m1w4q_b3", "m1w8q_b3")),
    *(_v3(64, t) for t in ("m2w4q_b3", "m1w4q_b3", "m1w8q_b3_k32")),
    _v4(128, 2, 64), _v4(128, 3, 64), _v4(64, 2, 128), _v4(64, 2, 64),
    _v5(128, 2, 128, 2), _v5(128, 2, 64, 4), _v5(128, 3, 64, 3), _v5(64, 3, 128, 3),
])


def v3_min_blocks(head_dim: int, stages: int) -> int:
    """XSERV_V3_MINB_<D>_<S> of dev/attention_decode_dev.cu: the CTAs per SM v3's __launch_bounds__ asks for (what
    shared memory allows)."""
    return {(128, 2): 3, (128, 3): 2, (64, 2): 5, (64, 3): 4}[head_dim, stages]


@dataclass(frozen=True)
class DevDecodeKernel(DecodeKernel):
    """A dev decode kernel: v3 (generation 3, tensor cores) sizes its shared memory and resident CTAs by its own
    layout (per-warp staging + a flag; v3_min_blocks); the v4 experiments are the production template's."""

    def smem(self, head_dim: int) -> int:
        if self.generation == 3:
            return 4 * self.stages * head_dim * 64 + 16
        return super().smem(head_dim)

    def resident(self, head_dim: int, group: int, smem_per_sm: int = D.SM90_SMEM_PER_MULTIPROCESSOR) -> int:
        if self.generation == 3:
            by_smem = max(1, smem_per_sm // (self.smem(head_dim) + D.CTA_SMEM_RESERVED))
            return min(v3_min_blocks(head_dim, self.stages), by_smem)
        return super().resident(head_dim, group, smem_per_sm)


EXPERIMENT_SHAPES = frozenset({(128, 4), (128, 2), (64, 2)})  # the v4 experiments' (head_dim, group): the bench's
# docs/kernels/history/attention.md, "v3 decode", "v4 decode", "Wide CTAs for short contexts"
DEV_DECODE: dict[str, DecodeKernel] = {k.variant: k for k in (
    DevDecodeKernel("v3", 3, DECODE_FAMILY),
    DevDecodeKernel("v3s3", 3, DECODE_FAMILY, stages=3),
    DevDecodeKernel("v4s3", 4, DECODE_FAMILY, stages=3, shapes=EXPERIMENT_SHAPES),
    DevDecodeKernel("v4s4", 4, DECODE_FAMILY, stages=4, shapes=EXPERIMENT_SHAPES),
    DevDecodeKernel("v4w16", 4, DECODE_FAMILY, suffix="_w16", shapes=EXPERIMENT_SHAPES, warps=16),
    # the shipped v4 kernel with its 4-warp CTAs at every grid (the plan's 8-warp ones off): an A/B form of v4 whose
    # kernels are the production family's (its FP8 forms included)
    DecodeKernel("v4w4", 4, "attention_decode"),
)}


def prefill_variants(head_dim: int, dev: bool = True) -> list[str]:
    """The prefill variant names compiled for head_dim: the shipped ones, then (dev=True) the dev ones."""
    names = P.prefill_variants(head_dim)
    return names + [v for v, by_dim in DEV_PREFILL.items() if dev and head_dim in by_dim]


def decode_variants(dev: bool = True) -> list[str]:
    """The decode variant names: the shipped ones, then (dev=True) the dev ones."""
    return list(D.DECODE_KERNELS) + (list(DEV_DECODE) if dev else [])


def prefill(variant: str | None, head_dim: int) -> PrefillKernel | str | None:
    """What attention_prefill takes as `variant` for this name: a shipped name as it is (the op resolves it, with
    its fallbacks), a dev one as its PrefillKernel; None stays None (the default). Raises ValueError naming the
    known variants for an unknown one."""
    if variant is None or head_dim in P.PREFILL_KERNELS.get(variant, {}):
        return variant
    if head_dim in DEV_PREFILL.get(variant, {}):
        return DEV_PREFILL[variant][head_dim]
    raise ValueError(f"variant: no prefill kernel {variant!r} for head_dim {head_dim}; "
                     f"known: {', '.join(prefill_variants(head_dim))}")


def prefill_kernel(variant: str, head_dim: int) -> PrefillKernel:
    """The table entry (shipped or dev) named `variant` for head_dim, before the op's fallbacks."""
    k = prefill(variant, head_dim)
    return P.PREFILL_KERNELS[variant][head_dim] if isinstance(k, str) else k


def decode(variant: str | None) -> DecodeKernel | str | None:
    """What attention_decode / attention_decode_rope take as `variant` for this name: a shipped name as it is, a
    dev one as its DecodeKernel; None stays None. Raises ValueError for an unknown name."""
    if variant is None or variant in D.DECODE_KERNELS:
        return variant
    if variant in DEV_DECODE:
        return DEV_DECODE[variant]
    raise ValueError(f"variant: unknown decode kernel {variant!r}; known: {', '.join(decode_variants())}")


def decode_kernel(variant: str) -> DecodeKernel:
    """The table entry (shipped or dev) named `variant`."""
    k = decode(variant)
    return D.DECODE_KERNELS[variant] if isinstance(k, str) else k
