"""Runtime benchmark: device ceilings, our cuBLASLt GEMM against torch.matmul on the same shapes, Python-side
launch cost, and cold/warm kernel loading. Prints the device name; absolute numbers hold only for it.

    python -m tools.bench_runtime [--skip-torch] [--only launch,loading,gemm]
    python -m tools.bench_runtime --only host [--calls 2000 --repeats 31]   # no GPU needed
    python -m tools.bench_runtime --only host --against /path/to/other/checkout [--rounds 6]

`--only host` measures the Python side of an eager op alone, on any machine: the runtime is built over a fake
driver (cuLaunchKernel / cuLaunchKernelEx / cuMemAlloc are no-ops, no context, no cubins), so what is timed is
xserv's own work per call: checks, Tensor allocation, argument packing, the Kernel call. It cannot be combined
with the GPU sections (it replaces the runtime of its process). `--against` runs it in fresh processes, alternating
this checkout with another one (say `git worktree add /tmp/before <commit>`) round after round, and prints each
line's median per checkout and the median of the per-round ratios: on a noisy machine the pairs share its state.
"""
from __future__ import annotations

import argparse
import statistics
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


def _per_call_us(fn, sync, calls: int = 200, repeats: int = 40) -> float:
    """Host time to issue one call: `calls` back-to-back calls timed until the last returns (not synchronised, so
    a GPU slower than the host does not show; 200 launches stay well inside the driver's queue), the stream drained
    between batches, median of `repeats` batches."""
    for _ in range(200):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(times)


def _rate(us: float) -> str:
    return f"{us:6.2f} us ({1e3 / us:5.0f}k/s)"


def _driver_floor(fill, out, sync) -> float:
    """A bare cuLaunchKernel of the same kernel with its parameters packed once: the floor under any Python launcher."""
    import ctypes

    from cuda.bindings import driver

    handle = fill._kernel.handle
    func = driver.cuKernelGetFunction(handle)[1] if isinstance(handle, driver.CUkernel) else handle
    from xserv.runtime import get_device

    stream = driver.CUstream(get_device().stream_handle)
    values = (ctypes.c_uint64(out.ptr), ctypes.c_float(1.0), ctypes.c_int64(256))
    params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in values])
    addr = ctypes.addressof(params)
    return _per_call_us(lambda: driver.cuLaunchKernel(func, 1, 1, 1, 256, 1, 1, 0, stream, addr, 0), sync)


