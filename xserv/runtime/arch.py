"""Which GPU code xserv builds and runs: compute capability -> compile target -> kernel path.

A *target* is the string the compiler and the kernel cache take:
  "sm_90a"        native: the kernels are compiled for the device's own arch (an H100 or H200).
  "sm_80@sm_90a"  forced (XSERV_ARCH=sm_80 on an H100): the kernel sources are compiled as for sm_80
                  (__CUDA_ARCH__ == 800, PTX for compute_80, the sm_80 kernel path) and that PTX is assembled into a
                  cubin for the device's arch. A cubin runs only on its own major version (an sm_80 cubin does not
                  load on sm_90), so the sm_80 *code* reaches an H100 as PTX, as the driver would JIT it.
The part before "@" is the *code arch*: it picks the kernel path and decides PDL; the part after (or the whole
string) is the arch of the machine code.

Kernel paths (KERNEL_PATHS below: which kernel serves which path, per op):
  portable  sm_80, sm_86, sm_87, sm_89 and, until a Blackwell path exists, sm_100, sm_103, sm_110, sm_120, sm_121:
            mma.sync + cp.async kernels.
  hopper    sm_90a (compute capability 9.0): wgmma, TMA, setmaxnreg where a kernel has them; PDL.
Programmatic dependent launch (griddepcontrol) exists from sm_90 on: pdl_enabled() is False below, where the
kernels are compiled without griddepcontrol (cuda_src/common.cuh) and launches never carry the attribute.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from .. import settings

ENV = settings.ARCH.name
MIN_COMPUTE_CAPABILITY = (8, 0)
# The compute capabilities XSERV_ARCH may name (NVRTC 13 knows them all). A device outside this list but at least
# sm_80 still gets its native target (arch_for); NVRTC says so if it does not know it.
KNOWN_COMPUTE_CAPABILITIES = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1))
_ARCH = re.compile(r"sm_(\d+)(\d)(a?)")


# Shared memory by compute capability, bytes: (per-CTA opt-in limit, per SM), as the driver reports them
# (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN / _PER_MULTIPROCESSOR; the CUDA programming guide's table
# "Technical Specifications per Compute Capability"). A live device's own numbers are used; these only narrow them
# where XSERV_ARCH forces an arch (forced_shared_memory), so that the forced path plans its launches as that arch
# would: XSERV_ARCH=sm_89 on an H100 runs the 99 KB plans of an RTX 4090.
SHARED_MEMORY = {
    (8, 0): (166_912, 167_936), (8, 7): (166_912, 167_936),
    (8, 6): (101_376, 102_400), (8, 9): (101_376, 102_400),
    (9, 0): (232_448, 233_472), (10, 0): (232_448, 233_472), (10, 3): (232_448, 233_472), (11, 0): (232_448, 233_472),
    (12, 0): (101_376, 102_400), (12, 1): (101_376, 102_400),
}


class KernelPath(str, enum.Enum):
    PORTABLE = "portable"
    HOPPER = "hopper"


class UnsupportedGPU(RuntimeError):
    """A GPU xserv has no kernels for (below sm_80)."""


def arch_for(major: int, minor: int) -> str:
    """The NVRTC target for a compute capability; Hopper gets the arch-specific sm_90a (wgmma, setmaxnreg)."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major >= 10:
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


def parse_arch(arch: str) -> tuple[int, int, bool]:
    """"sm_89" -> (8, 9, False), "sm_90a" -> (9, 0, True); ValueError for anything else."""
    m = _ARCH.fullmatch(arch.strip()) if isinstance(arch, str) else None
    if m is None:
        raise ValueError(f"{arch!r} is not an arch: expected sm_<major><minor>[a], e.g. sm_80, sm_89, sm_90a")
    return int(m.group(1)), int(m.group(2)), bool(m.group(3))


def split_target(target: str) -> tuple[str, str]:
    """(code arch, machine-code arch) of a target: "sm_80@sm_90a" -> ("sm_80", "sm_90a"), "sm_90a" -> twice."""
    code, _, sass = target.partition("@")
    return code, sass or code


