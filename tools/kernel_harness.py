"""The kernel harness: list, compile, check and benchmark xserv's kernels one by one.

    python -m tools.kernel_harness list
    python -m tools.kernel_harness compile [--arch sm_90a]          # no GPU needed
    python -m tools.kernel_harness check OP [--shapes 8192x4096,1x128] [--seed N]
    python -m tools.kernel_harness bench OP [--shapes ...] [--vs torch]
    python -m tools.kernel_harness ceilings                          # copy bandwidth and a large cuBLAS GEMM

`check` draws fresh random inputs, poisons the outputs, runs the CUDA op and compares it with the op's NumPy
reference in float64 (relative L2 error). `bench` times the op with CUDA events (warm-up, median, rotating
input sets larger than L2) and reports GB/s or TFLOP/s against the device's own ceilings measured in the same
run; `--vs torch` also times the PyTorch equivalent and prints the ratio.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _specs():
    from tools.harness_specs import all_specs

    return all_specs()


def parse_shapes(text: str | None) -> list[tuple] | None:
    if not text:
        return None
    shapes = []
    for item in text.split(","):
        try:
            shapes.append(tuple(int(v) for v in item.lower().split("x")))
        except ValueError:
            raise SystemExit(f"--shapes: cannot parse {item!r}; write shapes like 8192x4096,1x128")
    return shapes


def cmd_list(args) -> int:
    from xserv.runtime.compiler import list_families

    specs = _specs()
    families = list_families()
    print(f"{'op':28s} {'family':20s} kernels")
    for name, spec in specs.items():
        print(f"{name:28s} {spec.family:20s} {', '.join(spec.kernels)}")
    covered = {s.family for s in specs.values()}
    others = [f for f in families if f not in covered]
    if others:
        print(f"\nfamilies without a harness op: {', '.join(others)}")
    return 0


def cmd_compile(args) -> int:
    from xserv.runtime.compiler import compile_family, list_families, nvrtc_version

    arch = args.arch
    if arch is None:
        from xserv.runtime import get_device

        arch = get_device().arch
    failures = 0
    families = list_families()
    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}, target {arch}, {len(families)} families")
    total = time.perf_counter()
    for family in families:
        t0 = time.perf_counter()
        try:
            cubin = compile_family(family, arch, use_cache=not args.no_cache)
            print(f"  ok    {family:24s} {len(cubin) / 1024:8.1f} KiB  {time.perf_counter() - t0:6.2f} s")
        except Exception as exc:  # report every failure, then exit non-zero
            failures += 1
            print(f"  FAIL  {family}\n{exc}")
    print(f"{len(families) - failures}/{len(families)} compiled in {time.perf_counter() - total:.2f} s")
    return 1 if failures else 0


def _to_device(inputs: dict) -> dict:
    from xserv.tensor import Tensor

    return {k: Tensor.from_numpy(v, "cuda") if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


def _error(spec, out, ref, inputs) -> float:
    from xserv.testing import rel_error

    out = out.numpy() if hasattr(out, "numpy") else out
    if spec.compare is not None:
        return spec.compare(out, ref, inputs)
    return rel_error(out, ref)


def cmd_check(args) -> int:
    from xserv.runtime import get_device

    specs = _specs()
    names = list(specs) if args.op == "all" else [args.op]
    rng = np.random.default_rng(args.seed)
    dev = get_device()
    print(f"device: {dev.name} ({dev.arch})")
    failed = 0
    for name in names:
        spec = _get(specs, name)
        shapes = parse_shapes(args.shapes) or spec.check_shapes
        for shape in shapes:
            inputs = spec.make_inputs(rng, shape)
            ref = spec.reference(inputs)
            out = spec.run(_to_device(inputs))
            err = _error(spec, out, ref, inputs)
            ok = err <= spec.tolerance
            failed += not ok
            print(f"  {'pass' if ok else 'FAIL'}  {name:26s} {'x'.join(map(str, shape)):24s} rel err {err:.2e} (tol {spec.tolerance:.0e})")
    print("all passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


def _get(specs, name):
    if name not in specs:
        raise SystemExit(f"unknown op {name!r}; `python -m tools.kernel_harness list` shows them")
    return specs[name]


# ---- ceilings ------------------------------------------------------------------------------------------------
def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy through our 16-byte copy kernel, counting bytes read plus bytes written."""
    from xserv.runtime import get_device, kernel
    from xserv.runtime.timing import benchmark
    from xserv.tensor import Tensor, uint8

    src, dst = Tensor.empty((nbytes,), uint8), Tensor.empty((nbytes,), uint8)
    copy = kernel("fill", "copy_u128")
    n16 = np.int64(nbytes // 16)
    grid = get_device().multiprocessor_count * 16
    ms = benchmark([lambda: copy(grid, 256, dst, src, n16)], warmup=5, iters=20)
    return 2 * nbytes / ms / 1e6


def gemm_tflops(m: int = 8192, n: int = 8192, k: int = 8192) -> float:
    from xserv.ops.linear import linear
    from xserv.runtime.timing import benchmark
    from xserv.tensor import Tensor, bfloat16

    rng = np.random.default_rng(0)
    x = Tensor.from_numpy(rng.standard_normal((m, k), np.float32).astype(bfloat16))
    w = Tensor.from_numpy(rng.standard_normal((n, k), np.float32).astype(bfloat16))
    out = Tensor.empty((m, n), bfloat16)
    ms = benchmark([lambda: linear(x, w, out)], warmup=3, iters=10)
    return 2 * m * n * k / ms / 1e9


def cmd_ceilings(args) -> int:
    from xserv.runtime import get_device

    dev = get_device()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs)")
    print(f"copy bandwidth (read+write): {copy_bandwidth_gbs():8.0f} GB/s")
    print(f"cuBLAS bf16 GEMM 8192^3:     {gemm_tflops():8.0f} TFLOP/s")
    return 0


