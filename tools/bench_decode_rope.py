"""Decode attention with the q/k head norm, RoPE and the KV-cache write folded in (attention_decode_rope) against
the two ops it replaces (qk_norm_rope_write_kv + attention_decode), timed as CUDA-graph replays of one decode step's
worth of layers (each layer its own cache and weights, as in the model, so the step's bytes exceed L2):

    alone   the attention block of each layer: the two ops (pair) or the fused op
    chain   the model's PDL chain around it: qkv GEMV (rmsnorm_linear) -> attention block -> o projection (linear_add);
            batch 1 only (the fused one-token forward); "gemvs" is the chain without the attention block

Prints µs per layer, the plan (splits x chunk) and the device. The fused op is timed in each --modes setting of its
launch (xserv.ops.attention.decode's switches): spread (programmatic dependent launch, at most ceil(CTAs / SMs)
CTAs per SM: the default), pdl (PDL alone), nopdl (a plain launch). Runs where attention_decode_rope does not exist
(a checkout before it) and times the pair only, so that one script measures before and after.

    python -m tools.bench_decode_rope [--only TEXT] [--iters 20] [--modes spread,pdl,nopdl]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [  # (label, B, HQ, HKV, LKV, D, hidden (batch 1: the chain), layers per graph)
    ("0.6B 1x520", 1, 16, 8, 520, 128, 1024, 28),
    ("8B 1x520", 1, 32, 8, 520, 128, 4096, 36),
    ("0.6B 1x4096", 1, 16, 8, 4096, 128, 1024, 28),
    ("8B 1x32768", 1, 32, 8, 32768, 128, 4096, 6),
    ("0.6B 64x520", 64, 16, 8, 520, 128, 0, 8),
    ("8B 64x520", 64, 32, 8, 520, 128, 0, 8),
]
EPS = 1e-6
BLOCK = 16


def _pool(rng):
    from xserv.tensor import bfloat16
    from xserv.testing import random_array

    return random_array(rng, (1 << 22,), bfloat16, mean=0.0)


def _fill(pool, shape, scale=1.0):
    out = np.resize(pool, math.prod(shape)).reshape(shape)
    return out if scale == 1.0 else (out.astype(np.float32) * scale).astype(pool.dtype)


def _layer(rng, pool, b, hq, hkv, lkv, d, hidden):
    """One layer's device buffers: cache (the newest slot of each sequence in it), qkv, weights."""
    from xserv.tensor import Tensor, bfloat16

    per_seq = -(-lkv // BLOCK)
    num_blocks = b * per_seq + 1
    t = dict(k_cache=Tensor.from_numpy(_fill(pool[rng.integers(1 << 20):], (num_blocks, BLOCK, hkv, d))),
             v_cache=Tensor.from_numpy(_fill(pool[rng.integers(1 << 20):], (num_blocks, BLOCK, hkv, d))),
             qkv=Tensor.from_numpy(_fill(pool[rng.integers(1 << 20):], (b, hq + 2 * hkv, d))),
             out=Tensor.empty((b, hq, d), bfloat16, "cuda"))
    if hidden:
        t["w_qkv"] = Tensor.from_numpy(_fill(pool[rng.integers(1 << 20):], ((hq + 2 * hkv) * d, hidden), 0.03))
        t["w_o"] = Tensor.from_numpy(_fill(pool[rng.integers(1 << 20):], (hidden, hq * d), 0.03))
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="configs whose label contains this text")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--modes", default="spread,pdl,nopdl", help="launch settings of the fused op to time")
    args = ap.parse_args(argv)
    modes = {"spread": (True, True), "pdl": (True, False), "nopdl": (False, False)}  # (FUSED_PDL, SPREAD_CTAS)

    from xserv.ops import attention as A
    from xserv.ops.attention import decode as D
    from xserv.ops.gemv import linear_add, rmsnorm_linear
    from xserv.ops.rope import qk_norm_rope_write_kv, rope_cos_sin_table
    from xserv.runtime import get_device
    from xserv.runtime.timing import benchmark_graph
    from xserv.tensor import Tensor, bfloat16, float32
    from xserv.testing import random_array

    fused_op = getattr(A, "attention_decode_rope", None)
    dev = get_device()
    print(f"device: {dev.name} ({dev.arch}, {dev.multiprocessor_count} SMs, L2 {dev.info.l2_cache_bytes >> 20} MiB); "
          f"attention_decode_rope {'present' if fused_op else 'absent (pair only)'}")
    print(f"{'config':14s} {'plan':>9s} {'variant':>13s} {'alone us':>9s} {'chain us':>9s}   (µs per layer, CUDA-graph "
          f"replays of one step's layers; chain = qkv GEMV + attention block + o projection)")
    rng = np.random.default_rng(0)
    pool = _pool(rng)
    for label, b, hq, hkv, lkv, d, hidden, layers in CONFIGS:
        if args.only and args.only not in label:
            continue
        per_seq = -(-lkv // BLOCK)
        tables_np = np.arange(b * per_seq, dtype=np.int32).reshape(b, per_seq)
        tables_np = rng.permutation(b * per_seq + 1)[tables_np].astype(np.int32)  # permuted blocks
        slots_np = (tables_np[:, (lkv - 1) // BLOCK] * BLOCK + (lkv - 1) % BLOCK).astype(np.int32)
        table = rope_cos_sin_table(d, lkv + 8, 1e6)
        common = dict(positions=Tensor.from_numpy(np.full(b, lkv - 1, np.int32)), cos_sin=Tensor.from_numpy(table),
                      slots=Tensor.from_numpy(slots_np), kv_lens=Tensor.from_numpy(np.full(b, lkv, np.int32)),
                      tables=Tensor.from_numpy(tables_np),
                      qw=Tensor.from_numpy(random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)),
                      kw=Tensor.from_numpy(random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)))
        if hidden:
            common["residual"] = Tensor.from_numpy(random_array(rng, (b, hidden), float32, mean=0.0))
            common["norm_w"] = Tensor.from_numpy(random_array(rng, (hidden,), bfloat16, mean=1.0, std=0.1))
        sets = [_layer(rng, pool, b, hq, hkv, lkv, d, hidden) for _ in range(layers)]
        c = common
        scale = 1.0 / math.sqrt(d)

        def pair(t):
            qk_norm_rope_write_kv(t["qkv"], c["qw"], c["kw"], c["positions"], c["cos_sin"], hq, hkv, EPS,
                                  t["k_cache"], t["v_cache"], c["slots"], pdl=True)
            A.attention_decode(t["qkv"], t["k_cache"], t["v_cache"], c["kv_lens"], c["tables"], scale, lkv,
                               out=t["out"], num_q_heads=hq)

        def fused(t):
            fused_op(t["qkv"], c["qw"], c["kw"], c["positions"], c["cos_sin"], hq, EPS, t["k_cache"], t["v_cache"],
                     c["slots"], c["kv_lens"], c["tables"], scale, lkv, out=t["out"])

        def chain(block):
            def run(t):
                rmsnorm_linear(c["residual"], c["norm_w"], EPS, t["w_qkv"], out=t["qkv"].view(b, -1))
                if block is not None:
                    block(t)
                linear_add(t["out"].view(b, -1), t["w_o"], c["residual"])
            return run

        def time_it(fn, sets=sets):
            return benchmark_graph([lambda t=t: fn(t) for t in sets], calls=layers, iters=args.iters) * 1e3

        _, splits, chunk = D.plan_decode("v4", b, hkv, lkv, BLOCK, d, hq // hkv, dev.multiprocessor_count)
        head = f"{label:14s} {f'{splits}x{chunk}':>9s}"

        def show(name, block):
            chained = f"{time_it(chain(block)):9.2f}" if hidden else f"{'-':>9s}"
            alone = f"{time_it(block):9.2f}" if block is not None else f"{'-':>9s}"
            print(f"{head} {name:>13s} {alone} {chained}", flush=True)

        show("pair", pair)
        if fused_op:
            saved = (D.FUSED_PDL, D.SPREAD_CTAS)
            for mode in [m for m in args.modes.split(",") if m]:
                D.FUSED_PDL, D.SPREAD_CTAS = modes[mode]
                show(f"fused {mode}", fused)
            D.FUSED_PDL, D.SPREAD_CTAS = saved
        if hidden:
            show("gemvs only", None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
