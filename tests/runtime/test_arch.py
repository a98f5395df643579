"""Kernel paths by architecture, on the CPU: the compile target a device gets (XSERV_ARCH included), the
per-op table against the families the runtime compiles, PTX families per arch, PDL off below sm_90, and no arch guard
that compiles a kernel to nothing. Compiling every family for every arch: tests/runtime/test_compile_all.py."""
import re

import pytest

from xserv.runtime import CompileError
from xserv.runtime.arch import (KernelPath, UnsupportedGPU, arch_for, arch_path, pdl_enabled, select_target,
                                split_target, target_from_env)
from xserv.runtime.compiler import (compile_family, families_for, family_archs, family_source, kernel_source_dir,
                                    list_dev_families, list_families, ptx_for_arch)

H100, A100, L4, B200, RTX5090 = (9, 0), (8, 0), (8, 9), (10, 0), (12, 0)


# ---- the target a device gets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cc, native", [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), "sm_89"), ((9, 0), "sm_90a"),
                                        ((10, 0), "sm_100a"), ((12, 0), "sm_120a")])
def test_native_targets(cc, native):
    assert arch_for(*cc) == native
    assert select_target(cc, "GPU") == select_target(cc, "GPU", "") == native
    assert arch_path(native) is (KernelPath.HOPPER if cc == (9, 0) else KernelPath.PORTABLE)
    assert pdl_enabled(native) == (cc >= (9, 0))


def test_forcing_a_lower_arch_keeps_the_device_machine_code():
    assert select_target(H100, "NVIDIA H100", "sm_80") == "sm_80@sm_90a"
    assert select_target(H100, "NVIDIA H100", " sm_89 ") == "sm_89@sm_90a"
    assert select_target(RTX5090, "RTX 5090", "sm_86") == "sm_86@sm_120a"
    assert select_target(B200, "B200", "sm_90") == "sm_90@sm_100a"  # Hopper's PDL, not its wgmma
    assert split_target("sm_80@sm_90a") == ("sm_80", "sm_90a") and split_target("sm_90a") == ("sm_90a", "sm_90a")
    forced = select_target(H100, "NVIDIA H100", "sm_80")
    assert arch_path(forced) is KernelPath.PORTABLE and not pdl_enabled(forced)
    assert arch_path("sm_90@sm_100a") is KernelPath.PORTABLE and pdl_enabled("sm_90@sm_100a")


def test_forcing_the_device_own_arch_is_native():
    for value in ("sm_90", "sm_90a"):
        assert select_target(H100, "NVIDIA H100", value) == "sm_90a"
    assert select_target(L4, "L4", "sm_89") == "sm_89"
    assert select_target(B200, "B200", "sm_100") == select_target(B200, "B200", "sm_100a") == "sm_100a"


@pytest.mark.parametrize("value, message", [
    ("sm80", "not an arch"), ("ampere", "not an arch"), ("sm_90b", "not an arch"), ("compute_80", "not an arch"),
    ("sm_75", "sm_80 or later"), ("sm_70", "sm_80 or later"), ("sm_88", "unknown arch"), ("sm_95", "unknown arch"),
])
def test_bad_xserv_arch_values_are_named(value, message):
    with pytest.raises(ValueError, match=rf"XSERV_ARCH={re.escape(repr(value)) if 'not an' in message else value}"
                                         rf".*{message}"):
        select_target(H100, "NVIDIA H100", value)
    with pytest.raises(ValueError, match="sm_80, sm_86, sm_87, sm_89, sm_90"):  # says what it takes
        select_target(H100, "NVIDIA H100", "sm_7")


def test_an_arch_newer_than_the_device_is_refused():
    with pytest.raises(ValueError, match=r"XSERV_ARCH=sm_90a is newer than this GPU, NVIDIA A100 .*8\.0.*sm_80"):
        select_target(A100, "NVIDIA A100", "sm_90a")
    with pytest.raises(ValueError, match="newer than this GPU, NVIDIA L4"):
        select_target(L4, "NVIDIA L4", "sm_120")


def test_an_arch_specific_target_of_another_device_is_refused():
    with pytest.raises(ValueError, match=r"sm_90a: an arch-specific target runs only on compute capability 9\.0"):
        select_target(B200, "NVIDIA B200", "sm_90a")
    with pytest.raises(ValueError, match="use sm_100 "):
        select_target(RTX5090, "RTX 5090", "sm_100a")