def _torch_inputs(inputs: dict):
    import torch

    out = {}
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            if v.dtype.name == "bfloat16":
                out[k] = torch.from_numpy(v.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
            else:
                out[k] = torch.from_numpy(np.ascontiguousarray(v)).cuda()
        else:
            out[k] = v
    return out


def _time_torch(fn, sets) -> float:
    import torch

    from tools.bench_runtime import _torch_median

    return _torch_median(torch, [lambda s=s: fn(s) for s in sets])


def cmd_bench(args) -> int:
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark
    from xserv.testing import no_poisoning

    specs = _specs()
    names = list(specs) if args.op == "all" else [args.op]
    dev = get_device()
    copy_gbs = copy_bandwidth_gbs()
    tflops = gemm_tflops()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs, L2 {dev.info.l2_cache_bytes >> 20} MiB)")
    print(f"ceilings measured now: copy {copy_gbs:.0f} GB/s (read+write), cuBLAS bf16 GEMM 8192^3 {tflops:.0f} TFLOP/s")
    rng = np.random.default_rng(args.seed)
    vs_torch = args.vs == "torch"
    if vs_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("PyTorch is not importable here: --vs torch skipped")
            vs_torch = False
    header = f"{'op':24s} {'shape':22s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s} {'%gemm':>6s}"
    if vs_torch:
        header += f" {'torch us':>9s} {'torch/us':>8s}"
    print(header)
    for name in names:
        spec = _get(specs, name)
        for shape in parse_shapes(args.shapes) or spec.bench_shapes or spec.check_shapes[-1:]:
            inputs = spec.make_inputs(rng, shape)
            per_set = sum(v.nbytes for v in inputs.values() if isinstance(v, np.ndarray))
            n_sets = max(1, min(8, (3 * dev.info.l2_cache_bytes) // max(per_set, 1) + 1))
            sets = [_to_device(inputs)] + [_to_device(spec.make_inputs(rng, shape)) for _ in range(n_sets - 1)]
            with no_poisoning():
                ms = benchmark([lambda s=s: spec.run(s) for s in sets], warmup=5, iters=args.iters)
            us = ms * 1e3
            row = f"{name:24s} {'x'.join(map(str, shape)):22s} {us:9.1f}"
            if spec.bytes_moved:
                gbs = spec.bytes_moved(shape) / ms / 1e6
                row += f" {gbs:7.0f} {100 * gbs / copy_gbs:5.0f}%"
            else:
                row += f" {'':7s} {'':6s}"
            if spec.flops:
                tf = spec.flops(shape) / ms / 1e9
                row += f" {tf:8.1f} {100 * tf / tflops:5.0f}%"
            else:
                row += f" {'':8s} {'':6s}"
            if vs_torch and spec.torch_peer:
                tsets = [_torch_inputs(spec.make_inputs(rng, shape)) for _ in range(n_sets)]
                tms = _time_torch(spec.torch_peer, tsets)
                row += f" {tms * 1e3:9.1f} {tms / ms:7.2f}x"
            print(row)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.kernel_harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every op with its kernels")
    c = sub.add_parser("compile", help="compile every kernel family (no GPU needed with --arch)")
    c.add_argument("--arch", help="target, e.g. sm_90a (default: the current device's)")
    c.add_argument("--no-cache", action="store_true", help="ignore and do not write the cubin cache")
    for name, helptext in (("check", "compare an op with its NumPy reference"), ("bench", "time an op")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("op", help="op name from `list`, or 'all'")
        s.add_argument("--shapes", help="comma-separated shapes like 8192x4096,1x128 (see the op's spec)")
        s.add_argument("--seed", type=int, default=None, help="seed for the random inputs (default: fresh)")
        if name == "bench":
            s.add_argument("--vs", choices=["torch"], help="also time the PyTorch equivalent")
            s.add_argument("--iters", type=int, default=30)
    sub.add_parser("ceilings", help="measure copy bandwidth and a large cuBLAS GEMM")
    args = p.parse_args(argv)
    try:
        return {"list": cmd_list, "compile": cmd_compile, "check": cmd_check, "bench": cmd_bench,
                "ceilings": cmd_ceilings}[args.cmd](args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
