"""The kernel harness: list, compile, check and benchmark xserv's kernels one by one.

    python -m tools.kernel_harness list
    python -m tools.kernel_harness compile [--arch sm_90a|sm_80,sm_89|ci] [--dev]  # no GPU needed; --dev: dev/ too
    python -m tools.kernel_harness sizes [FAMILY ...] [--arch sm_90a]  # machine code per kernel entry, no GPU; FAMILY may be a piece (gemv:m1_p0)
                                              # (FAMILY may be a piece: gemv:m1_p0, attention_decode:d128_g4)
    python -m tools.kernel_harness check OP [--shapes 8192x4096,1x128] [--seed N] [--variant NAME]
    python -m tools.kernel_harness bench OP [--shapes ...] [--vs torch] [--variant NAME] [--graph]
    python -m tools.kernel_harness ceilings                          # copy bandwidth and a large cuBLAS GEMM

`check` draws fresh random inputs, poisons the outputs, runs the CUDA op and compares it with the op's NumPy
reference in float64 (relative L2 error). `bench` times the op with CUDA events (warm-up, median, rotating
input sets larger than L2) and reports GB/s or TFLOP/s against the device's own ceilings measured in the same
run; `--vs torch` also times the PyTorch equivalent and prints the ratio. `--graph` times both in CUDA-graph
replays instead (GPU time without the host's per-call launch work, as the engine's decode step runs). `--variant` picks one of an op's kernels
(the attention ops: a shipped PREFILL_KERNELS / DECODE_KERNELS name, or a development kernel of cuda_src/dev/ as the
dev registry tools/dev/kernels.py names it).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tools._bench_util import (copy_bandwidth_gbs, gemm_tflops, to_device, torch_graph_median, torch_inputs,
                               torch_median)


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


CI_ARCHES = ("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a")  # what .ci/run compiles every family for
# --fast: NVRTC's --Ofast-compile=max still instantiates every template and assembles every instruction for the arch
# (what can fail there) at about a sixth of the CPU; the runtime never loads such cubins, so they are not cached.
FAST_OPTIONS = ("--Ofast-compile=max",)


def cmd_compile(args) -> int:
    from xserv.runtime.compiler import (compile_families, family_supports, list_dev_families, list_families,
                                        nvrtc_version)

    if args.arch is None:
        from xserv.runtime import get_device

        arches = [get_device().arch]
    elif args.arch == "ci":
        arches = list(CI_ARCHES)
    else:
        arches = [a.strip() for a in args.arch.split(",") if a.strip()]
    every = list_families() + (list_dev_families() if args.dev else [])
    failures = []
    for arch in arches:
        families = [f for f in every if family_supports(f, arch)]
        skipped = [f for f in every if f not in families]
        print(f"NVRTC {'.'.join(map(str, nvrtc_version()))}, target {arch}, {len(families)} families, "
              f"{'one at a time' if args.serial else 'in parallel threads'}"
              + (f" (not for this arch: {', '.join(skipped)})" if skipped else ""))

        def report(family, seconds, error, arch=arch):
            if error is None:
                print(f"  ok    {family:32s} {seconds:6.2f} s", flush=True)
            else:
                failures.append((arch, family))
                print(f"  FAIL  {family} ({arch})\n{error}", flush=True)

        total = time.perf_counter()
        before = len(failures)
        for group in ([[f] for f in families] if args.serial else [families]):
            try:
                compile_families(group, arch, use_cache=not (args.no_cache or args.fast), on_done=report,
                                 extra_options=FAST_OPTIONS if args.fast else ())
            except Exception:  # reported above, family by family
                pass
        print(f"{len(families) - (len(failures) - before)}/{len(families)} compiled for {arch} in "
              f"{time.perf_counter() - total:.2f} s (wall)")
    return 1 if failures else 0


def cmd_sizes(args) -> int:
    from xserv.runtime.compiler import compile_family, kernel_code_sizes, list_families

    arch = args.arch
    if arch is None:
        from xserv.runtime import get_device

        arch = get_device().arch
    families = args.families or list_families()
    unknown = sorted(f for f in families if f.partition(":")[0] not in list_families())
    if unknown:
        print(f"unknown families: {', '.join(unknown)} (see `list`)")
        return 2
    print(f"machine code per kernel entry ({arch}; each launch in a chain of short kernels runs it from a cold "
          f"instruction cache)")
    for family in families:
        for name, size in sorted(kernel_code_sizes(compile_family(family, arch)).items(), key=lambda kv: -kv[1]):
            print(f"  {family:20s} {name:48s} {size / 1024:7.1f} KB")
    return 0


def _error(spec, out, ref, inputs) -> float:
    from xserv.testing import rel_error

    out = out.numpy() if hasattr(out, "numpy") else out
    if spec.compare is not None:
        return spec.compare(out, ref, inputs)
    return rel_error(out, ref)


def cmd_check(args) -> int:
    from xserv.runtime import get_device

    specs = _specs()
    names = _op_names(specs, args)
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
            out = spec.run(to_device(_with_variant(inputs, args)))
            err = _error(spec, out, ref, inputs)
            ok = err <= spec.tolerance
            failed += not ok
            print(f"  {'pass' if ok else 'FAIL'}  {name:26s} {'x'.join(map(str, shape)):24s} rel err {err:.2e} (tol {spec.tolerance:.0e})")
    print("all passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


def _op_names(specs, args) -> list[str]:
    """The ops `check` / `bench` run: every op for "all", else the op and, without --shapes or --variant, the ops it
    names in with_ops (its fused twins, at their own shapes)."""
    if args.op == "all":
        return list(specs)
    spec = _get(specs, args.op)
    return [args.op] + ([] if args.shapes or args.variant else list(spec.with_ops))


def _get(specs, name):
    if name not in specs:
        raise SystemExit(f"unknown op {name!r}; `python -m tools.kernel_harness list` shows them")
    return specs[name]


# ---- ceilings ------------------------------------------------------------------------------------------------
def cmd_ceilings(args) -> int:
    from xserv.runtime import get_device

    dev = get_device()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs)")
    print(f"copy bandwidth (read+write): {copy_bandwidth_gbs():8.0f} GB/s")
    print(f"cuBLAS bf16 GEMM 8192^3:     {gemm_tflops():8.0f} TFLOP/s")
    return 0


def _time_torch(fn, sets, graph: bool = False) -> float:
    import torch

    fns = [lambda s=s: fn(s) for s in sets]
    return torch_graph_median(torch, fns) if graph else torch_median(torch, fns)


def _with_variant(inputs: dict, args) -> dict:
    """The op's inputs with the kernel variant asked for (ops that take one read inputs["variant"])."""
    return dict(inputs, variant=args.variant) if args.variant else inputs


