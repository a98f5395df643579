"""Where a decode step's GPU time goes: the standard workload runs until `--warm` steps have passed, then
torch's profiler (CUPTI: every kernel of the process, graph replays included) records `--steps` engine steps.
Prints the kernels by total time, their sum against the recorded GPU span (the rest is gaps between kernels),
and the device name. GPU machine only (needs torch).

    python -m tools.profile_engine --model DIR [--warm 300 --steps 50 --temperature 0 --kv-cache-dtype fp8_e4m3]
    python -m tools.profile_engine --model DIR --single-context 512 --warm 32 --steps 20 --timeline 16
                                   [--decode-kernel v4s4]

--tensor-parallel-size N records rank 0 only (the workers run the same kernels in lockstep).
--single-context runs one request of that many prompt tokens instead (batch-1 decode); --timeline K prints K
consecutive kernels of one recorded step with their start, duration and the gap before each (with programmatic
dependent launch a kernel may start before the previous one ends: a negative gap).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--warm", type=int, default=300, help="engine steps before recording (default 300)")
    ap.add_argument("--steps", type=int, default=50, help="engine steps recorded (default 50)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--single-context", type=int, default=0, help="one request of this many prompt tokens")
    ap.add_argument("--timeline", type=int, default=0, help="print this many consecutive kernels of one step")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="profile rank 0 of a tensor-parallel engine (its kernels include the all-reduces' waits)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "fp8_e4m3"),
                    help="the KV cache's element type (EngineConfig.kv_cache_dtype)")
    ap.add_argument("--decode-kernel", default="",
                    help="the decode-attention kernel the model runs, shipped or dev "
                         "(tools.dev.kernels.decode_variants())")
    args = ap.parse_args(argv)

    from tools.dev import kernels

    if args.decode_kernel and args.decode_kernel not in kernels.decode_variants():
        ap.error(f"--decode-kernel: unknown kernel {args.decode_kernel!r}; "
                 f"known: {', '.join(kernels.decode_variants())}")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from xserv import LLM, SamplingParams
    from xserv.bench.throughput import make_workload
    from xserv.runtime import get_device, synchronize

    max_len = max(2048, args.single_context + args.warm + args.steps + 8)
    llm = LLM(args.model, device="cuda", max_model_len=max_len, progress=False,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
    if args.decode_kernel:  # the kernel is in the decode graphs: capture them again
        from xserv.ops.attention import decode

        decode.DEFAULT_DECODE = kernels.decode(args.decode_kernel)
        if llm.engine.runner.graphs:
            llm.engine.runner.graphs.clear()
            llm.engine.runner.capture_decode_graphs()
    if args.single_context:
        prompts, out_lens = make_workload(1, (args.single_context,) * 2, (max_len - args.single_context,) * 2, 0,
                                          llm.config.vocab_size)
    else:
        prompts, out_lens = make_workload(256, (100, 1024), (100, 1024), 0, llm.config.vocab_size)
    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=args.temperature, ignore_eos=True, seed=i))
    for _ in range(args.warm):
        engine.step()
    synchronize()
    running = engine.stats()["num_running"]
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        synchronize()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per_name[e.name][0] += e.device_time
        per_name[e.name][1] += 1
    total_us = sum(v[0] for v in per_name.values())
    span_us = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) if kernels else 0
    print(f"{get_device().name}: {args.steps} steps with {running} running sequences recorded; wall {wall * 1e3:.1f} ms, "
          f"GPU span {span_us / 1e3:.1f} ms, kernel time {total_us / 1e3:.1f} ms "
          f"({total_us / max(span_us, 1):.0%} of the span; the rest is gaps between kernels), "
          f"{len(kernels) / args.steps:.0f} kernels per step")
    print(f"{'kernel':<90} {'calls':>7} {'total ms':>9} {'share':>6} {'us/call':>8}")
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{name[:90]:<90} {n:>7} {t / 1e3:>9.2f} {t / total_us:>6.1%} {t / n:>8.1f}")
    if args.timeline and kernels:
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        first = len(ordered) // 2  # from the middle of the recording: a step in full flow
        print(f"{'kernel':<70} {'start us':>9} {'dur us':>8} {'gap us':>8}")
        prev_end = ordered[first - 1].time_range.end
        t0 = ordered[first].time_range.start
        for e in ordered[first:first + args.timeline]:
            print(f"{e.name[:70]:<70} {e.time_range.start - t0:>9.2f} {e.device_time:>8.2f} "
                  f"{e.time_range.start - prev_end:>8.2f}")
            prev_end = e.time_range.end
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
