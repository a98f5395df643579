"""Decode-attention split sweep: attention_decode timed as CUDA-graph replays with the split count forced, shape by
shape, next to the plan `plan_decode` picks, to see which plan fills the GPU for few sequences (and that it costs
nothing at batch 64). Also times qk_norm_rope_write_kv (its kernels of 1, 2 and 4 row groups per warp, where the
source instantiates them) against qk_norm_rope + write_kv_packed (graph replays).

    python -m tools.dev.sweep_decode_plan [--only TEXT] [--sweep TEXT,TEXT] [--variants v4,v4s3,...] [--no-rope]
                                      [--quick]

Every config is timed at the plan plan_decode picks; those whose label contains one of the --sweep texts ("all":
every config) also at the forced split counts of SPLITS (chunks of 64 keys and more, <= 256 splits, pages within
v4's table). Variants: shipped or development names (tools/dev/kernels.py; development kernels compile on request),
all planned by plan_decode.

`v4base`: a copy of an earlier attention_decode.cu placed at cuda_src/dev/attention_decode_v4base.cu (not part of
the repository; skipped when absent), compiled as a development family, to compare kernel versions in one run.
Bytes as in tools/harness_specs/attention.py (q + K + V + out); % of the copy bandwidth measured in the same run.
Each forced plan's output is compared with the default plan's (relative L2 difference printed when > 1e-2).
"""
from __future__ import annotations

import argparse
import re

import numpy as np

CONFIGS = [  # (label, B, HQ, HKV, LKV, D, block)
    ("1x512 32/8", 1, 32, 8, 512, 128, 16),
    ("1x512 32/4 (G8, 30B-A3B)", 1, 32, 4, 512, 128, 16),
    ("1x4096 32/4 (G8, 30B-A3B)", 1, 32, 4, 4096, 128, 16),
    ("1x2048 32/8", 1, 32, 8, 2048, 128, 16),
    ("1x4096 32/8", 1, 32, 8, 4096, 128, 16),
    ("1x8192 32/8", 1, 32, 8, 8192, 128, 16),
    ("1x16384 32/8", 1, 32, 8, 16384, 128, 16),
    ("1x32768 32/8", 1, 32, 8, 32768, 128, 16),
    ("1x65536 32/8", 1, 32, 8, 65536, 128, 16),
    ("1x131072 32/8", 1, 32, 8, 131072, 128, 16),
    ("1x32768 16/8", 1, 16, 8, 32768, 128, 16),
    ("1x131072 16/8", 1, 16, 8, 131072, 128, 16),
    ("1x32768 40/8 (G5)", 1, 40, 8, 32768, 128, 16),
    ("1x32768 64/8 (G8)", 1, 64, 8, 32768, 128, 16),
    ("1x512 64/8 (G8)", 1, 64, 8, 512, 128, 16),
    ("1x1024 64/8 (G8)", 1, 64, 8, 1024, 128, 16),
    ("1x2048 64/8 (G8)", 1, 64, 8, 2048, 128, 16),
    ("1x4096 64/8 (G8)", 1, 64, 8, 4096, 128, 16),
    ("1x8192 64/8 (G8)", 1, 64, 8, 8192, 128, 16),
    ("4x512 64/8 (G8)", 4, 64, 8, 512, 128, 16),
    ("1x2048 48/8 (G6)", 1, 48, 8, 2048, 128, 16),
    ("1x512 40/8 (G5)", 1, 40, 8, 512, 128, 16),
    ("1x2048 40/8 (G5)", 1, 40, 8, 2048, 128, 16),
    ("1x4096 40/8 (G5)", 1, 40, 8, 4096, 128, 16),
    ("4x512 40/8 (G5)", 4, 40, 8, 512, 128, 16),
    ("1x131072 64/8 (G8)", 1, 64, 8, 131072, 128, 16),
    ("4x8192 64/8 (G8)", 4, 64, 8, 8192, 128, 16),
    ("1x32768 16/8 d64", 1, 16, 8, 32768, 64, 16),
    ("2x32768 32/8", 2, 32, 8, 32768, 128, 16),
    ("4x32768 32/8", 4, 32, 8, 32768, 128, 16),
    ("4x8192 32/8", 4, 32, 8, 8192, 128, 16),
    ("8x8192 16/8", 8, 16, 8, 8192, 128, 16),
    ("16x4096 32/8", 16, 32, 8, 4096, 128, 16),
    ("64x512 32/8", 64, 32, 8, 512, 128, 16),
    ("64x1024 32/8", 64, 32, 8, 1024, 128, 16),
    ("64x2048 32/8", 64, 32, 8, 2048, 128, 16),
    ("64x4096 32/8", 64, 32, 8, 4096, 128, 16),
    ("64x4096 32/8 bs256", 64, 32, 8, 4096, 128, 256),
]
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 33, 40, 48, 56, 64, 66, 80, 96, 112, 128, 132, 160, 192, 224, 256]
ROPE = [(1, 16, 8, 128), (1, 32, 8, 128), (64, 32, 8, 128), (8192, 32, 8, 128), (8192, 16, 8, 128)]