def cmd_bench(args) -> int:
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark, benchmark_graph
    from xserv.testing import no_poisoning

    specs = _specs()
    names = _op_names(specs, args)
    dev = get_device()
    copy_gbs = copy_bandwidth_gbs()
    tflops = gemm_tflops()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs, L2 {dev.info.l2_cache_bytes >> 20} MiB)")
    print(f"ceilings measured now: copy {copy_gbs:.0f} GB/s (read+write), cuBLAS bf16 GEMM 8192^3 {tflops:.0f} TFLOP/s")
    print("timing: " + ("CUDA-graph replays of 20 calls (GPU time)" if args.graph else
                        "eager calls, 10 back to back per event pair (host launch work included where it is longer)"))
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
            sets = [to_device(_with_variant(inputs, args))] + [
                to_device(_with_variant(spec.make_inputs(rng, shape), args)) for _ in range(n_sets - 1)]
            fns = [lambda s=s: spec.run(s) for s in sets]
            with no_poisoning():
                if args.graph:
                    try:
                        ms = benchmark_graph(fns, calls=20, iters=args.iters)
                    except Exception as exc:  # an op that syncs with the host cannot be captured
                        print(f"{name:24s} {'x'.join(map(str, shape)):22s} (not capturable: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:80]})")
                        continue
                else:
                    ms = benchmark(fns, warmup=5, iters=args.iters)
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
                tsets = [torch_inputs(spec.make_inputs(rng, shape)) for _ in range(n_sets)]
                tms = _time_torch(spec.torch_peer, tsets, args.graph)
                row += f" {tms * 1e3:9.1f} {tms / ms:7.2f}x"
            print(row)
    return 0


