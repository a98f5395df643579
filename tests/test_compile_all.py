"""Every kernel family compiles for every arch CI covers (no GPU needed): sm_80 (A100), sm_89 (L4, RTX 40xx), sm_90a
(H100, H200), sm_100a (B200) and sm_120a (RTX 50xx), .cu through NVRTC and .ptx through nvJitLink; a family restricted
to some archs (`// xserv-arch:`) for those only. And the disk cache works. The families compile once per session, in
parallel (as a first start does)."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from xserv.runtime import CompileError
from xserv.runtime.compiler import (cache_key, compile_families, compile_family, families_for, family_shapes,
                                    family_source, kernel_code_sizes, kernel_shapes, list_dev_families, list_families,
                                    ptx_to_cubin, startup_families)

CI_ARCHES = ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")  # tools/kernel_harness.py CI_ARCHES
# Every family whole (every kernel and shape instantiation) for every arch, and sm_90a's start-up pieces for a
# Qwen3-0.6B-shaped model (head_dim 128, 2 query heads per kv head): the runtime's own entries.
QWEN3_0_6B = kernel_shapes(type("Config", (), {"head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 8}))
PIECES = [p for p in startup_families("sm_90a", QWEN3_0_6B) if ":" in p]
PAIRS = [(arch, family) for arch in CI_ARCHES for family in families_for(arch)] + [("sm_90a", p) for p in PIECES]
# sm_90a (the lent GPU's arch) compiles what the runtime loads as the runtime does, into its cache: every family
# compiled whole, and the pieces above. Everything else compiles with NVRTC's --Ofast-compile=max unless
# XSERV_TEST_FULL_ARCHES=1: every template is still instantiated and every instruction assembled for the arch, which
# is what can fail there, at a sixth of the CPU (docs/kernels/portability.md). Not cached: the runtime never loads
# these. That includes sm_90a's whole attention_decode, attention_decode_v2 and gemv, which the runtime loads as
# pieces (their kernels are the same code in both: tests/test_shape_pieces.py).
FULL = os.environ.get("XSERV_TEST_FULL_ARCHES") == "1"
FAST_OPTIONS = ("--Ofast-compile=max",)


def _compile(arch: str, family: str) -> bytes:
    if FULL or (arch == "sm_90a" and (":" in family or family_shapes(family) is None)):
        return compile_family(family, arch)
    return compile_family(family, arch, extra_options=FAST_OPTIONS, use_cache=False)


@pytest.fixture(scope="session")
def cubins():
    """arch -> family -> cubin of every production family for every CI arch, compiled in parallel (sm_90a into the
    kernel cache the runtime uses, $XSERV_CACHE_DIR). CI starts with it empty, so every pair compiles here. On a GPU
    machine the GPU tests compile the device's families for its arch into it: sharing the cache compiles each of
    those once per session, not twice. A hit is as good as a compile: the key covers the source, every header it
    includes, the options, the target and the compiler's version (tests below check the key and that a hit is read
    back). One thread per core over all (arch, family) pairs, the largest sources first (attention_decode is the long
    pole): a test worker running beside this one (pytest-xdist) keeps its share of the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    order = sorted(PAIRS, key=lambda p: (-family_source(p[1]).stat().st_size, p[0] != "sm_90a"))
    with ThreadPoolExecutor(cores) as pool:
        built = dict(zip(order, pool.map(lambda pair: _compile(*pair), order)))
    by_arch = {}
    for (arch, family), cubin in built.items():
        by_arch.setdefault(arch, {})[family] = cubin
    return by_arch


@pytest.fixture(scope="session")
def hopper_cubins(cubins):
    return cubins["sm_90a"]


@pytest.mark.parametrize("arch, family", PAIRS, ids=[f"{a}-{f}" for a, f in PAIRS])
def test_family_compiles(arch, family, cubins):
    cubin = cubins[arch][family]
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image, not PTX text


def test_every_family_is_compiled_for_every_arch_that_admits_it():
    assert families_for("sm_90a") == list_families()
    assert PIECES == ["attention_decode:d128_g2", "attention_decode_v2:d128_g2", "gemv:m1_p0", "gemv:m8_p0",
                      "gemv:m8_p1", "sampling:v1"]
    for arch in CI_ARCHES:
        assert set(list_families()) - set(families_for(arch)) <= {"attention_prefill_sm90", "moe_sm90"}


