"""Attention benchmark: our prefill and decode kernels against PyTorch SDPA with its FLASH_ATTENTION and
CUDNN_ATTENTION backends (and EFFICIENT_ATTENTION for decode), in the same run, on the same data (dense copies of
the paged cache for SDPA). Prints TFLOP/s (prefill) or GB/s (decode), ratios, and the device name.

    python -m tools.bench_attention [--quick] [--skip-torch] [--decode-only] [--decode-variants v2,v3,v3s3]

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
]
DECODE = [  # (label, B, HQ, HKV, LKV, D, block)
    ("decode 64x4096 32/8 bs16", 64, 32, 8, 4096, 128, 16),
    ("decode 1x32768 32/8 bs16", 1, 32, 8, 32768, 128, 16),
    ("decode 8x8192 16/8 bs16", 8, 16, 8, 8192, 128, 16),
    ("decode 64x4096 32/8 bs256", 64, 32, 8, 4096, 128, 256),
    ("decode 32x4096 16/8 d64 bs16", 32, 16, 8, 4096, 64, 16),
    ("decode 32x4096 64/8 bs16", 32, 64, 8, 4096, 128, 16),  # G = 8 (Qwen3-32B)
]


def _sets(make, rng, shape, per_set_bytes, l2):
    n = max(1, min(4, (3 * l2) // max(per_set_bytes, 1) + 1))
    return [make(rng, shape) for _ in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--warps", default="4,8", help="fa2 prefill variants to time (warps per CTA; '' for none)")
    p.add_argument("--v3", default="all", help="v3 prefill variants to time: all, default, none, or names "
                   "(comma-separated, e.g. m2w4_b2)")
    p.add_argument("--v4", default="all", help="v4 (wgmma, sm_90a) prefill variants to time: all, default, none, "
                   "or names (e.g. w2_k64)")
    p.add_argument("--v5", default="all", help="v5 (producer warp + TMA ring, sm_90a) prefill variants to time: "
                   "all, default, none, or names (e.g. w2_k128_s3)")
    p.add_argument("--v4-probes", action="store_true", help="also time the v4 d128 timing probes (kernels that "
                   "leave out the K/V copies, the softmax or the PV product; wrong results on purpose)")
    p.add_argument("--only", default="", help="prefill configs whose label contains this text")
    p.add_argument("--once", action="store_true", help="run each prefill kernel once, untimed (for ncu)")
    p.add_argument("--prefill-only", action="store_true", help="skip the decode configs")
    p.add_argument("--decode-only", action="store_true", help="skip the prefill configs")
    p.add_argument("--decode-variants", default="v2,v3,v3s3,v4", help="decode kernels to time (variant=; v4p is "
                   "a load-only probe with a wrong result; v4s3, v4s4, v4n, v4p exist for the shapes here only)")
    args = p.parse_args(argv)

    torch = None
    if not args.skip_torch:
        try:  # before anything of xserv's runtime (see the note at the end of docs/kernels/attention.md)
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from tools.bench_runtime import _torch_graph_median, _torch_median
        except ImportError:
            print("PyTorch not importable: no peers")
            torch = None

    from tools.harness_specs import attention as S
    from tools.kernel_harness import _to_device, _torch_inputs, copy_bandwidth_gbs
    from xserv.ops import attention as A
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark, benchmark_graph
    from xserv.tensor import Tensor, bfloat16

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

    def torch_time(sets_np, fn, backend, graph=False):
        if torch is None:
            return None
        tsets = [_torch_inputs(x) for x in sets_np]
        try:
            with sdpa_kernel([backend]):
                for t in tsets:
                    fn(t)
                torch.cuda.synchronize()
                fns = [lambda t=t: fn(t) for t in tsets]
                return _torch_graph_median(torch, fns) if graph else _torch_median(torch, fns, 3, iters, 3)
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
        sets = [_to_device(x) for x in sets_np]
        outs = [Tensor.empty(x["q"].shape, bfloat16) for x in sets_np]
        impls = [(f"fa2 w{w}", "fa2", int(w)) for w in args.warps.split(",") if w]
        v3 = {"all": A.V3_VARIANTS[d], "default": (A.V3_DEFAULT[d],), "none": ()}.get(
            args.v3, [v for v in args.v3.split(",") if v in A.V3_VARIANTS[d]])
        impls += [(f"v3 {v}", f"v3_{v}", 0) for v in v3]
        if dev.arch == "sm_90a":
            v4 = {"all": A.V4_VARIANTS[d], "default": (A.V4_DEFAULT[d],), "none": ()}.get(
                args.v4, [v for v in args.v4.split(",") if v in A.V4_VARIANTS[d]])
            impls += [(f"v4 {v}", f"v4_{v}", 0) for v in v4]
            v5 = {"all": A.V5_VARIANTS[d], "default": (A.V5_DEFAULT[d],), "none": ()}.get(
                args.v5, [v for v in args.v5.split(",") if v in A.V5_VARIANTS[d]])
            impls += [(f"v5 {v}", f"v5_{v}", 0) for v in v5]
            if args.v4_probes and d == 128:
                impls += [(f"v4 probe{p}", f"v4probe{p}_w2_k128", 0) for p in (1, 2, 3)]
        for name, impl, w in impls:
            fns = [lambda t=t, o=o, impl=impl, w=w: A._prefill_cuda(
                t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"], t["scale"],
                t["max_q_len"], o, hq, impl, w, causal) for t, o in zip(sets, outs)]
            if args.once:
                fns[0]()
                continue
            results[name] = benchmark(fns, warmup=3, iters=iters)
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
    for label, b, hq, hkv, lkv, d, block in DECODE:
        shape = (b, hq, hkv, lkv, d, block)
        nbytes = S._decode_bytes(shape)
        sets_np = _sets(S._decode_inputs, rng, shape, nbytes, l2)
        results = {}
        if torch is not None:
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                results[name] = torch_time(sets_np, S._decode_torch, backend, graph=True)
        sets = [_to_device(x) for x in sets_np]
        outs = [Tensor.empty(x["q"].shape, bfloat16) for x in sets_np]
        splits = {}
        for var in args.decode_variants.split(","):
            fns = [lambda t=t, o=o, var=var: A.attention_decode(
                t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"], t["max_kv_len"],
                out=o, variant=var) for t, o in zip(sets, outs)]
            try:
                results[var] = benchmark_graph(fns, calls=10, iters=iters)
            except Exception as exc:  # report and go on with the other variants
                print(f"  ({var}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                continue
            if var.startswith("v4"):
                st = A._v4_config(var)[0]
                splits[var] = A.decode_plan(b, hkv, lkv, dev.multiprocessor_count, A._v4_resident(hq // hkv, st),
                                            True, max_chunk=(A._V4_TAB_CAP - 1) * block // 64 * 64)[0]
            elif var == "v2" or block % 16:
                splits[var] = A.decode_plan(b, hkv, lkv, dev.multiprocessor_count, A.DECODE_CTAS_PER_SM)[0]
            else:
                st = int(var[3:]) if len(var) > 2 else 2
                splits[var] = A.decode_plan(b, hkv, lkv, dev.multiprocessor_count, A._V3_RESIDENT[d, st], True)[0]
        # agreement with v2 on the same data (the tests check against the float64 reference)
        check = {}
        for var in splits:
            if var == "v4p":  # the probe computes nothing
                continue
            o = Tensor.empty(sets_np[0]["q"].shape, bfloat16)
            t = sets[0]
            A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"],
                               t["max_kv_len"], out=o, variant=var)
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