def no_gpu_hint(args) -> str | None:
    """What to say when a command needs a CUDA GPU and there is none (None when it can run)."""
    from xserv.runtime import cuda_available

    if args.cmd in ("list",) or getattr(args, "arch", None) or cuda_available():
        return None
    if args.cmd in ("compile", "sizes"):
        return (f"no CUDA GPU found to take the target from; name one: `python -m tools.kernel_harness {args.cmd} "
                f"--arch sm_90a`")
    return (f"`{args.cmd}` runs kernels on a CUDA GPU and none was found; without one, "
            f"`python -m tools.kernel_harness compile --arch sm_90a` compiles every kernel family and "
            f"`python -m tools.kernel_harness sizes --arch sm_90a` shows their machine code")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.kernel_harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every op with its kernels")
    c = sub.add_parser("compile", help="compile every kernel family (no GPU needed with --arch)")
    c.add_argument("--arch", help="target(s), e.g. sm_90a, sm_80,sm_89 or sm_80@sm_90a (sm_80 code assembled for "
                   "sm_90a, as XSERV_ARCH=sm_80 on an H100); 'ci': " + ", ".join(CI_ARCHES) + " (default: the current "
                   "device's)")
    c.add_argument("--no-cache", action="store_true", help="ignore and do not write the cubin cache")
    c.add_argument("--dev", action="store_true", help="also the development families in cuda_src/dev/")
    c.add_argument("--serial", action="store_true", help="one family at a time (per-family times without contention)")
    c.add_argument("--fast", action="store_true", help="NVRTC --Ofast-compile=max, not cached: checks that every "
                   "family compiles for the arch at a sixth of the CPU (what CI runs)")
    z = sub.add_parser("sizes", help="machine code per kernel entry (no GPU needed with --arch)")
    z.add_argument("families", nargs="*", help="kernel families (default: all production ones)")
    z.add_argument("--arch", help="target, e.g. sm_90a (default: the current device's)")
    for name, helptext in (("check", "compare an op with its NumPy reference"), ("bench", "time an op")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("op", help="op name from `list`, or 'all'")
        s.add_argument("--shapes", help="comma-separated shapes like 8192x4096,1x128 (see the op's spec)")
        s.add_argument("--seed", type=int, default=None, help="seed for the random inputs (default: fresh)")
        s.add_argument("--variant", help="the op's kernel variant (e.g. v4_w2_k64 for attention_prefill, v3 for "
                       "attention_decode; dev kernels, tools/dev/kernels.py, compile on request)")
        if name == "bench":
            s.add_argument("--vs", choices=["torch"], help="also time the PyTorch equivalent")
            s.add_argument("--iters", type=int, default=30)
            s.add_argument("--graph", action="store_true",
                           help="time CUDA-graph replays (GPU time) instead of eager calls, the PyTorch peer too")
    sub.add_parser("ceilings", help="measure copy bandwidth and a large cuBLAS GEMM")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    hint = no_gpu_hint(args)
    if hint is not None:
        print(f"error: {hint}", file=sys.stderr)
        return 2
    try:
        return {"list": cmd_list, "compile": cmd_compile, "sizes": cmd_sizes, "check": cmd_check, "bench": cmd_bench,
                "ceilings": cmd_ceilings}[args.cmd](args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`... list | head`): stop quietly, as the xserv CLI does
        from xserv.cli import EXIT_BROKEN_PIPE, _discard_stdout

        _discard_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
