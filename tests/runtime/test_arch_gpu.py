"""Kernel paths on the GPU: the device's target follows XSERV_ARCH, the portable path forced on a newer GPU
(XSERV_ARCH=sm_80 on an H100) compiles and runs, launches no PDL, and gives the model's logits the native path gives.
The whole GPU suite is the other half: run it once natively and once with XSERV_ARCH=sm_80 (docs/runtime.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen3_reference import perturbed_model_dir, rel_err_rows  # noqa: F401

pytestmark = pytest.mark.gpu
BLOCK = 4


def test_device_target_follows_xserv_arch():
    from xserv.runtime import get_device
    from xserv.runtime.arch import arch_path, pdl_enabled, select_target
    from xserv.runtime.compiler import startup_families

    dev = get_device()
    cc = dev.info.compute_capability
    assert dev.arch == select_target(cc, dev.name, os.environ.get("XSERV_ARCH"))
    print(f"{dev.name} ({cc[0]}.{cc[1]}): target {dev.arch}, {arch_path(dev.arch).value} path, "
          f"PDL {'on' if pdl_enabled(dev.arch) else 'off'}, families {startup_families(dev.arch)}")


def test_startup_families_load_and_pdl_matches_the_path():
    from xserv.runtime import get_device, get_runtime, kernel
    from xserv.runtime.arch import pdl_enabled
    from xserv.runtime.compiler import ensure_compiled, startup_families

    dev = get_device()
    shapes = {"head_dim": 128, "group": 4}  # a Qwen3-8B-shaped model's pieces (runtime/compiler.py kernel_shapes)
    ensure_compiled(dev.arch, progress=False, shapes=shapes)
    for family in startup_families(dev.arch, shapes):
        get_runtime().kernels.load_family(family)  # every cubin loads on this device
    assert kernel("fill", "fill_f32")._pdl_supported == pdl_enabled(dev.arch)


def _logits(folder: str) -> dict:
    """Prefill of three packed sequences, then two decode steps, on the CUDA model: the logits of each forward."""
    from xserv.engine.batch import SeqChunk, make_batch
    from xserv.engine.kv_cache import KVCache, KVCacheSpec
    from xserv.models.registry import load_model
    from xserv.runtime import get_device

    rng = np.random.default_rng(28)
    gpu = load_model(folder, "cuda", progress=False, max_positions=512)
    v = gpu.config.vocab_size
    seqs = [rng.integers(0, v, n).tolist() for n in (37, 5, 70)]
    tables = [[3, 9, 1, 12, 20, 21, 22, 23, 24, 25], [0, 2], list(range(30, 50))]
    cache = KVCache(KVCacheSpec(*gpu.kv_layout, BLOCK), 64, "cuda", gpu.dtype)
    out = {"arch": get_device().arch}
    chunks = [SeqChunk(s[:-2], 0, t, "all") for s, t in zip(seqs, tables)]
    out["prefill"] = gpu.forward(make_batch(chunks, BLOCK, "cuda"), cache).numpy().astype(np.float32).tolist()
    for step in (2, 1):
        chunks = [SeqChunk(s[-step:][:1], len(s) - step, t, "last") for s, t in zip(seqs, tables)]
        out[f"decode{step}"] = gpu.forward(make_batch(chunks, BLOCK, "cuda"), cache).numpy().astype(np.float32).tolist()
    return out


def _logits_in_process(folder, env_arch: str | None, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XSERV_ARCH"}
    if env_arch:
        env["XSERV_ARCH"] = env_arch
    out = tmp_path / f"logits-{env_arch or 'native'}.json"
    tests = str(Path(__file__).parents[1])  # the shared test helpers (qwen3_reference) live there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, __file__, str(folder), str(out)], check=True, env=env, cwd=tests, timeout=900)
    return json.loads(out.read_text())


def test_forced_portable_path_matches_native_logits(perturbed_model_dir, tmp_path):  # noqa: F811
    """The model on XSERV_ARCH=sm_80 (mma.sync prefill v3, no PDL) against the native path, each in its own process:
    the tolerance of the model's GPU tests (3e-2 relative per row against NumPy; the two CUDA paths round at the
    same points and sum in other orders)."""
    from xserv.runtime import get_device

    cc = get_device().info.compute_capability
    if cc < (9, 0):
        pytest.skip(f"the device ({cc}) runs the portable path natively")
    native = _logits_in_process(perturbed_model_dir, None, tmp_path)
    forced = _logits_in_process(perturbed_model_dir, "sm_80", tmp_path)
    assert "@" not in native["arch"] and forced["arch"].startswith("sm_80@")
    for key in ("prefill", "decode2", "decode1"):
        a, b = np.asarray(native[key]), np.asarray(forced[key])
        assert np.all(np.isfinite(b)), key
        err = rel_err_rows(b, a).max()
        print(f"{key}: {native['arch']} vs {forced['arch']}: {err:.2e}")
        assert err < 3e-2, key


if __name__ == "__main__":  # the child process of test_forced_portable_path_matches_native_logits
    Path(sys.argv[2]).write_text(json.dumps(_logits(sys.argv[1])))
