"""Decode throughput of xserv on the GPU: tokens per second at batch 1 (and other batch sizes if asked).

    python -m tools.bench_decode --model DIR [--context 512 --steps 256 --batch-sizes 1,8,32] [--rounds 2]
                                 [--gemv-rule cublas,small] [--gemv-set ONE_STEP_PLAIN_CTAS_PER_SM=3,4]
                                 [--tokens 32]

Times the engine's decode steps after the prefill (CUDA graphs unless --no-cuda-graphs), greedy sampling on the
device, host loop included: what a user of `xserv chat` sees. Prints the device name, tok/s and the weight bytes
read per second (the memory-bandwidth bound of batch-1 decode).

The decode attention runs as shipped: the A/B forms of its kernels and split plans are the dev registry's
(tools/dev/kernels.py) and are timed by the op benchmarks, which hand the op its variant instead of setting module
attributes: tools/bench_attention.py --decode-variants v4,v2,v4w4,v4s4 and tools/dev/sweep_decode_plan.py (forced
split counts, with and without the fused QK-norm/RoPE entry).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# --gemv-rule: where the projections of 2..16-row steps take the mma GEMV kernel instead of cuBLASLt, as
# xserv.ops.gemv.MMA_PREFERRED's (rows up to, N x K up to, N up to) entries. The rules measured against the shipped
# one (docs/kernels/gemv.md; H200):
MMA_RULES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cublas": (),  # cuBLASLt for every projection above one row
    # where the mma kernel is faster alone, back to back: latency-bound weights (the 0.6B projections: 1.0-1.3x at
    # 2..8 rows, o and down also at 16; the 8B o projection, 32 MB, 1.15-1.2x at up to 4 rows)
    "alone": ((4, 1 << 24, 1 << 30), (8, 1 << 23, 1 << 30), (16, 3 << 20, 1 << 30)),
    "small": ((4, 1 << 24, 1 << 30), (8, 1 << 23, 1 << 30)),  # the same up to 8 rows
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=256, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--unfused", action="store_true",
                    help="small batches through the unfused ops (cuBLASLt + separate norm/activation/add kernels)")
    ap.add_argument("--gemv-rule", default="shipped",
                    help="comma list of rules for the projections of 2..16-row steps: shipped "
                         "(xserv.ops.gemv.MMA_PREFERRED) or a name in MMA_RULES here (cublas, alone, small), timed one "
                         "after the other")
    ap.add_argument("--gemv-set", default="",
                    help="NAME=v1,v2: settings of a numeric plan attribute of xserv.ops.gemv (ROW_SHORT_K_FILL, "
                         "ONE_STEP_PLAIN_CTAS_PER_SM, EARLY_TRIGGER_BYTES, FP8_PREFER_ONE_STEP, ...), timed one after "
                         "the other")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole list this many times (alternating A/B figures in one process)")
    ap.add_argument("--tokens", type=int, default=0,
                    help="after each timing, generate this many greedy tokens from one fixed prompt and say whether "
                         "they equal the first configuration's (kernels that must not change the tokens)")
    args = ap.parse_args(argv)

    from xserv import LLM, SamplingParams
    from xserv.ops import gemv
    from xserv.runtime import get_device, synchronize

    setting, _, values = args.gemv_set.partition("=")
    if setting and not isinstance(getattr(gemv, setting, None), (int, float)):
        ap.error(f"--gemv-set: {setting!r} is not a numeric attribute of xserv.ops.gemv")
    try:
        set_values = [type(getattr(gemv, setting))(float(v)) for v in values.split(",")] if setting else [None]
    except ValueError:
        ap.error(f"--gemv-set: expected NAME=comma list of numbers, got {args.gemv_set!r}")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    max_len = args.context + args.warmup + args.steps + 8
    t = time.perf_counter()
    llm = LLM(args.model, device="cuda", max_model_len=max_len, max_num_seqs=max(sizes),
              kv_cache_tokens=max(sizes) * max_len + 1024, cuda_graphs=not args.no_cuda_graphs)
    load = time.perf_counter() - t
    if args.unfused:  # and the decode graphs captured again, now through the unfused ops
        llm.model.fused_gemv = False
        if not args.no_cuda_graphs:
            llm.engine.runner.graphs.clear()
            llm.engine.runner.capture_decode_graphs()
    weight_bytes = llm.model.weight_bytes()
    print(f"device: {get_device().name}")
    print(f"model: {args.model} ({weight_bytes / 1e9:.2f} GB of weights, loaded in {llm.timings['weights_s']:.1f}s, LLM ready in {load:.1f}s), context "
          f"{args.context}, {args.steps} steps, cuda graphs {'off' if args.no_cuda_graphs else 'on'}")
    print(f"{'batch':>6}{'ms/step':>10}{'tok/s':>12}{'tok/s/seq':>12}{'weights GB/s':>14}{'gemv':>8}{'set':>10}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 1, ignore_eos=True)
    eng = llm.engine
    rules = {"shipped": gemv.MMA_PREFERRED, **MMA_RULES}
    for r in args.gemv_rule.split(","):
        if r not in rules:
            ap.error(f"--gemv-rule: unknown rule {r!r}; expected one of {', '.join(rules)}")
    runs = [(r, f, bs) for _ in range(args.rounds) for r in args.gemv_rule.split(",") for f in set_values
            for bs in sizes]
    probe = np.random.default_rng(1).integers(0, 150000, args.context).tolist()
    first_tokens = None
    for rule, set_value, bs in runs:
        current = getattr(gemv, setting) if setting else None
        wanted = (rules[rule], set_value)  # the decode graphs hold these: capture them again
        if wanted != (gemv.MMA_PREFERRED, current):
            gemv.MMA_PREFERRED = rules[rule]
            if setting:
                setattr(gemv, setting, set_value)
            if not args.no_cuda_graphs:
                eng.runner.graphs.clear()
                eng.runner.capture_decode_graphs()
        seqs = [eng.add_request(rng.integers(0, 150000, args.context).tolist(), params) for _ in range(bs)]
        while any(s.num_computed < len(s.token_ids) - 1 or s.num_output_tokens == 0 for s in seqs):
            eng.step()  # prefill
        for _ in range(args.warmup):
            eng.step()
        synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        synchronize()
        dt = (time.perf_counter() - t) / args.steps
        for s in seqs:
            eng.abort(s)
        same = ""
        if args.tokens:  # prefilled afresh each time: a prefix-cache hit would run the prompt's end another way
            eng.blocks.reset_prefix_cache()
            tokens = llm.generate([probe], SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                          ignore_eos=True))[0].token_ids
            first_tokens = tokens if first_tokens is None else first_tokens
            same = f"  {args.tokens} greedy tokens " + ("as the first" if tokens == first_tokens else
                                                         f"DIFFER from the first at {_first_diff(tokens, first_tokens)}")
        shown = "" if set_value is None else set_value
        print(f"{bs:>6}{dt * 1e3:>10.3f}{bs / dt:>12.1f}{1 / dt:>12.1f}{weight_bytes / dt / 1e9:>14.1f}"
              f"{rule:>8}{shown:>10}{same}")
    return 0


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    sys.exit(main())
