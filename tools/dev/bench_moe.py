"""Time each launch of moe_experts on its own (CUDA-graph replays of 20 launches; the inputs of a later stage are
left by a first full call), at Qwen3-30B-A3B's shape by default:

    python -m tools.dev.bench_moe [--tokens 1,8,64,2048] [--experts 128 --top-k 8 --hidden 2048 --inter 768]
                              [--size mid,large] [--tiles path,mma]

Prints per stage microseconds and, for the GEMMs, the bytes of the experts the routing touched (counted from the
routing itself) over the time against the copy bandwidth measured in the same run, and TFLOP/s against cuBLAS."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,2048,8192")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--size", default=None,
                    help="force the GEMM tile shape: small, mid or large, or several (comma-separated) one after another")
    ap.add_argument("--tiles", default="path",
                    help="the mid and large tiles: 'path' (the device's: wgmma on the hopper path), 'mma' (moe.cu's "
                         "mma.sync tiles, the portable path's), or both one after another (path,mma)")
    args = ap.parse_args(argv)

    from tools._bench_util import copy_bandwidth_gbs, gemm_tflops
    from xserv.ops.moe import MoeShape, MoeWorkspace, moe_stages
    from xserv.runtime import get_runtime, synchronize
    from xserv.runtime.timing import benchmark_graph
    from xserv.tensor import Tensor, bfloat16
    from xserv.testing import random_array

    rt = get_runtime()
    print(f"device: {rt.device.info.name}")
    bw, peak = copy_bandwidth_gbs(), gemm_tflops()
    print(f"copy {bw:.0f} GB/s, cuBLAS bf16 {peak:.0f} TFLOP/s")
    e, k, h, inter = args.experts, args.top_k, args.hidden, args.inter
    rng = np.random.default_rng(0)
    shape = MoeShape(e, k, h, inter)
    router = Tensor.from_numpy(random_array(rng, (e, h), bfloat16, mean=0.0, std=0.5 / np.sqrt(h)))
    gate_up = Tensor.from_numpy(random_array(rng, (e, 2 * inter, h), bfloat16, mean=0.0, std=0.05))
    down = Tensor.from_numpy(random_array(rng, (e, h, inter), bfloat16, mean=0.0, std=0.05))
    sizes = args.size.split(",") if args.size else [None]
    if set(sizes) - {None, "small", "mid", "large"}:
        ap.error(f"--size: expected small, mid or large, got {args.size!r}")
    tile_forms = args.tiles.split(",")
    if set(tile_forms) - {"path", "mma"}:
        ap.error(f"--tiles: expected path, mma or path,mma, got {args.tiles!r}")
    token_counts = [int(v) for v in args.tokens.split(",")]
    for t, size, tiles in ((t, size, tiles) for t in token_counts for size in sizes for tiles in tile_forms):
        x = Tensor.from_numpy(random_array(np.random.default_rng(t), (t, h), bfloat16, mean=0.0))
        out = Tensor.empty((t, h), bfloat16, "cuda")
        ws = MoeWorkspace(shape, t, "cuda")
        stages = moe_stages(x, router, gate_up, down, shape, True, out, ws, t, size=size,
                            portable_tiles=tiles == "mma")
        for _, launch in stages:
            launch()
        synchronize()
        touched = len(np.unique(ws.ids.numpy()[:t * k]))
        expert_bytes = touched * 3 * h * inter * 2
        flops = t * k * 3 * h * inter * 2
        total = 0.0
        line = []
        for name, launch in stages:
            us = benchmark_graph([launch], calls=20, iters=args.iters) * 1e3
            total += us
            extra = ""
            if name.startswith(("gate_up", "down")):
                part = expert_bytes * (2 / 3 if name.startswith("gate_up") else 1 / 3)
                extra = f" ({part / us / 1e3 / bw:.0%} copy, {flops * (2 / 3 if name.startswith('gate_up') else 1 / 3) / us / 1e6 / peak:.0%} gemm)"
            line.append(f"{name} {us:.1f}{extra}")
        floor = max(expert_bytes / bw / 1e3, flops / peak / 1e6)
        label = "".join([f" {size}" if size else "", f" tiles={tiles}" if len(tile_forms) > 1 else ""])
        print(f"T={t:5d}{label} touched {touched:3d}: " + ", ".join(line) + f" | sum {total:.1f} us, floor {floor:.1f} us "
              f"({floor / total:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