@pytest.mark.parametrize("target", ["sm_80@sm_90a", "sm_89@sm_120a"])
def test_forced_targets_assemble_lower_code_for_the_device(target, tmp_path, monkeypatch):
    """XSERV_ARCH's form: the sm_80 code (NVRTC to compute_80 PTX, activation.ptx without griddepcontrol) in a cubin
    for the device's arch."""
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    for family in ("fill", "embedding", "activation"):
        assert compile_family(family, target)[:4] == b"\x7fELF"
    assert list(tmp_path.rglob(f"activation-{target}-*.cubin"))


def test_ptx_family_ships_its_kernels(hopper_cubins):
    assert family_source("activation").suffix == ".ptx"
    for name in ("silu_and_mul_bf16_vec", "silu_and_mul_bf16_scalar"):
        assert b"\0" + name.encode() + b"\0" in hopper_cubins["activation"]  # in the cubin's symbol names


def test_decode_chain_gemv_entries_stay_small(hopper_cubins):
    """kernel_code_sizes reads each entry's machine code from the cubin. The GEMV entries of the decode chain carry
    only their own prologue and epilogue: one generic entry (62 KB) cost 3-4% of a batch-1 step, each launch running
    its code from a cold instruction cache (docs/kernels/gemv.md, "v12")."""
    sizes = {}
    for name in ("gemv:m1_p0", "gemv:m8_p0", "gemv:m8_p1"):  # the start-up's pieces of gemv
        sizes.update(kernel_code_sizes(hopper_cubins[name]))
    sizes.update(kernel_code_sizes(compile_family("gemv:m16_p0", "sm_90a")))  # first use: 9..16 rows
    row = ["gemv_row_rmsnorm_bf16", "gemv_row_bf16_add", "gemv_row_rmsnorm_silu_mul", "gemv_row_rmsnorm_f32"]
    chain = row + [name + "_1step" for name in row] + ["gemv_mma_m8_bf16_bf16", "gemv_mma_m16_bf16_bf16"]
    assert all(0 < sizes[name] < 48 * 1024 for name in chain), {name: sizes.get(name) for name in chain}
    assert sizes["gemv_mma_m8_bf16_bf16"] * 3 < sizes["gemv_mma_m8"]  # the generic entry: every path inline
    assert set(kernel_code_sizes(hopper_cubins["activation"])) >= {"silu_and_mul_bf16_vec"}  # nvJitLink's cubins too
    with pytest.raises(ValueError, match="ELF"):
        kernel_code_sizes(b"not a cubin")


