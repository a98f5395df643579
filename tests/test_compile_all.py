"""Every kernel family compiles to an sm_90a cubin (no GPU needed), and the disk cache works."""
import pytest

from xserv.runtime import CompileError
from xserv.runtime.compiler import cache_key, compile_family, list_families


@pytest.mark.parametrize("family", list_families())
def test_family_compiles_for_hopper(family, tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    cubin = compile_family(family, "sm_90a")
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF image, not PTX text
    assert list(tmp_path.rglob("*.cubin"))


def test_cache_hit_returns_same_bytes_and_key_changes_with_options(tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    first = compile_family("fill", "sm_90a")
    (cached,) = tmp_path.rglob("*.cubin")
    cached.write_bytes(b"sentinel")  # a warm start must read the cache, not recompile
    assert compile_family("fill", "sm_90a") == b"sentinel"
    assert compile_family("fill", "sm_90a", use_cache=False) == first
    assert cache_key("fill", "sm_90a", ("-O3",)) != cache_key("fill", "sm_90a", ())
    assert cache_key("fill", "sm_80", ()) != cache_key("fill", "sm_90a", ())


def test_compile_error_carries_the_nvrtc_log(tmp_path, monkeypatch):
    import xserv.runtime.compiler as compiler

    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k() { undefined_thing(); }\n')
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(CompileError, match=r"broken.cu.*undefined_thing"):
        compiler.compile_family("broken", "sm_90a")


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
    monkeypatch.setattr(compiler, "list_families", lambda: ["fill", "elementwise"])
    assert compiler.missing_families("sm_90a") == ["fill", "elementwise"]
    assert sorted(compiler.ensure_compiled("sm_90a", progress=False)) == ["elementwise", "fill"]
    assert compiler.missing_families("sm_90a") == [] and compiler.ensure_compiled("sm_90a") == []
