"""`xserv info` on a machine without a GPU (CPU test: the GPU is hidden where there is one) and, marked gpu, on the
lent GPU."""
import json

import pytest

from xserv.cli import main


def _no_gpu(monkeypatch):
    import xserv.runtime.device as device

    monkeypatch.setattr(device, "device_count", lambda: 0)


def test_info_without_a_gpu(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    (tmp_path / "cubin").mkdir()
    (tmp_path / "cubin" / "fill-sm_90a-0123.cubin").write_bytes(b"x" * 2048)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "--device cpu" in out
    for label in ("driver:", "NVRTC:", "nvJitLink:", "cuBLAS:", "packages:"):
        assert label in out, label
    assert f"kernel cache: {tmp_path / 'cubin'} (1 cubins, 2.0 KiB; for sm_90a)" in out
    from xserv.runtime.compiler import nvrtc_version

    assert f"NVRTC:        {'.'.join(map(str, nvrtc_version()))}" in out


def test_info_json_without_a_gpu(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gpu_count"] == 0 and info["gpus"] == []
    assert info["cache"] == {"dir": str(tmp_path / "cubin"), "files": 0, "bytes": 0, "targets": []}
    assert set(info["versions"]) == {"driver", "nvrtc", "nvjitlink", "cublas", "cuda-bindings", "cuda-core",
                                     "nvmath-python"}


@pytest.mark.gpu
def test_info_on_the_gpu(capsys):
    """The lent GPU: name, compute capability, target and path as the runtime picks them, memory, versions; after a
    start-up (ensure_compiled) every start-up kernel of the target is cached."""
    from xserv.runtime import get_device
    from xserv.runtime.arch import arch_path
    from xserv.runtime.compiler import ensure_compiled

    dev = get_device()
    ensure_compiled(dev.arch, progress=False)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    gpu = info["gpus"][0]
    assert gpu["name"] == dev.name and gpu["target"] == dev.arch and gpu["error"] is None
    assert gpu["compute_capability"] == ".".join(map(str, dev.info.compute_capability))
    assert gpu["kernel_path"] == arch_path(dev.arch).value
    assert 0 < gpu["memory"]["free_bytes"] <= gpu["memory"]["total_bytes"]
    assert info["versions"]["driver"].startswith("CUDA ") and info["versions"]["cublas"][0].isdigit()
    assert info["cache"]["target"] == dev.arch and info["cache"]["startup_missing"] == []
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    print(out)  # what a bug report would carry, in the test log
    assert dev.name in out and f"target {dev.arch}" in out and "start-up kernels for" in out and "all " in out