def bench_launch(vs_torch: bool) -> None:
    """Eager launch cost: the raw Kernel call (no op checks) against the driver floor and cuda.core's launch, then
    whole ops (checks, output allocation, launch) against PyTorch eager on the same shapes."""
    from xserv.ops.elementwise import add
    from xserv.ops.rmsnorm import rmsnorm
    from xserv.runtime import get_device, kernel, synchronize
    from xserv.runtime.timing import benchmark_graph
    from xserv.tensor import Tensor, bfloat16, float32

    torch = None
    if vs_torch:
        try:
            import torch
        except ImportError:
            print("(PyTorch not importable: no peer)")
    dev = get_device()
    out = Tensor.empty((256,), float32)
    fill = kernel("fill", "fill_f32")
    value, n = np.float32(1.0), np.int64(256)
    print(f"\neager launch cost on {dev.name}, Python {sys.version.split()[0]}: host time to issue one call (batches of 200 "
          "back-to-back calls, median of 40)")
    print(f"  Kernel call, fill_f32 1x256 (no op checks): {_rate(_per_call_us(lambda: fill(1, 256, out, value, n), synchronize))}")
    try:
        fill(1, 256, out, value, n, pdl=True)
        print(f"  Kernel call with pdl=True:                  {_rate(_per_call_us(lambda: fill(1, 256, out, value, n, pdl=True), synchronize))}")
    except TypeError:  # a launcher without the pdl option
        pass
    print(f"  bare cuLaunchKernel, params packed once:    {_rate(_driver_floor(fill, out, synchronize))}")
    from cuda.core import LaunchConfig, launch

    config = LaunchConfig(grid=(1,), block=(256,), shmem_size=0)
    stream, core = dev.stream, fill._kernel
    print(f"  bare cuda.core launch, prebuilt config:     {_rate(_per_call_us(lambda: launch(stream, config, core, out.ptr, value, n), synchronize))}")
    if torch:
        tt = torch.empty(256, device="cuda")
        print(f"  torch: t.fill_(1.0) on 256 floats:          {_rate(_per_call_us(lambda: tt.fill_(1.0), torch.cuda.synchronize))}")

    rng = np.random.default_rng(0)
    cases = [("add", (1, 4096)), ("rmsnorm", (1, 1024)), ("rmsnorm", (256, 4096))]
    print(f"\n{'eager op':10s} {'shape':>9s} {'GPU us':>7s} {'xserv, out given':>23s} {'xserv, allocating':>23s}" +
          (f" {'torch, allocating':>23s} {'torch/xserv':>11s}" if torch else ""))
    for op, shape in cases:
        a_np = (rng.standard_normal(shape, np.float32) + 0.3).astype(bfloat16)
        b_np = (rng.standard_normal(shape[-1:] if op == "rmsnorm" else shape, np.float32) + 1).astype(bfloat16)
        a, b, o = Tensor.from_numpy(a_np), Tensor.from_numpy(b_np), Tensor.empty(shape, bfloat16)
        if op == "add":
            given, alloc = (lambda: add(a, b, o)), (lambda: add(a, b))
        else:
            given, alloc = (lambda: rmsnorm(a, b, 1e-6, o)), (lambda: rmsnorm(a, b, 1e-6))
        us_given, us_alloc = _per_call_us(given, synchronize), _per_call_us(alloc, synchronize)
        gpu_us = benchmark_graph([given]) * 1e3  # the kernel's own time, without the host: is the GPU the bound?
        row = f"{op:10s} {'x'.join(map(str, shape)):>9s} {gpu_us:7.2f} {_rate(us_given):>23s} {_rate(us_alloc):>23s}"
        if torch:
            ta = torch.from_numpy(a_np.view(np.int16)).view(torch.bfloat16).cuda()
            tb = torch.from_numpy(b_np.view(np.int16)).view(torch.bfloat16).cuda()
            if op == "add":
                tfn = lambda: ta + tb  # noqa: E731
            elif hasattr(torch.nn.functional, "rms_norm"):
                tfn = lambda: torch.nn.functional.rms_norm(ta, (shape[-1],), tb, 1e-6)  # noqa: E731
            else:
                tfn = None
            if tfn is not None:
                us_torch = _per_call_us(tfn, torch.cuda.synchronize)
                row += f" {_rate(us_torch):>23s} {us_torch / us_alloc:10.2f}x"
        print(row)
    print("(GPU us: the op's kernel time from a CUDA-graph replay; torch/xserv > 1: xserv issues the op faster, "
          "both allocating their output)")


