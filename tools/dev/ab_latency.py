"""A/B of one xserv plan parameter on one loaded model: time to first token and batch-1 decode for each value, the
model loaded once and the values alternating round by round, so that drift (clocks, heat) falls on all alike and a
48-layer model is read from disk once instead of once a value.

    python -m tools.dev.ab_latency --model DIR --setting xserv.ops.fp8_linear.FP8_GEMM_FROM_M=8,16 \\
        [--input-len 2048] [--output-len 2] [--rounds 3] [--iters 3]

A setting is MODULE.ATTRIBUTE=V1,V2,... (tools/dev/with_setting.py's conversion). It must be one the step reads each
time it runs (prefill runs eagerly above the engine's prefill_graph_tokens; a value captured into a decode graph
would not change by setting it later). Prints each value's median time to first token and decode rate over all its
rounds, and the device's name."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--setting", required=True, metavar="MODULE.ATTRIBUTE=V1,V2,...")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3, help="requests per value and round")
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.5)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    from tools.dev.with_setting import apply
    from xserv.bench.common import device_name
    from xserv.bench.latency import _one
    from xserv.engine.config import EngineConfig
    from xserv.llm import LLM
    from xserv.sampling import SamplingParams

    target, sep, values = args.setting.partition("=")
    module_name, _, attribute = target.rpartition(".")
    if not sep or not values or not module_name:
        ap.error(f"--setting: expected MODULE.ATTRIBUTE=V1,V2,..., got {args.setting!r}")
    values = values.split(",")
    llm = LLM(args.model, device=args.device, config=EngineConfig(
        max_model_len=args.input_len + args.output_len, max_num_seqs=1, gpu_memory_fraction=args.gpu_memory_fraction))
    engine = llm.engine
    rng = np.random.default_rng(0)
    high = min(llm.config.vocab_size, 10_000)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = {v: [] for v in values}
    for value in values:  # warm-up: each value's first-call costs (kernel loads)
        apply(f"{target}={value}")
        _one(engine, rng.integers(0, high, args.input_len).tolist(), params)
    for _ in range(args.rounds):
        for value in values:
            apply(f"{target}={value}")
            # fresh random prompts: nothing comes from the prefix cache
            results[value] += [_one(engine, rng.integers(0, high, args.input_len).tolist(), params)
                               for _ in range(args.iters)]
    print(f"{device_name(llm.device)}: {Path(args.model).name}, prompt {args.input_len} tokens, "
          f"{args.rounds} rounds x {args.iters} requests a value")
    for value in values:
        ttfts = [r[0] for r in results[value]]
        rates = [r[1] for r in results[value] if r[1] is not None]
        rate = f", decode {statistics.median(rates):,.1f} tok/s" if rates else ""
        print(f"  {attribute}={value}: time to first token {1e3 * statistics.median(ttfts):.2f} ms (median; "
              f"min {1e3 * min(ttfts):.2f}, max {1e3 * max(ttfts):.2f}){rate}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