@pytest.mark.parametrize("cc, name", [((7, 5), "Tesla T4"), ((7, 0), "Tesla V100-SXM2-16GB"), ((6, 1), "GTX 1080")])
def test_gpus_below_sm80_get_one_clear_error(cc, name):
    with pytest.raises(UnsupportedGPU, match=rf"{re.escape(name)} \(compute capability {cc[0]}\.{cc[1]}\) is not "
                                             r"supported.*8\.0.*--device cpu"):
        select_target(cc, name)
    with pytest.raises(UnsupportedGPU):  # whatever XSERV_ARCH says
        select_target(cc, name, "sm_80")
    assert issubclass(UnsupportedGPU, RuntimeError)


def test_target_from_env_reads_xserv_arch():
    assert target_from_env(H100, "H100", {}) == "sm_90a"
    assert target_from_env(H100, "H100", {"XSERV_ARCH": "sm_80"}) == "sm_80@sm_90a"
    with pytest.raises(ValueError, match="XSERV_ARCH"):
        target_from_env(H100, "H100", {"XSERV_ARCH": "hopper"})


# ---- families per path, and the per-op table ----------------------------------------------------------------------
def test_hopper_only_families_are_declared_and_refused_elsewhere():
    restricted = {f: family_archs(f) for f in list_families() + list_dev_families() if family_archs(f) is not None}
    hopper = {"attention_prefill_sm90", "moe_sm90"}
    assert restricted == {**{f: ("sm_90a",) for f in hopper}, "dev/attention_prefill_sm90_dev": ("sm_90a",)}
    assert families_for("sm_90a") == list_families()
    for target in ("sm_80", "sm_86", "sm_89", "sm_100a", "sm_120a", "sm_80@sm_90a", "sm_90@sm_100a"):
        assert families_for(target) == [f for f in list_families() if f not in hopper], target
        for family in hopper:
            with pytest.raises(CompileError, match=rf"'{family}' is for sm_90a only \(wgmma.*not compiled for {target}"):
                compile_family(family, target)


# families compiled at start-up only for a model that needs them (moe=1, fp8=1) or an FP8 KV cache (kvfp8=1)
# families a start-up compiles only for models that need them: MoE, FP8 weights, an FP8 KV cache, and the hybrid
# models' (head_dim 256 attention, Gated DeltaNet)
HYBRID_ONLY = {"attention_decode_d256", "attention_prefill_d256", "gdn"}
MODEL_ONLY = {"moe", "moe_sm90", "gemv_fp8", "fp8", "attention_decode_fp8"} | HYBRID_ONLY


def test_kernel_paths_name_what_the_runtime_compiles():
    from xserv.ops.attention import DECODE_KERNELS, PREFILL_KERNELS
    from xserv.runtime.arch import KERNEL_PATHS, default_variant, families_of
    from xserv.runtime.compiler import startup_families

    assert families_of(KernelPath.PORTABLE) | families_of(KernelPath.HOPPER) == set(list_families())  # all named
    shapes = {"head_dim": 128, "group": 4}  # a model's (kernel_shapes): the families compiled per shape as pieces

    def startup(target):  # the families a start-up compiles, its pieces counted as their family
        return {name.partition(":")[0] for name in startup_families(target, shapes)}

    for path, target in ((KernelPath.PORTABLE, "sm_80"), (KernelPath.HOPPER, "sm_90a")):
        assert families_of(path) <= set(families_for(target)), path  # each compiles for its path
        # a dense bf16 model's start-up: no moe piece, no FP8 pieces (gemv_fp8, fp8: an FP8-quantized model's)
        assert startup(target) == families_of(path) - MODEL_ONLY
        for key, families in (("moe", {"moe", "moe_sm90"}), ("fp8", {"gemv_fp8", "fp8"}), ("kvfp8", {"attention_decode_fp8"})):
            with_key = {name.partition(":")[0] for name in startup_families(target, {**shapes, key: 1})}
            assert with_key == families_of(path) - (MODEL_ONLY - families), key
        both = {name.partition(":")[0] for name in startup_families(target, {**shapes, "moe": 1, "fp8": 1,
                                                                              "kvfp8": 1})}
        assert both == families_of(path) - HYBRID_ONLY
        hybrid = {name.partition(":")[0] for name in startup_families(target, {"head_dim": 256, "group": 4, "gdn": 1})}
        assert hybrid & MODEL_ONLY == HYBRID_ONLY and "attention_decode" not in hybrid  # (head_dim 128's pieces)
    assert set(list_families()) - startup("sm_90a") == {"attention_prefill"} | MODEL_ONLY  # v3, simple: on request
    assert set(list_families()) - startup("sm_80@sm_90a") == {"attention_prefill_sm90"} | MODEL_ONLY
    for op, by_path in KERNEL_PATHS.items():
        assert set(by_path) == set(KernelPath), op  # every op has a kernel on every path (none is missing today)
    assert default_variant("attention_prefill", "sm_90a") == "v5"
    for target in ("sm_80", "sm_89", "sm_100a", "sm_120a", "sm_80@sm_90a"):
        assert default_variant("attention_prefill", target) == "v3"
    for target in ("sm_80", "sm_90a"):
        assert default_variant("attention_decode, attention_decode_rope", target) == "v4"
    for path in KernelPath:  # the variants named are shipped kernels of the family named
        prefill = KERNEL_PATHS["attention_prefill"][path][0]
        # (head_dim 256 has its own family on every path: "attention at head_dim 256")
        assert all(k.family == prefill.family for d, k in PREFILL_KERNELS[prefill.variant].items() if d != 256)
        decode = KERNEL_PATHS["attention_decode, attention_decode_rope"][path][0]
        assert DECODE_KERNELS[decode.variant].family == decode.family