def _candidates(lkv: int, block: int, cap: int, max_splits: int) -> list[tuple[int, int]]:
    """(splits, chunk) for the SPLITS counts: chunk a multiple of 64, the split's pages within v4's table."""
    seen = []
    for want in SPLITS:
        chunk = -(-(-(-lkv // want)) // 64) * 64
        splits = -(-lkv // chunk)
        if splits > max_splits or -(-chunk // block) + 1 > cap or (splits, chunk) in seen:
            continue
        seen.append((splits, chunk))
    return seen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="configs whose label contains this text")
    p.add_argument("--variants", default="v4")
    p.add_argument("--sweep", default="all", help="configs (label texts, comma-separated, or all) to sweep")
    p.add_argument("--no-rope", action="store_true")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)

    from tools._bench_util import copy_bandwidth_gbs, to_device
    from tools.dev import kernels
    from tools.harness_specs import attention as S
    from xserv.ops import attention as A
    from xserv.ops.attention import decode as D
    from xserv.runtime import get_device
    from xserv.runtime.compiler import kernel_source_dir
    from xserv.runtime.timing import benchmark_graph
    from xserv.tensor import Tensor, bfloat16

    dev = get_device()
    sms = dev.multiprocessor_count
    l2 = dev.info.l2_cache_bytes
    copy = copy_bandwidth_gbs()
    iters = 8 if args.quick else 15
    print(f"device: {dev.name} ({dev.arch}, {sms} SMs, L2 {l2 >> 20} MiB); copy bandwidth {copy:.0f} GB/s")
    variants = [v for v in args.variants.split(",") if v]
    chosen = {}  # variant name -> what the op takes (a shipped name, or a dev registry's DecodeKernel)
    for v in variants:
        if v == "v4base":
            if (kernel_source_dir() / "dev" / "attention_decode_v4base.cu").is_file():
                chosen[v] = kernels.DevDecodeKernel("v4base", 4, "dev/attention_decode_v4base")
        else:
            try:
                chosen[v] = kernels.decode(v)
            except ValueError as exc:
                p.error(f"--variants: {exc}")
    variants = list(chosen)
    planner = D.plan_decode
    forced: dict = {}
    used: dict = {}

    def plan(variant, *shape):
        k, splits, chunk = planner("v4" if variant is chosen.get("v4base") else variant, *shape)
        if forced:
            splits, chunk = forced["plan"]
            k = variant if isinstance(variant, D.DecodeKernel) else D.DECODE_KERNELS[variant]
        used["kernel"] = k.variant + (f"/{k.subgroups}" if k.subgroups > 1 else "")
        used["subgroups"] = k.subgroups
        return k, splits, chunk

    D.plan_decode = plan
    rng = np.random.default_rng(0)
    print(f"{'config':22s} {'impl/ran':9s} {'splits':>6s} {'chunk':>6s} {'CTAs':>5s} {'us':>8s} {'GB/s':>6s} {'%copy':>6s}")
    for label, b, hq, hkv, lkv, d, block in CONFIGS:
        if args.only and args.only not in label:
            continue
        shape = (b, hq, hkv, lkv, d, block)
        nbytes = S._decode_bytes(shape)
        n_sets = max(1, min(4, (3 * l2) // nbytes + 1))
        sets_np = [S._decode_inputs(rng, shape) for _ in range(n_sets)]
        sets = [to_device(x) for x in sets_np]
        del sets_np
        outs = [Tensor.empty((b, hq, d), bfloat16) for _ in sets]
        default = planner("v4", b, hkv, lkv, block, d, hq // hkv, sms)
        print(f"  ({label}: plan_decode picks {default[0].variant}, {default[1]} x {default[2]}"
              + (f", {default[0].subgroups} query-head subgroups" if default[0].subgroups > 1 else "") + ")")
        t0 = sets[0]

        def call(t, o, var):
            A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], t["scale"],
                               t["max_kv_len"], out=o, variant=chosen.get(var, var))

        ref = Tensor.empty((b, hq, d), bfloat16)
        call(t0, ref, "v4")
        ref = ref.numpy().astype(np.float64)
        sweep = args.sweep == "all" or any(x and x in label for x in args.sweep.split(","))
        plans = [None] + (_candidates(lkv, block, D.V4_TABLE_CAP, D.V4_MAX_SPLITS) if sweep else [])
        for var in variants:
            for forced_plan in plans:
                forced.clear()
                if forced_plan is not None:
                    forced["plan"] = forced_plan
                splits, chunk = forced_plan or default[1:]
                fns = [lambda t=t, o=o, var=var: call(t, o, var) for t, o in zip(sets, outs)]
                try:
                    ms = benchmark_graph(fns, calls=10, iters=iters)
                except Exception as exc:  # report and go on
                    print(f"  ({var} {splits}x{chunk}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                    continue
                o = Tensor.empty((b, hq, d), bfloat16)
                call(t0, o, var)
                diff = np.linalg.norm(o.numpy().astype(np.float64) - ref) / np.linalg.norm(ref)
                gbs = nbytes / ms / 1e6
                tag = "plan" if forced_plan is None else ""
                ran, ctas = f"{var}/{used['kernel']}", splits * b * hkv * used["subgroups"]
                print(f"{label:22s} {ran:9s} {splits:6d} {chunk:6d} {ctas:5d} {ms * 1e3:8.1f} "
                      f"{gbs:6.0f} {100 * gbs / copy:5.0f}% {tag}" + (f"  DIFF {diff:.1e}" if diff > 1e-2 else ""))
        forced.clear()
        del sets, outs
    D.plan_decode = planner

    if not args.no_rope:
        from tools.harness_specs import rope as R
        from xserv.ops import rope as rope_ops
        from xserv.ops.attention import write_kv_packed
        from xserv.ops.rope import qk_norm_rope, qk_norm_rope_write_kv

        from xserv.runtime.compiler import kernel_source_dir as src_dir

        made = re.findall(r"^XSERV_QK_NORM_ROPE_WRITE_KV\((\d+), (\d)\)", (src_dir() / "rope.cu").read_text(), re.M)
        steps_list = sorted({int(n) for _, n in made})
        print(f"\n{'qk_norm_rope + KV write':20s} " + " ".join(f"{'fused s%d us' % n:>12s}" for n in steps_list)
              + f" {'two ops us':>10s}  (GB/s, %copy of the fused bytes)")
        default_steps = rope_ops._FUSED_STEPS
        for shape in ROPE:
            t, hq, hkv, hd = shape
            nbytes = R._fused_bytes(shape)
            n_sets = max(1, min(4, (3 * l2) // nbytes + 1))
            sets = [to_device(R._fused_inputs(rng, shape)) for _ in range(n_sets)]

            def fused(x):
                qk_norm_rope_write_kv(x["qkv"], x["q_weight"], x["k_weight"], x["positions"], x["cos_sin"], hq, hkv,
                                      R.EPS, x["kv_cache"][0], x["kv_cache"][1], x["slot_mapping"])

            def two(x):
                qk_norm_rope(x["qkv"], x["q_weight"], x["k_weight"], x["positions"], x["cos_sin"], hq, hkv, R.EPS)
                write_kv_packed(x["qkv"], hq, x["kv_cache"][0], x["kv_cache"][1], x["slot_mapping"])

            times = []
            for n in steps_list:
                rope_ops._FUSED_STEPS = n
                times.append(benchmark_graph([lambda x=x: fused(x) for x in sets], calls=20, iters=iters))
            rope_ops._FUSED_STEPS = default_steps
            ms_t = benchmark_graph([lambda x=x: two(x) for x in sets], calls=20, iters=iters)
            best = min(times)
            gbs = nbytes / best / 1e6
            print(f"{'x'.join(map(str, shape)):20s} " + " ".join(f"{ms * 1e3:12.2f}" for ms in times)
                  + f" {ms_t * 1e3:10.2f}  (best fused {gbs:.0f} GB/s, {100 * gbs / copy:.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
