"""Runtime benchmark: device ceilings, our cuBLASLt GEMM against torch.matmul on the same shapes, Python-side
launch cost, and cold/warm kernel loading. Prints the device name; absolute numbers hold only for it.

    python -m tools.bench_runtime [--skip-torch]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np

from tools._bench_util import copy_bandwidth_gbs, gemm_tflops, torch_graph_median, torch_median

# Qwen3-8B projections (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288): (name, N, K)
GEMM_SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096), ("down_proj", 4096, 12288)]
DECODE_M = [1, 8, 16, 32, 64]
PREFILL_M = 8192


def bench_gemm(vs_torch: bool) -> None:
    from xserv.ops.linear import linear
    from xserv.runtime.timing import benchmark, benchmark_graph
    from xserv.tensor import Tensor, bfloat16

    rng = np.random.default_rng(0)
    torch = None
    if vs_torch:
        try:
            import torch
        except ImportError:
            print("(PyTorch not importable: no peer)")
    print(f"\n{'GEMM':14s} {'M':>5s} {'N':>6s} {'K':>6s} {'xserv us':>9s} {'TFLOP/s':>8s} {'GB/s':>6s}" + (f" {'torch us':>9s} {'xserv/torch':>11s}" if torch else ""))
    for name, n, k in GEMM_SHAPES:
        # Enough weight copies that rotating through them leaves L2 (50-60 MB on Hopper).
        copies = max(2, int(np.ceil(200e6 / (n * k * 2))))
        w_np = [(rng.standard_normal((n, k), np.float32) * 0.02).astype(bfloat16) for _ in range(min(copies, 4))]
        ws = [Tensor.from_numpy(w_np[i % len(w_np)]) for i in range(copies)]
        tw = [torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).cuda() for w in w_np] if torch else []
        tws = [tw[i % len(tw)].clone() for i in range(copies)] if torch else []
        for m in DECODE_M + [PREFILL_M]:
            if m == PREFILL_M and name in ("qkv_proj", "o_proj"):
                continue
            x_np = rng.standard_normal((m, k), np.float32).astype(bfloat16)
            x = Tensor.from_numpy(x_np)
            out = Tensor.empty((m, n), bfloat16)
            # Decode-sized GEMMs take ~10-50 us, close to the host's cost of issuing them, so both sides are
            # timed as CUDA-graph replays (as the engine runs its decode step); prefill ones as plain launches.
            fns = [lambda w=w: linear(x, w, out) for w in ws]
            ms = benchmark_graph(fns) if m < PREFILL_M else benchmark(fns, warmup=3, iters=10, inner=3)
            flops = 2 * m * n * k
            nbytes = 2 * (m * k + n * k + m * n)
            row = f"{name:14s} {m:5d} {n:6d} {k:6d} {ms * 1e3:9.1f} {flops / ms / 1e9:8.1f} {nbytes / ms / 1e6:6.0f}"
            if torch:
                tx = torch.from_numpy(x_np.view(np.int16)).view(torch.bfloat16).cuda()
                tout = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                fns = [lambda w=w: torch.matmul(tx, w.t(), out=tout) for w in tws]
                tms = torch_graph_median(torch, fns) if m < PREFILL_M else torch_median(torch, fns, 3, 10, 3)
                row += f" {tms * 1e3:9.1f} {tms / ms:10.2f}x"
            print(row)


def bench_launch() -> None:
    from xserv.runtime import get_device, kernel, synchronize
    from xserv.tensor import Tensor, float32

    out = Tensor.empty((256,), float32)
    fill = kernel("fill", "fill_f32")
    args = (np.float32(1.0), np.int64(256))
    for _ in range(100):
        fill((1,), (256,), out, *args)
    synchronize()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        fill((1,), (256,), out, *args)
    host = (time.perf_counter() - t0) / n * 1e6
    synchronize()
    # The floor: a bare cuda.core launch with a prebuilt config, as measured by cuda-python's own users.
    from cuda.core import LaunchConfig, launch

    config = LaunchConfig(grid=(1,), block=(256,), shmem_size=0)
    stream, core = get_device().stream, fill._kernel
    t0 = time.perf_counter()
    for _ in range(n):
        launch(stream, config, core, out.ptr, *args)
    bare = (time.perf_counter() - t0) / n * 1e6
    synchronize()
    print(f"\nlaunch, Python-side cost per call: xserv Kernel {host:.2f} us, bare cuda.core launch {bare:.2f} us")


def bench_loading() -> None:
    """Cold: every family compiled by NVRTC here, bypassing the cache. Warm: a fresh process with the cache
    populated creates the runtime and loads every family's cubin (what `xserv` pays at start)."""
    from xserv.runtime import get_device
    from xserv.runtime.compiler import compile_family, list_families

    families = list_families()
    arch = get_device().arch
    t0 = time.perf_counter()
    for family in families:
        compile_family(family, arch, use_cache=False)
    cold = time.perf_counter() - t0
    for family in families:  # make sure the disk cache holds every family
        compile_family(family, arch)
    code = (
        "import time; t=time.perf_counter();"
        "from xserv.runtime import get_runtime; from xserv.runtime.compiler import list_families;"
        "rt=get_runtime(); t1=time.perf_counter();"
        "[rt.kernels.load_family(f) for f in list_families()];"
        "print(f'{t1-t:.3f} {time.perf_counter()-t1:.3f}')"
    )
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ctx, load = map(float, warm.stdout.split())
    print(f"\nkernel loading ({len(families)} families, {arch}): cold NVRTC compile of all {cold:.1f} s; "
          f"warm start (disk cache) loads all in {load:.3f} s after {ctx:.2f} s of context creation")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-torch", action="store_true")
    args = p.parse_args()
    from xserv.runtime import get_device, get_runtime

    dev = get_device()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs), cuBLASLt {get_runtime().cublas.version()}")
    print(f"ceilings: copy {copy_bandwidth_gbs():.0f} GB/s (read+write), cuBLAS bf16 GEMM 8192^3 {gemm_tflops():.0f} TFLOP/s")
    bench_launch()
    bench_loading()
    bench_gemm(not args.skip_torch)


if __name__ == "__main__":
    main()