def test_an_op_without_a_kernel_for_a_path_says_so(monkeypatch):
    import xserv.runtime.arch as arch

    monkeypatch.setitem(arch.KERNEL_PATHS, "new_op", {arch.HOPPER: (arch.Route("x", "wgmma"),)})
    assert arch.routes("new_op", "sm_90a")[0].family == "x"
    with pytest.raises(NotImplementedError, match=r"new_op has no kernel for the portable path \(sm_80@sm_90a\)"):
        arch.routes("new_op", "sm_80@sm_90a")


def test_prefill_dispatch_follows_the_target(monkeypatch):
    import xserv.ops.attention.prefill as P

    class Dev:
        arch = "sm_80@sm_90a"  # XSERV_ARCH=sm_80 on an H100: the portable path although the device has wgmma

    monkeypatch.setattr(P, "get_device", lambda: Dev)
    assert P.default_prefill_variant() == "v3"
    with pytest.raises(ValueError, match="needs sm_90a"):
        P.select_prefill_kernel("v5", 128, 16)
    Dev.arch = "sm_90a"
    assert P.default_prefill_variant() == "v5" and P.select_prefill_kernel("v5", 128, 16).variant == "v5"


def test_decode_spread_stays_within_the_device_shared_memory():
    """The fused decode entry's placement padding asks for at most the device's opt-in shared memory per CTA (it
    assumed sm_90's 227 KB: an L4 or RTX 4090, 99 KB, would have refused the launch), and is sm_90's unchanged."""
    from xserv.ops.attention import decode as D

    need = D.DECODE_KERNELS["v4w8"].smem(128)
    for optin in (99 * 1024, 163 * 1024, 227 * 1024):
        for sms in (58, 108, 132, 170):
            for ctas in (1, sms // 2, sms, sms + 1, 2 * sms, 5 * sms):
                smem = D.spread_smem(need, ctas, sms, optin)
                cap = -(-ctas // sms)
                assert need <= smem <= optin and smem % 16 == 0
                per_sm = (optin + 1024) // (smem + 1024)
                assert per_sm == cap or (smem == need and per_sm < cap), (optin, sms, ctas, smem)
                if optin == 227 * 1024:
                    assert smem == D.spread_smem(need, ctas, sms)


# ---- PDL ---------------------------------------------------------------------------------------------------------
def test_pdl_follows_the_code_arch_not_the_device():
    """Under XSERV_ARCH=sm_80 on an H100 the kernels carry no griddepcontrol.wait: a PDL launch would let them start
    before their inputs are written, so Kernel launches them plainly."""
    from cuda.bindings import driver

    from xserv.runtime.kernels import Kernel

    class Core:
        handle = driver.CUfunction(0x1234)

    class Info:
        index, compute_capability, max_shared_memory_per_block_optin = 0, (9, 0), 227 * 1024

    class Dev:
        stream_handle, info = 0x5150, Info()

        def __init__(self, arch):
            self.arch = arch

    assert Kernel("f", "k", Core(), Dev("sm_90a"))._pdl_supported
    assert not Kernel("f", "k", Core(), Dev("sm_80@sm_90a"))._pdl_supported
    assert Kernel("f", "k", Core(), Dev("sm_90@sm_100a"))._pdl_supported
    with pytest.raises(ValueError, match=r"cluster launch needs sm_90.*sm_80@sm_90a"):
        Kernel("f", "k", Core(), Dev("sm_80@sm_90a"))(2, 32, cluster=2)


# ---- PTX families ------------------------------------------------------------------------------------------------
def test_ptx_family_declares_the_lowest_target_and_drops_pdl_below_sm90():
    text = family_source("activation").read_text()
    assert re.search(r"^\.target sm_90$", text, re.M)  # griddepcontrol's floor, not the arch-specific sm_90a
    pdl = re.compile(r"^\s*griddepcontrol\.\w+;", re.M)
    assert len(pdl.findall(text)) == 4
    for arch in ("sm_90", "sm_90a", "sm_100a", "sm_120a"):
        assert ptx_for_arch(text, arch) == text
    for arch in ("sm_80", "sm_86", "sm_89"):
        low = ptx_for_arch(text, arch)
        assert not pdl.findall(low)
        assert re.search(r"^\.target sm_80$", low, re.M)
        dropped = [line for line in text.splitlines() if line not in low.splitlines()]
        assert len(dropped) == 5 and all("griddepcontrol." in line or ".target" in line for line in dropped)


def test_ptx_targets_that_cannot_serve_an_arch_are_refused():
    src = ".version 8.0\n.target {}\n.address_size 64\n"
    with pytest.raises(CompileError, match="arch-specific target"):
        ptx_for_arch(src.format("sm_90a"), "sm_100a")
    with pytest.raises(CompileError, match="cannot be assembled for sm_89"):
        ptx_for_arch(src.format("sm_100"), "sm_89")
    assert ptx_for_arch(src.format("sm_80"), "sm_120a") == src.format("sm_80")


# ---- no kernel compiles to nothing ---------------------------------------------------------------------------------
def test_arch_guards_are_only_the_documented_ones():
    """`#if __CUDA_ARCH__...` that compiles a kernel body to nothing (or a trap) on other archs is not allowed: a
    kernel has real code for its target or is not compiled there. The exceptions: the PDL wrappers (exact no-ops
    below sm_90, common.cuh says why), the sm_90a-only families' #error, and the e4m3 conversions in e4m3.cuh (the
    FP8 GEMV's and the FP8 KV cache's: the hardware cvt from sm_89, the bit-identical soft forms below; the FP8
    GEMV's GPU test compares its _soft entries with the hardware ones bit for bit, tests/ops/test_attention_fp8_kv.py
    checks the soft encoding against ml_dtypes, and the GPU tests run with XSERV_ARCH=sm_80 beside the native
    ones)."""
    allowed = {("common.cuh", "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900"),
               ("attention_prefill_sm90.cu", "#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)"),
               ("moe_sm90.cu", "#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)"),
               ("e4m3.cuh", "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890")}
    found = []
    for path in sorted(kernel_source_dir().rglob("*")):
        if path.suffix in (".cu", ".cuh"):
            for line in path.read_text().splitlines():
                if re.match(r"\s*#\s*(el)?if.*(__CUDA_ARCH|FEAT_SM)", line):
                    found.append((path.name, line.strip()))
    assert set(found) <= allowed and len([f for f in found if f[0] == "common.cuh"]) == 2, found
    for family in ("attention_prefill_sm90", "moe_sm90"):
        sm90 = family_source(family).read_text()
        assert "__trap();  // wgmma" not in sm90 and "#error" in sm90


def test_forced_arch_plans_within_that_archs_shared_memory():
    """XSERV_ARCH narrows the device's shared memory to the forced arch's (so sm_89 on an H100 runs the 99 KB plans);
    the native target keeps the device's own numbers, and a forced arch never widens them."""
    from xserv.runtime.arch import KNOWN_COMPUTE_CAPABILITIES, SHARED_MEMORY, forced_shared_memory

    h100 = SHARED_MEMORY[(9, 0)]
    assert forced_shared_memory("sm_90a", *h100) == h100
    assert forced_shared_memory("sm_89@sm_90a", *h100) == (101_376, 102_400)
    assert forced_shared_memory("sm_120@sm_120a", 101_376, 102_400) == (101_376, 102_400)
    assert forced_shared_memory("sm_80@sm_90a", *h100) == (166_912, 167_936)
    assert forced_shared_memory("sm_80@sm_86", 101_376, 102_400) == (101_376, 102_400)
    assert set(SHARED_MEMORY) == set(KNOWN_COMPUTE_CAPABILITIES)
