"""Skinny-GEMM benchmark: xserv's GEMV kernels (plain and fused) against cuBLASLt (xserv's `linear`) and
torch.matmul on the Qwen3 projection shapes, M = 1..16 rows. Prints the device, its copy bandwidth measured in the
same run, and per shape: microseconds, weight-read GB/s, % of copy bandwidth, and the ratios.

    python -m tools.bench_gemv [--models 0.6b,8b] [--m 1,2,4,8,16] [--skip-torch] [--hot] [--after-norm]
                               [--stage-kb 32,48,inf]

Each call reads a different copy of the weight (enough copies to overflow L2), and calls are replayed from a CUDA
graph of 20, as the engine's decode steps run: the figures are cold-weight, launch-gap-included kernel times.
--hot reads one copy throughout instead, so weights that fit L2 stay there: what a kernel costs without HBM (its
launch, ramp and latency), the floor that prefetching or staging its weights could at best reach.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools._bench_util import copy_bandwidth_gbs, torch_graph_median  # noqa: E402

# (model, projection, N, K) for Qwen3-0.6B (hidden 1024, 16/8 heads of 128, intermediate 3072, vocab 151936) and
# Qwen3-8B (hidden 4096, 32/8 heads, intermediate 12288).
SHAPES = {
    "0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
             ("lm_head", 151936, 1024)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
           ("lm_head", 151936, 4096)],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--hot", action="store_true",
                    help="every call reads the same weight copy, which stays in L2 where it fits (L2 size in the "
                         "header): the kernel's time without the HBM stream, i.e. its launch, ramp and latency floor")
    ap.add_argument("--after-norm", action="store_true",
                    help="each call of the GEMV and of cuBLASLt follows the RMSNorm kernel that writes its x, as in "
                         "the model's unfused steps (no back-to-back overlap of one GEMV's start with the previous "
                         "one's end through programmatic dependent launch); the columns are then the pair's time")
    ap.add_argument("--stage-kb", default=None,
                    help="comma list of the mma kernel's staged-x budgets per CTA (KiB; 'inf': slice K only where x "
                         "would not fit) to run the GEMV columns under, one row each (default: xserv's STAGE_BYTES)")
    ap.add_argument("--once", action="store_true",
                    help="run the GEMV and cuBLASLt once per shape between cuProfilerStart / Stop, untimed: for "
                         "`ncu --profile-from-start off`")
    args = ap.parse_args(argv)

    from xserv.ops import gemv as gemv_mod
    from xserv.ops.gemv import (gemv_supported, k_slices, linear_add, linear_gemv, rmsnorm_linear,
                                rmsnorm_linear_silu_mul, silu_mul_linear_add)
    from xserv.ops.linear import linear
    from xserv.ops.rmsnorm import rmsnorm
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark_graph
    from xserv.tensor import Tensor, bfloat16, float32

    torch = None
    if not args.skip_torch:
        try:
            import torch
        except ImportError:
            print("(PyTorch not importable: no torch peer)")
    dev = get_device()
    copy = copy_bandwidth_gbs()
    print(f"device: {dev.name} ({dev.multiprocessor_count} SMs, L2 {dev.info.l2_cache_bytes >> 20} MiB); copy "
          f"bandwidth measured now {copy:.0f} GB/s (read + write)")
    print("GB/s = (weight + x + out bytes) / time; %copy against the copy bandwidth; fused = the variant the model "
          "runs (qkv/lm_head: RMSNorm prologue (lm_head fp32 out); gate_up: RMSNorm prologue, at M = 1 also the SiLU-"
          "and-mul epilogue; o: residual-add epilogue; down: residual-add epilogue, above M = 1 also the SiLU "
          "prologue)")
    if args.hot:
        print("--hot: one weight copy for all calls (L2-resident where it fits): not a bandwidth figure")
    if args.after_norm:
        print("--after-norm: gemv / cublas columns time RMSNorm(x) then the projection ('norm us': RMSNorm alone)")
    stages = ([None] if args.stage_kb is None else
              [1 << 40 if v.strip() == "inf" else int(float(v) * 1024) for v in args.stage_kb.split(",")])
    default_stage = gemv_mod.STAGE_BYTES
    print(f"the mma kernel (M >= 2) slices K across CTAs where a CTA would stage more than STAGE_BYTES of x "
          f"(xserv's default {default_stage >> 10} KiB); 'slices' = K slices of the row's run")
    hdr = (f"{'model':5s} {'proj':8s} {'M':>3s} {'N':>7s} {'K':>6s} {'stage':>6s} {'slices':>6s} {'gemv us':>8s} {'GB/s':>6s} {'%copy':>6s} "
           f"{'fused us':>8s} {'cublas us':>9s} {'cublas/gemv':>11s}" + (f" {'torch us':>9s} {'torch/gemv':>10s}" if torch else "")
           + (f" {'norm us':>8s}" if args.after_norm else ""))
    print(hdr)
    rng = np.random.default_rng(0)
    ms_list = [int(v) for v in args.m.split(",")]
    for model in args.models.split(","):
        for proj, n, k in SHAPES[model]:
            copies = 1 if args.hot else max(2, int(np.ceil(3 * dev.info.l2_cache_bytes / (n * k * 2))))
            w_np = (rng.standard_normal((n, k), np.float32) * 0.02).astype(bfloat16)
            ws = [Tensor.from_numpy(w_np) for _ in range(copies)]
            tws = []
            if torch is not None:
                tw = torch.from_numpy(w_np.view(np.int16)).view(torch.bfloat16).cuda()
                tws = [tw.clone() for _ in range(copies)]
            for m, stage in ((m, stage) for m in ms_list for stage in stages):
                gemv_mod.STAGE_BYTES = default_stage if stage is None else stage
                if not gemv_supported(m, k):
                    continue
                x_np = rng.standard_normal((m, k), np.float32).astype(bfloat16)
                x = Tensor.from_numpy(x_np)
                out_dtype = float32 if proj == "lm_head" else bfloat16
                out = Tensor.empty((m, n), out_dtype)
                before = lambda: None  # noqa: E731
                if args.after_norm:
                    x_in = Tensor.from_numpy(rng.standard_normal((m, k), np.float32).astype(bfloat16))
                    norm_one = Tensor.from_numpy(np.ones(k, bfloat16))
                    before = lambda: rmsnorm(x_in, norm_one, 1e-6, out=x)  # noqa: E731
                if args.once:
                    profile_once(x, ws[0], out, linear_gemv, linear)
                    continue
                t_gemv = benchmark_graph([lambda w=w: (before(), linear_gemv(x, w, out)) for w in ws])
                t_blas = benchmark_graph([lambda w=w: (before(), linear(x, w, out)) for w in ws])
                res = Tensor.zeros((m, n), float32)
                r_in = Tensor.from_numpy(rng.standard_normal((m, k), np.float32))
                norm_w = Tensor.from_numpy(np.ones(k, bfloat16))
                if proj == "gate_up" and m == 1:  # the one-token path: the SiLU-and-mul epilogue, bf16 [1, I] out
                    act = Tensor.empty((m, n // 2), bfloat16)
                    fused = [lambda w=w: rmsnorm_linear_silu_mul(r_in, norm_w, 1e-6, w, act) for w in ws]
                elif proj in ("qkv", "gate_up", "lm_head"):
                    fused = [lambda w=w: rmsnorm_linear(r_in, norm_w, 1e-6, w, out) for w in ws]
                elif proj == "o" or (proj == "down" and m == 1):  # one token: down takes the activation as is
                    fused = [lambda w=w: linear_add(x, w, res) for w in ws]
                else:
                    gu = Tensor.from_numpy(rng.standard_normal((m, 2 * k), np.float32).astype(bfloat16))
                    fused = [lambda w=w: silu_mul_linear_add(gu, w, res) for w in ws]
                t_fused = benchmark_graph(fused)
                nbytes = n * k * 2 + m * k * 2 + m * n * out_dtype.itemsize
                gbs = nbytes / t_gemv / 1e6
                stage_txt = "inf" if gemv_mod.STAGE_BYTES >= 1 << 40 else f"{gemv_mod.STAGE_BYTES >> 10}K"
                row = (f"{model:5s} {proj:8s} {m:3d} {n:7d} {k:6d} {stage_txt:>6s} {k_slices(m, k)[0]:6d} "
                       f"{t_gemv * 1e3:8.2f} {gbs:6.0f} {100 * gbs / copy:5.0f}% "
                       f"{t_fused * 1e3:8.2f} {t_blas * 1e3:9.2f} {t_blas / t_gemv:10.2f}x")
                if torch is not None:
                    tx = torch.from_numpy(x_np.view(np.int16)).view(torch.bfloat16).cuda()
                    tout = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                    t_torch = torch_graph_median(torch, [lambda w=w: torch.matmul(tx, w.t(), out=tout) for w in tws])
                    row += f" {t_torch * 1e3:9.2f} {t_torch / t_gemv:9.2f}x"
                if args.after_norm:
                    row += f" {benchmark_graph([before]) * 1e3:8.2f}"
                print(row, flush=True)
            del ws, tws
    gemv_mod.STAGE_BYTES = default_stage
    return 0


def profile_once(x, w, out, *ops) -> None:
    """Each op once on (x, w, out) inside a profiler range (after a warm-up call that compiles it)."""
    from cuda.bindings import driver

    from xserv.runtime import synchronize

    for op in ops:
        op(x, w, out)
    synchronize()
    driver.cuProfilerStart()
    for op in ops:
        op(x, w, out)
    synchronize()
    driver.cuProfilerStop()


if __name__ == "__main__":
    sys.exit(main())