def test_harness_prints_the_sizes(hopper_cubins, capsys):
    from tools.kernel_harness import main

    assert main(["sizes", "gemv:m1_p0", "gemv:m8_p0", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "gemv_row_bf16_add" in out and "gemv_mma_m8_bf16_bf16" in out and " KB" in out
    assert main(["sizes", "no_such_family", "--arch", "sm_90a"]) == 2
    assert "no_such_family" in capsys.readouterr().out


def test_dev_families_are_not_production():
    dev = list_dev_families()
    assert dev and all(f.startswith("dev/") for f in dev)
    assert not set(dev) & set(list_families())
    assert "dev/attention_decode_dev" in dev and family_source("dev/attention_decode_dev").is_file()


def test_dev_cache_key_follows_the_production_file_it_includes(tmp_path, monkeypatch):
    """A dev family includes its production file ("../x.cu") and that file's headers: all are in its key."""
    import xserv.runtime.compiler as compiler

    src = tmp_path / "src"
    (src / "dev").mkdir(parents=True)
    (src / "base.cuh").write_text("#define N 1\n")
    (src / "base.cu").write_text('#include "base.cuh"\nextern "C" __global__ void k() {}\n')
    (src / "dev" / "exp.cu").write_text('#include "../base.cu"\nextern "C" __global__ void k2() {}\n')
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: src)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    assert compiler.list_families() == ["base"] and compiler.list_dev_families() == ["dev/exp"]
    before = cache_key("dev/exp", "sm_90a", ())
    (src / "base.cuh").write_text("#define N 2\n")
    assert cache_key("dev/exp", "sm_90a", ()) != before
    assert compile_family("dev/exp", "sm_90a")[:4] == b"\x7fELF"
    assert list((tmp_path / "cache").rglob("dev/exp-sm_90a-*.cubin"))


def test_cache_hit_returns_same_bytes_and_key_changes_with_options(tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    first = compile_family("fill", "sm_90a")
    (cached,) = tmp_path.rglob("*.cubin")
    cached.write_bytes(b"sentinel")  # a warm start must read the cache, not recompile
    assert compile_family("fill", "sm_90a") == b"sentinel"
    assert compile_family("fill", "sm_90a", use_cache=False) == first
    assert cache_key("fill", "sm_90a", ("-O3",)) != cache_key("fill", "sm_90a", ())
    assert cache_key("fill", "sm_80", ()) != cache_key("fill", "sm_90a", ())
    assert cache_key("activation", "sm_80", ()) != cache_key("activation", "sm_90a", ())
    assert cache_key("fill", "sm_80@sm_90a", ()) not in (cache_key("fill", "sm_80", ()), cache_key("fill", "sm_90a", ()))


def test_compile_error_carries_the_nvrtc_log(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k() { undefined_thing(); }\n')
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(CompileError, match=r"broken.cu.*undefined_thing"):
        compiler.compile_family("broken", "sm_90a")


BROKEN_PTX = """.version 8.0
.target sm_90a
.address_size 64

.visible .entry k(.param .u64 p)
{
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [p];
    mov.u64 %rd1, %no_such_register;
    ret;
}
"""


def test_ptx_error_names_file_and_line(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "broken.ptx").write_text(BROKEN_PTX)
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(CompileError, match=r"broken\.ptx:9: error: .*no_such_register"):
        compiler.compile_family("broken", "sm_90a")
    with pytest.raises(CompileError, match=r"inline\.ptx:9: error"):
        ptx_to_cubin(BROKEN_PTX.encode(), "sm_90a", "inline.ptx")
    fixed = BROKEN_PTX.replace("    mov.u64 %rd1, %no_such_register;\n", "")
    assert ptx_to_cubin(fixed.encode(), "sm_90a")[:4] == b"\x7fELF"


def test_a_family_with_both_sources_is_refused(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "twice.cu").write_text('extern "C" __global__ void k() {}\n')
    (tmp_path / "twice.ptx").write_text(BROKEN_PTX)
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    with pytest.raises(CompileError, match="both twice.cu and twice.ptx"):
        compiler.compile_family("twice", "sm_90a")


def test_unknown_family_is_named():
    with pytest.raises(CompileError, match="no_such_family"):
        compile_family("no_such_family", "sm_90a")


def test_compiling_leaves_python_constants_intact(tmp_path, monkeypatch):
    """Regression: an empty NVRTC log once overwrote CPython's shared b" " object with a NUL byte."""
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    compile_family("fill", "sm_90a", use_cache=False)
    assert " ".encode()[0] == 32 and b" "[0] == 32  # compares ints: the shared object would read 0


def test_ensure_compiled_fills_the_cache_once(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiler, "list_families", lambda: ["fill", "elementwise", "activation"])
    assert compiler.missing_families("sm_90a") == ["fill", "elementwise", "activation"]
    assert sorted(compiler.ensure_compiled("sm_90a", progress=False)) == ["activation", "elementwise", "fill"]
    assert compiler.missing_families("sm_90a") == [] and compiler.ensure_compiled("sm_90a") == []


def test_compile_families_raises_after_running_all(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "good.cu").write_text('extern "C" __global__ void k() {}\n')
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { nope(); }\n')
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    done = []
    with pytest.raises(CompileError, match="bad.cu"):
        compile_families(["bad", "good"], "sm_90a", on_done=lambda f, s, e: done.append((f, e is None)))
    assert sorted(done) == [("bad", False), ("good", True)] and compiler.missing_families("sm_90a") == ["bad"]