def code_arch(target: str) -> str:
    return target.partition("@")[0]


def compute_capability(target: str) -> tuple[int, int]:
    """The compute capability the target's code is compiled for (its code arch's)."""
    major, minor, _ = parse_arch(code_arch(target))
    return major, minor


def arch_path(target: str) -> KernelPath:
    """The kernel path of a target: hopper for sm_90a code, portable for every other arch (sm_80 and later)."""
    return KernelPath.HOPPER if code_arch(target) == "sm_90a" else KernelPath.PORTABLE


def pdl_enabled(target: str) -> bool:
    """Programmatic dependent launch: from sm_90 on. Below, kernels carry no griddepcontrol and launch plainly."""
    return compute_capability(target) >= (9, 0)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def check_supported(compute_capability: tuple[int, int], gpu_name: str) -> None:
    """UnsupportedGPU for a device below sm_80 (no bf16 tensor cores, no cp.async)."""
    if tuple(compute_capability) < MIN_COMPUTE_CAPABILITY:
        raise UnsupportedGPU(
            f"{gpu_name} (compute capability {_cc(compute_capability)}) is not supported: xserv's GPU kernels need "
            f"compute capability 8.0 or later (Ampere: bf16 tensor cores, cp.async); run on the CPU with --device cpu")


def select_target(compute_capability: tuple[int, int], gpu_name: str, forced: str | None = None) -> str:
    """The compile target for a device of this compute capability: its native arch (arch_for), or with `forced`
    (XSERV_ARCH's value; None or "" = not set) the code of that arch on this device ("sm_80@sm_90a").

    XSERV_ARCH names an arch at most the device's: sm_80, sm_86, sm_87, sm_89, sm_90 / sm_90a, sm_100[a], sm_103[a],
    sm_110[a], sm_120[a], sm_121[a]. The device's own compute capability (with or without "a") is the native target.
    An arch-specific "a" target other than the device's is refused (its features exist on that arch only)."""
    cc = tuple(compute_capability)
    check_supported(cc, gpu_name)
    native = arch_for(*cc)
    if forced is None or not forced.strip():
        return native
    known = ", ".join(f"sm_{a}{b}" for a, b in KNOWN_COMPUTE_CAPABILITIES)
    try:
        major, minor, specific = parse_arch(forced)
    except ValueError:
        raise ValueError(f"{ENV}={forced!r}: not an arch; expected one of {known} (sm_90a for Hopper's own path)") \
            from None
    want = (major, minor)
    if want < MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"{ENV}={forced}: xserv's kernels need sm_80 or later; expected one of {known}")
    if want not in KNOWN_COMPUTE_CAPABILITIES:
        raise ValueError(f"{ENV}={forced}: unknown arch; expected one of {known}")
    if want > cc:
        raise ValueError(f"{ENV}={forced} is newer than this GPU, {gpu_name} (compute capability {_cc(cc)}): "
                         f"force an arch at most sm_{cc[0]}{cc[1]}")
    if want == cc:
        return native
    if specific:
        raise ValueError(f"{ENV}={forced}: an arch-specific target runs only on compute capability {_cc(want)}, "
                         f"this GPU is {gpu_name} ({_cc(cc)}); use sm_{major}{minor} (without 'a')")
    return f"sm_{major}{minor}@{native}"


def forced_shared_memory(target: str, per_block: int, per_sm: int) -> tuple[int, int]:
    """(per-CTA opt-in, per-SM) shared memory the kernels may plan with for `target` on a device with these limits:
    the device's own, or where the target forces another arch's code ("sm_89@sm_90a") the smaller of the device's and
    that arch's (SHARED_MEMORY)."""
    code, sass = split_target(target)
    if code == sass:
        return per_block, per_sm
    arch_block, arch_sm = SHARED_MEMORY[compute_capability(target)]
    return min(per_block, arch_block), min(per_sm, arch_sm)


