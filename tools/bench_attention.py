"""Attention benchmark: our prefill and decode kernels against PyTorch SDPA with its FLASH_ATTENTION and
CUDNN_ATTENTION backends (and EFFICIENT_ATTENTION for decode), in the same run, on the same data (dense copies of
the paged cache for SDPA). Prints TFLOP/s (prefill) or GB/s (decode), ratios, and the device name.

    python -m tools.bench_attention [--quick] [--skip-torch] [--decode-only] [--prefill all|shipped|NAMES]
                                    [--decode-variants v4,v2,v3,v3s3]

Kernels are named as in xserv.ops.attention's tables (PREFILL_KERNELS, DECODE_KERNELS: the shipped ones) and the dev
registry tools/dev/kernels.py (the development ones in cuda_src/dev/, compiled on first use here, never by the
library).

Prefill is timed as plain launches (ms-scale kernels), decode as CUDA-graph replays (the engine's decode step;
also proves the op is capturable). Median of many, rotating input sets larger than L2.
FLOPs and bytes as in tools/harness_specs/attention.py.
"""
from __future__ import annotations

import argparse

import numpy as np

PREFILL = [  # (label, B, HQ, HKV, LQ, LKV, D, causal)
    ("causal 1x32hx4096 d128", 1, 32, 32, 4096, 4096, 128, True),
    ("causal 1x32/8hx4096 d128 gqa", 1, 32, 8, 4096, 4096, 128, True),
    ("noncausal 1x8hx4096x8192 d128", 1, 8, 8, 4096, 8192, 128, False),
    ("causal 1x16/8hx2048 d64", 1, 16, 8, 2048, 2048, 64, True),
    ("causal 1x24/4hx4096 d256 gqa", 1, 24, 4, 4096, 4096, 256, True),  # Qwen3.5-27B's gated attention layers
]
DECODE = [  # (label, B, HQ, HKV, LKV, D, block)
    ("decode 64x4096 32/8 bs16", 64, 32, 8, 4096, 128, 16),
    ("decode 1x32768 32/8 bs16", 1, 32, 8, 32768, 128, 16),
    ("decode 8x8192 16/8 bs16", 8, 16, 8, 8192, 128, 16),
    ("decode 64x4096 32/8 bs256", 64, 32, 8, 4096, 128, 256),
    ("decode 32x4096 16/8 d64 bs16", 32, 16, 8, 4096, 64, 16),
    ("decode 32x4096 64/8 bs16", 32, 64, 8, 4096, 128, 16),  # G = 8 (Qwen3-32B)
    # batch 1 at few kv heads (pure latency): the 30B-A3B's 32/4 heads (G = 8, 2 query-head subgroups) and 32/8
    ("decode 1x512 32/4 bs16", 1, 32, 4, 512, 128, 16),
    ("decode 1x4096 32/4 bs16", 1, 32, 4, 4096, 128, 16),
    ("decode 1x512 32/8 bs16", 1, 32, 8, 512, 128, 16),
    ("decode 1x4096 32/8 bs16", 1, 32, 8, 4096, 128, 16),
    # head_dim 256 (Qwen3.5-27B: 24 q / 4 kv heads, G = 6), batch 1 and 64 at 512 and 4k keys
    ("decode 1x512 24/4 d256 bs16", 1, 24, 4, 512, 256, 16),
    ("decode 1x4096 24/4 d256 bs16", 1, 24, 4, 4096, 256, 16),
    ("decode 64x512 24/4 d256 bs16", 64, 24, 4, 512, 256, 16),
    ("decode 64x4096 24/4 d256 bs16", 64, 24, 4, 4096, 256, 16),
]


