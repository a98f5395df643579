"""What pip installs: the CPU-only install README offers (requirements-cpu.txt, then the package without its
dependencies) stays in step with pyproject.toml and runs the CPU backend without the GPU-only packages."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen3_reference import tiny_model_dir  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = ("cuda-core", "nvmath-python", "nvidia-")  # the 1 GB that a CPU-only user can leave out


def _requirement_lines(lines):
    return sorted(line.split("#")[0].strip() for line in lines if line.split("#")[0].strip())


def test_cpu_requirements_are_pyproject_less_the_gpu_packages():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    want = _requirement_lines(d for d in deps if not d.lower().startswith(GPU_ONLY))
    got = _requirement_lines((ROOT / "requirements-cpu.txt").read_text().splitlines())
    assert got == want


def test_cpu_backend_runs_without_the_gpu_only_packages(tiny_model_dir):  # noqa: F811
    """A fault that imports nvmath, cuda.core or an NVIDIA wheel's module on the CPU path (at `import xserv`, at
    load, or in a generate) turns this red: the child refuses those imports, as the CPU-only install lacks them."""
    code = textwrap.dedent(f"""
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nvmath", "nvidia") or name.startswith("cuda.core"):
                    raise ImportError(f"{{name}} is not installed (CPU-only install)")

        sys.meta_path.insert(0, Refuse())
        from xserv import LLM, SamplingParams

        with LLM({str(tiny_model_dir)!r}, device="cpu") as llm:
            out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 3, out
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_wheel_carries_every_package_and_preset_file():
    """Every folder of xserv/ with an __init__.py is a listed package, and every file under xserv/presets/ (the
    bundled tokenizers and presets) matches a package-data pattern: red when a new package or tokenizer folder
    would be left out of a non-editable install."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "xserv").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found <= packages, f"packages missing from pyproject.toml: {sorted(found - packages)}"
    presets = ROOT / "xserv" / "presets"
    patterns = setuptools["package-data"]["xserv.presets"]
    data = [p.relative_to(presets).as_posix() for p in presets.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"]
    assert "tokenizer_qwen3_5/tokenizer.json" in data and "tokenizer/tokenizer.json" in data

    def matches(path, pattern):  # setuptools' glob: a * stays inside one folder (fnmatch's would cross "/")
        parts, pat = path.split("/"), pattern.split("/")
        return len(parts) == len(pat) and all(fnmatch.fnmatch(a, b) for a, b in zip(parts, pat))

    left_out = [f for f in data if not any(matches(f, pat) for pat in patterns)]
    assert not left_out, f"files under xserv/presets that the wheel would leave out: {left_out}"