def target_from_env(compute_capability: tuple[int, int], gpu_name: str, environ=None) -> str:
    return select_target(compute_capability, gpu_name, settings.ARCH.get(environ))


# ---- which kernel serves which path, per op ---------------------------------------------------------------------
# An entry names the family (cuda_src/<family>.cu or .ptx) and the kernels in it the op launches on that path. Most
# ops run the same kernel on both paths: their code needs sm_80 at most, and what differs (griddepcontrol, the PDL
# wait) is compiled per arch and switched by the launch (pdl_enabled). An op without a kernel for a path leaves the
# path out, and routes() raises naming the op: no such op today. The launchers dispatch through it where the kernel
# differs (attention_prefill's default variant); a start-up compiles exactly the families of the device's path
# (compiler.ensure_compiled); tests/runtime/test_arch.py checks it against the sources and the attention tables.
PORTABLE, HOPPER = KernelPath.PORTABLE, KernelPath.HOPPER


@dataclass(frozen=True)
class Route:
    family: str
    kernels: str  # which kernels of the family, in words (variant names of the attention tables)
    variant: str | None = None  # the launcher's default variant on this path, where it has variants


def _both(route: Route) -> dict[KernelPath, Route]:
    return {PORTABLE: route, HOPPER: route}


# op -> path -> the family and kernels that serve it (several routes: the op launches from each)
KERNEL_PATHS: dict[str, dict[KernelPath, tuple[Route, ...]]] = {
    "attention_prefill": {
        PORTABLE: (Route("attention_prefill", "v3: mma.sync m16n8k16 + ldmatrix + cp.async ring", "v3"),),
        HOPPER: (Route("attention_prefill_sm90", "v5: wgmma + TMA producer warp + setmaxnreg; v4 (wgmma, cp.async) "
                       "where the block size rules out the TMA", "v5"),),
    },
    "attention_decode, attention_decode_rope": {
        path: (Route("attention_decode", "v4 / v4w8 / lean / subgroup entries: cp.async ring, L2 evict-first hints; "
                     "PDL on hopper", "v4"),
               Route("attention_decode_v2", "v2 + combine: where a split overflows v4's page table"))
        for path in (PORTABLE, HOPPER)},
    "write_kv": {p: (r,) for p, r in _both(Route("kv_cache", "write_kv_bf16; write_kv_fp8 and "
                                                 "dequantize_kv_blocks_fp8 for an FP8 KV cache")).items()},
    "attention_decode (FP8 KV cache)": {p: (r,) for p, r in _both(Route(
        "attention_decode_fp8", "the v4 / v4w8 / lean / subgroup entries and the v2 fallback on e4m3 chunks, "
        "dequantized in registers (cvt from sm_89, soft below); compiled for an FP8 KV cache only")).items()},
    "gemv, linear (M <= 16)": {p: (r,) for p, r in _both(Route("gemv", "row kernels; mma.sync m8/m16; PDL on hopper"))
                               .items()},
    "silu_and_mul": {p: (r,) for p, r in _both(Route("activation", "PTX; griddepcontrol left out below sm_90")).items()},
    "rmsnorm, fused_add_rmsnorm, head_rmsnorm": {p: (r,) for p, r in _both(Route("rmsnorm", "PDL on hopper")).items()},
    "rope, qk_norm_rope_write_kv": {p: (r,) for p, r in _both(Route("rope", "PDL on hopper")).items()},
    "embedding": {p: (r,) for p, r in _both(Route("embedding", "PDL on hopper")).items()},
    "argmax": {p: (r,) for p, r in _both(Route("argmax", "single-CTA and split forms")).items()},
    "sample": {p: (r,) for p, r in _both(Route("sampling", "fused penalties + top-k/top-p + draw")).items()},
    "cast": {p: (r,) for p, r in _both(Route("cast", "bf16/fp16/fp32 conversions")).items()},
    "add": {p: (r,) for p, r in _both(Route("elementwise", "vector and scalar forms")).items()},
    "moe_experts": {
        PORTABLE: (Route("moe", "route + sorted list, grouped GEMMs (mma.sync m16n8k16, cp.async ring), combine"),),
        HOPPER: (Route("moe", "route + sorted list, the decode-sized (small) GEMMs and FP8 experts' (mma.sync), "
                       "combine"),
                 Route("moe_sm90", "the mid and large grouped GEMMs of bf16 experts on wgmma, weights by TMA (prefill, "
                       "large batches)")),
    },
    "linear_fp8 (FP8 block-quantized weights)": {
        PORTABLE: (Route("gemv_fp8", "M <= 8: e4m3 weights dequantized in registers (cvt from sm_89, soft below)"),
                   Route("fp8", "M > 8: fp8_dequantize_bf16 into a scratch, then the bf16 cuBLAS GEMM")),
        HOPPER: (Route("gemv_fp8", "M <= 8: e4m3 weights dequantized in registers (hardware cvt)"),
                 Route("fp8", "M > 8: fp8_quantize_1x128 (x to e4m3 + 1x128 scales), then cuBLASLt's block-scaled FP8 "
                       "GEMM; fp8_dequantize_bf16 + bf16 GEMM where cuBLASLt has no algorithm")),
    },
    "all_reduce (tensor parallelism, bf16 messages <= 64 KB)": {
        p: (r,) for p, r in _both(Route("allreduce", "one-shot over CUDA IPC peer memory: push, release/acquire flags, "
                                        "rank-order sum (NCCL for larger messages)")).items()},
    "attention at head_dim 256 (gated attention of the hybrid models)": {p: (
        Route("attention_prefill_d256", "the v3 prefill (mma.sync, cp.async) at head_dim 256: every arch (the wgmma "
              "prefill stops at 128); compiled for a head_dim 256 model only"),
        Route("attention_decode_d256", "v2 + combine at head_dim 256, groups 4, 6, 8, 16 (16 as two subgroups of 8), "
              "bf16 and FP8 caches; compiled for a head_dim 256 model only")) for p in (PORTABLE, HOPPER)},
    "attention_output_gate": {p: (r,) for p, r in _both(Route("attention_gate", "attn * sigmoid(gate)")).items()},
    "causal_conv1d_silu, gated_delta_rule, gated_rmsnorm_silu (Gated DeltaNet)": {p: (r,) for p, r in _both(Route(
        "gdn", "conv; recurrent delta rule (decode); chunked WY form on mma.sync (prefill); gated norm")).items()},
    "fill (benchmarks)": {p: (r,) for p, r in _both(Route("fill", "fill_f32")).items()},
}


def routes(op: str, target: str) -> tuple[Route, ...]:
    """The routes of `op` (a KERNEL_PATHS key) on the kernel path of `target` (a device's arch string)."""
    by_path = KERNEL_PATHS[op]
    path = arch_path(target)
    found = by_path.get(path)
    if not found:
        raise NotImplementedError(f"{op} has no kernel for the {path.value} path ({target}) yet")
    return found


def default_variant(op: str, target: str) -> str:
    """The launcher's default variant of `op` on `target`'s path (ops with variants: the attention ops)."""
    return routes(op, target)[0].variant


def families_of(path: KernelPath) -> set[str]:
    """Every family some op launches on `path`: what a start-up compiles (compiler.ensure_compiled)."""
    return {r.family for by_path in KERNEL_PATHS.values() for r in by_path.get(path, ())}


__all__ = ["KernelPath", "UnsupportedGPU", "arch_for", "arch_path", "check_supported", "code_arch",
           "compute_capability", "parse_arch", "pdl_enabled", "select_target", "split_target", "target_from_env",
           "ENV", "KNOWN_COMPUTE_CAPABILITIES", "MIN_COMPUTE_CAPABILITY", "KERNEL_PATHS", "Route", "routes",
           "default_variant", "families_of"]