def _sets(make, rng, shape, per_set_bytes, l2):
    n = max(1, min(4, (3 * l2) // max(per_set_bytes, 1) + 1))
    return [make(rng, shape) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--prefill", default="all", help="prefill kernels to time: all (shipped and dev), shipped, or "
                   "comma-separated names (e.g. v5,v4_w2_k64,fa2_w8)")
    p.add_argument("--only", default="", help="prefill configs whose label contains this text")
    p.add_argument("--once", action="store_true", help="run each prefill kernel once, untimed (for ncu)")
    p.add_argument("--prefill-only", action="store_true", help="skip the decode configs")
    p.add_argument("--decode-only", action="store_true", help="skip the prefill configs")
    p.add_argument("--decode-only-labels", default="", help="decode configs whose label contains one of these "
                   "comma-separated texts (default: all)")
    p.add_argument("--decode-variants", default="v4,v2,v3,v3s3", help="decode kernels to time (shipped or dev "
                   "names, tools/dev/kernels.py; v4s3, v4s4, v4w16 exist for d128 G 2 and 4, d64 G 2 only)")
    args = p.parse_args(argv)

    torch = None
    if not args.skip_torch:
        try:  # before anything of xserv's runtime (see the note at the end of docs/kernels/attention.md)
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from tools._bench_util import torch_graph_median, torch_median
        except ImportError:
            print("PyTorch not importable: no peers")
            torch = None

    from tools._bench_util import copy_bandwidth_gbs, to_device, torch_inputs
    from tools.dev import kernels
    from tools.harness_specs import attention as S
    from xserv.ops import attention as A
    from xserv.ops.attention.decode import plan_decode
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark, benchmark_graph
    from xserv.tensor import Tensor, bfloat16

    for var in args.decode_variants.split(","):
        try:
            kernels.decode(var)
        except ValueError as exc:
            p.error(f"--decode-variants: {exc}")

    dev = get_device()
    l2 = dev.info.l2_cache_bytes
    iters = 10 if args.quick else 30
    copy = copy_bandwidth_gbs()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs, L2 {l2 >> 20} MiB); "
          f"copy bandwidth {copy:.0f} GB/s (read+write)")
    if torch is not None:
        print(f"torch {torch.__version__}")
    rng = np.random.default_rng(0)
    rows = []

    def prefill_names(head_dim):
        if args.prefill in ("all", "shipped"):
            names = kernels.prefill_variants(head_dim, dev=args.prefill == "all")
            return [v for v in names if v != "simple"]
        return [v for v in args.prefill.split(",") if v in kernels.prefill_variants(head_dim)]

    def torch_time(sets_np, fn, backend, graph=False):
        if torch is None:
            return None
        tsets = [torch_inputs(x) for x in sets_np]
        try:
            with sdpa_kernel([backend]):
                for t in tsets:
                    fn(t)
                torch.cuda.synchronize()
                fns = [lambda t=t: fn(t) for t in tsets]
                return torch_graph_median(torch, fns) if graph else torch_median(torch, fns, 3, iters, 3)
        except Exception as exc:  # a backend that does not take this shape
            print(f"  ({backend.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
            return None
        finally:
            del tsets
            torch.cuda.empty_cache()

    # ---- prefill
    print(f"\n{'prefill':32s} {'impl':14s} {'ms':>8s} {'TFLOP/s':>8s} {'vs flash':>8s} {'vs cudnn':>8s}")
    for label, b, hq, hkv, lq, lkv, d, causal in ([] if args.decode_only else PREFILL):
        if args.only not in label:
            continue
        shape = (b, hq, hkv, lq, lkv, d)
        flops = S._prefill_flops(shape, causal)
        make = lambda r, s, c=causal: S._prefill_inputs(r, s, causal=c)
        sets_np = _sets(make, rng, shape, S._prefill_bytes(shape), l2)
        results = {}
        if torch is not None:
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                results[name] = torch_time(sets_np, S._prefill_torch, backend)
        sets = [to_device(x) for x in sets_np]
        outs = [Tensor.empty(x["q"].shape, bfloat16) for x in sets_np]
        for variant in prefill_names(d):
            if kernels.prefill_kernel(variant, d).tma != "none" and dev.arch != "sm_90a":
                continue
            fns = [lambda t=t, o=o, k=kernels.prefill(variant, d): A.attention_prefill(
                t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"], t["scale"],
                t["max_q_len"], out=o, causal=causal, variant=k) for t, o in zip(sets, outs)]
            if args.once:
                fns[0]()
                continue
            results[variant] = benchmark(fns, warmup=3, iters=iters)
        del sets, outs
        for name, ms in results.items():
            if ms is None:
                continue
            tf = flops / ms / 1e9
            vs = lambda peer: f"{results[peer] / ms:7.2f}x" if results.get(peer) else f"{'-':>8s}"
            print(f"{label:32s} {name:14s} {ms:8.3f} {tf:8.1f} {vs('flash')} {vs('cudnn')}")
            rows.append((label, name, ms, tf))

    if args.prefill_only:
        return 0
    # ---- decode
    print(f"\n{'decode':32s} {'impl':10s} {'us':>8s} {'GB/s':>8s} {'%copy':>6s} {'vs flash':>8s} {'splits':>6s}")
    wanted = [t for t in args.decode_only_labels.split(",") if t]
    for label, b, hq, hkv, lkv, d, block in DECODE:
        if wanted and not any(t in label for t in wanted):
            continue
        shape = (b, hq, hkv, lkv, d, block)
        nbytes = S._decode_bytes(shape)
        sets_np = _sets(S._decode_inputs, rng, shape, nbytes, l2)
        results = {}
        if torch is not None:
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                results[name] = torch_time(sets_np, S._decode_torch, backend, graph=True)
        sets = [to_device(x) for x in sets_np]
        outs = [Tensor.empty(x["q"].shape, bfloat16) for x in sets_np]
        splits = {}
        for var in args.decode_variants.split(","):
            fns = [lambda t=t, o=o, k=kernels.decode(var): A.attention_decode(
                t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"], t["max_kv_len"],
                out=o, variant=k) for t, o in zip(sets, outs)]
            try:
                results[var] = benchmark_graph(fns, calls=10, iters=iters)
            except Exception as exc:  # report and go on with the other variants
                print(f"  ({var}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                continue
            k, splits[var], _ = plan_decode(kernels.decode(var), b, hkv, lkv, block, d, hq // hkv,
                                            dev.multiprocessor_count)
            if k.variant != var:
                splits[var] = f"{splits[var]} ({k.variant})"  # the fallback ran
        # agreement with v2 on the same data (the tests check against the float64 reference)
        check = {}
        for var in splits:
            o = Tensor.empty(sets_np[0]["q"].shape, bfloat16)
            t = sets[0]
            A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"],
                               t["max_kv_len"], out=o, variant=kernels.decode(var))
            check[var] = o.numpy().astype(np.float64)
        if "v2" in check:
            errs = {v: np.linalg.norm(x - check["v2"]) / np.linalg.norm(check["v2"]) for v, x in check.items()}
            print("  rel. difference vs v2: " + ", ".join(f"{v} {e:.1e}" for v, e in errs.items()))
        del sets, outs
        for name, ms in results.items():
            if ms is None:
                continue
            gbs = nbytes / ms / 1e6
            vs = f"{results['flash'] / ms:7.2f}x" if results.get("flash") else f"{'-':>8s}"
            print(f"{label:32s} {name:10s} {ms * 1e3:8.1f} {gbs:8.0f} {100 * gbs / copy:5.0f}% {vs} "
                  f"{splits.get(name, ''):>6}")
            rows.append((label, name, ms, gbs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
