"""The runtime's compiler without a GPU: the disk cache and its key, the per-arch family lists, the forced-target
form, compile errors that name the file and line, and the machine code sizes the harness prints.

That every family compiles for every arch CI covers (sm_80, sm_89, sm_90a, sm_100a, sm_120a) is CI's own step
(`.ci/run`: `python -m tools.kernel_harness compile`, one line per family and arch that fails): a few CPU-minutes
that do not belong in the test command a user runs."""
import pytest

from xserv.runtime import CompileError
from xserv.runtime.compiler import (cache_key, compile_families, compile_family, families_for, family_source,
                                    kernel_code_sizes, list_dev_families, list_families, ptx_to_cubin,
                                    startup_families)

from tools.kernel_harness import CI_ARCHES

# sm_90a's start-up pieces for a Qwen3-0.6B-shaped model (head_dim 128, 2 query heads per kv head: what
# DenseModel.kernel_shapes gives for it).
QWEN3_0_6B = {"head_dim": 128, "group": 2}
PIECES = [p for p in startup_families("sm_90a", QWEN3_0_6B) if ":" in p]


def test_every_family_is_compiled_for_every_arch_that_admits_it():
    assert families_for("sm_90a") == list_families()
    assert PIECES == ["attention_decode:d128_g2", "attention_decode_v2:d128_g2", "gemv:m1_p0", "gemv:m8_p0",
                      "gemv:m8_p1", "sampling:v1"]
    for arch in CI_ARCHES:
        assert set(list_families()) - set(families_for(arch)) <= {"attention_prefill_sm90", "moe_sm90"}


def test_small_families_compile_for_every_ci_arch(tmp_path, monkeypatch):
    """The cheap end of CI's compile step, in the test command: a .cu and a .ptx family for each arch."""
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    for arch in CI_ARCHES:
        for family in ("fill", "activation"):
            assert compile_family(family, arch)[:4] == b"\x7fELF"  # a cubin is an ELF image, not PTX text


@pytest.mark.parametrize("target", ["sm_80@sm_90a", "sm_89@sm_120a"])
def test_forced_targets_assemble_lower_code_for_the_device(target, tmp_path, monkeypatch):
    """XSERV_ARCH's form: the sm_80 code (NVRTC to compute_80 PTX, activation.ptx without griddepcontrol) in a cubin
    for the device's arch."""
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    for family in ("fill", "embedding", "activation"):
        assert compile_family(family, target)[:4] == b"\x7fELF"
    assert list(tmp_path.rglob(f"activation-{target}-*.cubin"))


def test_ptx_family_ships_its_kernels():
    assert family_source("activation").suffix == ".ptx"
    cubin = compile_family("activation", "sm_90a")
    for name in ("silu_and_mul_bf16_vec", "silu_and_mul_bf16_scalar"):
        assert b"\0" + name.encode() + b"\0" in cubin  # in the cubin's symbol names


@pytest.mark.slow  # compiles three gemv pieces for sm_90a: ~8 CPU-s
def test_decode_chain_gemv_entries_stay_small():
    """kernel_code_sizes reads each entry's machine code from the cubin. The GEMV entries of the decode chain carry
    only their own prologue and epilogue: one generic entry (62 KB) cost 3-4% of a batch-1 step, each launch running
    its code from a cold instruction cache (docs/kernels/gemv.md, "Decisions"; the measurement in
    docs/kernels/history/gemv.md, "code size")."""
    sizes = {}
    for name in ("gemv:m1_p0", "gemv:m8_p0", "gemv:m8_p1"):  # the start-up's pieces of gemv
        sizes.update(kernel_code_sizes(compile_family(name, "sm_90a")))
    sizes.update(kernel_code_sizes(compile_family("gemv:m16_p0", "sm_90a")))  # first use: 9..16 rows
    row = ["gemv_row_rmsnorm_bf16", "gemv_row_bf16_add", "gemv_row_rmsnorm_silu_mul", "gemv_row_rmsnorm_f32"]
    chain = row + [name + "_1step" for name in row] + ["gemv_mma_m8_bf16_bf16", "gemv_mma_m16_bf16_bf16"]
    assert all(0 < sizes[name] < 48 * 1024 for name in chain), {name: sizes.get(name) for name in chain}
    assert sizes["gemv_mma_m8_bf16_bf16"] * 3 < sizes["gemv_mma_m8"]  # the generic entry: every path inline
    assert set(kernel_code_sizes(compile_family("activation", "sm_90a"))) >= {"silu_and_mul_bf16_vec"}  # nvJitLink's cubins too
    with pytest.raises(ValueError, match="ELF"):
        kernel_code_sizes(b"not a cubin")


def test_harness_prints_the_sizes(capsys):
    from tools.kernel_harness import main

    assert main(["sizes", "gemv:m8_p0", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "gemv_mma_m8_bf16_bf16" in out and " KB" in out
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
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: src)
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
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
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
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
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
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
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
    monkeypatch.setattr("xserv.runtime.sources.list_families", lambda: ["fill", "elementwise", "activation"])
    assert compiler.missing_families("sm_90a") == ["fill", "elementwise", "activation"]
    assert sorted(compiler.ensure_compiled("sm_90a", progress=False)) == ["activation", "elementwise", "fill"]
    assert compiler.missing_families("sm_90a") == [] and compiler.ensure_compiled("sm_90a") == []


def test_compile_families_raises_after_running_all(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "good.cu").write_text('extern "C" __global__ void k() {}\n')
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { nope(); }\n')
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    done = []
    with pytest.raises(CompileError, match="bad.cu"):
        compile_families(["bad", "good"], "sm_90a", on_done=lambda f, s, e: done.append((f, e is None)))
    assert sorted(done) == [("bad", False), ("good", True)] and compiler.missing_families("sm_90a") == ["bad"]


def test_harness_compile_names_the_family_and_arch_that_fail(tmp_path, monkeypatch, capsys):
    """CI's compile step: a family that does not compile for an arch is one line naming both, the others still
    compile, and the exit status says so."""
    import xserv.runtime.compiler as compiler
    from tools.kernel_harness import main

    (tmp_path / "good.cu").write_text('extern "C" __global__ void k() {}\n')
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { nope(); }\n')
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["compile", "--arch", "sm_80,sm_120a", "--fast"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  bad (sm_80)" in out and "FAIL  bad (sm_120a)" in out and "nope" in out
    assert out.count("ok    good") == 2 and "1/2 compiled for sm_120a" in out
    assert not (tmp_path / "cache").exists()  # --fast cubins are never the runtime's: not cached