# ---- the Python side alone, over a fake driver (no GPU): tools/dev/host_runtime.py ---------------------------
def _host_ns(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(median, min) over `repeats` batches of `calls` back-to-back calls, in ns per call."""
    for _ in range(calls):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(times), min(times)


def bench_host(calls: int = 2000, repeats: int = 31) -> dict[str, float]:
    """The Python side of eager launches, timed over the fake driver (tools/dev/host_runtime.py). Returns the medians
    (ns per call) by name, and prints them with the minimum of the batches."""
    from tools.dev.host_runtime import install

    install()
    from xserv.ops.elementwise import add
    from xserv.ops.rmsnorm import fused_add_rmsnorm, rmsnorm
    from xserv.runtime import kernel
    from xserv.runtime import kernels as K
    from xserv.tensor import Tensor, bfloat16, float32

    a, b, o = (Tensor.empty((1, 4096), bfloat16) for _ in range(3))
    x, w, y = Tensor.empty((1, 1024), bfloat16), Tensor.empty((1024,), bfloat16), Tensor.empty((1, 1024), bfloat16)
    res = Tensor.empty((1, 1024), bfloat16)
    x256, w4k = Tensor.empty((256, 4096), bfloat16), Tensor.empty((4096,), bfloat16)
    fill, fout = kernel("fill", "fill_f32"), Tensor.empty((256,), float32)
    value, n = np.float32(1.0), np.int64(256)
    nop = K._cuLaunchKernel
    success_args = (0x1234, 1, 1, 1, 256, 1, 1, 0, 0x5150, 0, 0)
    cases = [
        ("no-op driver call (the fake cuLaunchKernel itself)", lambda: nop(*success_args)),
        ("Kernel call, fill_f32 (3 arguments, no op checks)", lambda: fill(1, 256, fout, value, n)),
        ("Kernel call, fill_f32, (1,) / (256,) tuples", lambda: fill((1,), (256,), fout, value, n)),
        ("Tensor.empty((1, 4096), bf16) incl. release", lambda: Tensor.empty((1, 4096), bfloat16)),
        ("add(a, b, out) 1x4096 bf16", lambda: add(a, b, o)),
        ("add(a, b) 1x4096 bf16, allocating", lambda: add(a, b)),
        ("rmsnorm(x, w, eps, out) 1x1024", lambda: rmsnorm(x, w, 1e-6, y)),
        ("rmsnorm(x, w, eps) 1x1024, allocating", lambda: rmsnorm(x, w, 1e-6)),
        ("rmsnorm(x, w, eps) 256x4096, allocating", lambda: rmsnorm(x256, w4k, 1e-6)),
        ("fused_add_rmsnorm(x, res, w, eps) 1x1024, allocating", lambda: fused_add_rmsnorm(x, res, w, 1e-6)),
    ]
    print(f"host-side Python per call, fake driver (no GPU), Python {sys.version.split()[0]}; "
          f"batches of {calls} calls, median (min) of {repeats}, ns")
    results = {}
    for name, fn in cases:
        med, low = _host_ns(fn, calls, repeats)
        results[name] = med
        print(f"  {name:52s} {med:8.0f} ({low:6.0f})")
    return results


def compare_host(other: str, rounds: int, calls: int, repeats: int) -> None:
    """bench_host in fresh processes pinned to one core, this checkout and `other` alternating (each round runs
    both, the order swapped every round); prints the medians and the median of the per-round ratios (this / other)."""
    import json
    import os
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[1])
    # the other checkout's xserv, this checkout's benchmark and host runtime (the other may predate them)
    code = ("import importlib.util, json, runpy, sys; sys.path.insert(0, sys.argv[1]);"
            "spec = importlib.util.spec_from_file_location('tools.dev.host_runtime', sys.argv[5]);"
            "sys.modules[spec.name] = module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module);"
            "bench = runpy.run_path(sys.argv[2]);"
            "print(json.dumps(bench['bench_host'](int(sys.argv[3]), int(sys.argv[4]))))")
    trees = {"this": here, "other": str(Path(other).resolve())}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def pin():  # both checkouts on the same core (the last one allowed): no migrations inside a timed batch
        if cpus:
            os.sched_setaffinity(0, {cpus[-1]})

    results = {name: [] for name in trees}
    for r in range(rounds):
        for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
            env = dict(os.environ, PYTHONPATH=trees[name])
            out = subprocess.run([sys.executable, "-c", code, trees[name], __file__, str(calls), str(repeats),
                                  str(Path(__file__).parent / "dev" / "host_runtime.py")],
                                 capture_output=True, text=True, cwd=trees[name], env=env, check=True,
                                 preexec_fn=pin)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\nhost-side ns per call, Python {sys.version.split()[0]}, {rounds} alternating rounds: this = {here}, "
          f"other = {trees['other']}")
    print(f"  {'':52s} {'other':>8s} {'this':>8s} {'this/other':>10s}")
    for case in results["this"][0]:
        this = [run[case] for run in results["this"]]
        that = [run.get(case, float("nan")) for run in results["other"]]
        ratio = statistics.median(a / b for a, b in zip(this, that))
        print(f"  {case:52s} {statistics.median(that):8.0f} {statistics.median(this):8.0f} {ratio:10.2f}")


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
    p.add_argument("--only", default="launch,loading,gemm",
                   help="comma-separated sections: launch (eager launch cost), loading (kernel compile/load), gemm; "
                        "or host alone (the Python side of eager launches over a fake driver, no GPU needed)")
    p.add_argument("--calls", type=int, default=2000, help="host: calls per timed batch")
    p.add_argument("--repeats", type=int, default=31, help="host: timed batches (the median is printed)")
    p.add_argument("--against", metavar="CHECKOUT", help="host: compare with another checkout, alternating processes")
    p.add_argument("--rounds", type=int, default=6, help="host --against: alternating rounds")
    args = p.parse_args()
    sections = set(args.only.split(","))
    known = {"launch", "loading", "gemm", "host"}
    if sections - known:
        p.error(f"--only: unknown section(s) {sorted(sections - known)}")
    if "host" in sections:
        if sections != {"host"}:
            p.error("--only host replaces the process's runtime with a fake driver: run it alone")
        if args.against:
            compare_host(args.against, args.rounds, args.calls, args.repeats)
        else:
            bench_host(args.calls, args.repeats)
        return
    from xserv.runtime import get_device, get_runtime

    dev = get_device()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs), cuBLASLt {get_runtime().cublas.version()}")
    if sections & {"loading", "gemm"}:  # the GEMM table's ceilings; the launch costs have none
        print(f"ceilings: copy {copy_bandwidth_gbs():.0f} GB/s (read+write), cuBLAS bf16 GEMM 8192^3 {gemm_tflops():.0f} TFLOP/s")
    if "launch" in sections:
        bench_launch(not args.skip_torch)
    if "loading" in sections:
        bench_loading()
    if "gemm" in sections:
        bench_gemm(not args.skip_torch)


if __name__ == "__main__":
    main()
