"""`xserv bench latency`: one request at a time: time to first token for a prompt of `--input-len` tokens, then
decode tokens/s over `--output-len` tokens (median of `--iters` runs). With `--shared-prefix N`, every prompt
starts with the same N tokens (a system prompt): the first request computes them, the later ones find them in the
prefix cache, and the time to first token of the first is reported against the later ones'. With `--roofline` (CUDA),
the device's copy bandwidth and GEMM rate are measured after the runs and the decode rate is set against its
roofline (the weights a one-token step reads + the context's K/V at copy bandwidth; a mixture-of-experts model reads
its k routed experts per sparse layer) and the time to first token against the prompt's FLOP limit (active
parameters at the GEMM rate; xserv/bench/common.py:batch1_limits)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from .common import batch1_limits, device_name, kv_element_bytes, measure_ceilings, moe_summary_line, write_json


def add_arguments(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=512, metavar="N",
                   help="prompt tokens (after the shared prefix, if any; default 512)")
    g.add_argument("--output-len", type=int, default=128, metavar="N", help="tokens to generate (default 128)")
    g.add_argument("--iters", type=int, default=5, metavar="N", help="requests; the median is reported (default 5)")
    g.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="tokens every prompt starts with (default 0: none)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="(default 0 = off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    g.add_argument("--roofline", action="store_true",
                   help="CUDA: measure the copy bandwidth and GEMM rate after the runs and print the share of the "
                        "batch-1 decode roofline and of the time to first token's FLOP limit")


def _one(engine, prompt, params) -> tuple[float, float | None, int]:
    """(time to first token, decode tokens/s after it, prompt tokens served from the prefix cache)."""
    start = time.perf_counter()
    seq = engine.add_request(prompt, params)
    first = None
    while not seq.is_finished:
        engine.step()
        if first is None and seq.num_output_tokens >= 1:
            first = time.perf_counter()
    end = time.perf_counter()
    rate = (seq.num_output_tokens - 1) / (end - first) if seq.num_output_tokens > 1 and end > first else None
    return first - start, rate, seq.num_cached_tokens


def run(args) -> int:
    from ..model_options import load_llm
    from ..sampling import SamplingParams

    for name in ("input_len", "output_len", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shared_prefix < 0:
        raise ValueError(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if args.max_model_len is None:
        args.max_model_len = args.shared_prefix + args.input_len + args.output_len
    if args.max_num_seqs is None:
        args.max_num_seqs = 1
    llm = load_llm(args)
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    high = min(llm.config.vocab_size, 10_000)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, ignore_eos=True, seed=args.seed)
    warm = rng.integers(0, high, min(16, args.input_len)).tolist()
    _one(engine, warm, SamplingParams(max_tokens=min(4, args.output_len)))  # warm-up: first-call costs
    prefix = rng.integers(0, high, args.shared_prefix).tolist()
    runs = [_one(engine, prefix + rng.integers(0, high, args.input_len).tolist(), params)
            for _ in range(args.iters)]
    ttfts = [r[0] for r in runs]
    rates = [r[1] for r in runs if r[1] is not None]
    device = device_name(llm.device)
    result = {"device": device, "model": str(llm.folder), "input_len": args.input_len,
              "output_len": args.output_len, "shared_prefix": args.shared_prefix, "iters": args.iters,
              "ttft_ms": 1e3 * statistics.median(ttfts),
              "decode_tokens_per_s": statistics.median(rates) if rates else None,
              "ttft_ms_each": [1e3 * t for t in ttfts], "cached_tokens_each": [r[2] for r in runs],
              "load_s": {**getattr(llm, "timings", {}), "kernel_compile_s": getattr(llm, "kernel_compile_s", None)}}
    rate = f"{result['decode_tokens_per_s']:,.1f} tok/s" if rates else "n/a"
    print(f"{device}: prompt {args.shared_prefix + args.input_len} tokens: time to first token "
          f"{result['ttft_ms']:.2f} ms (median); decode {rate} at batch 1 (median of {args.iters})")
    if args.shared_prefix and args.iters > 1:
        later = statistics.median(ttfts[1:])
        result.update(first_ttft_ms=1e3 * ttfts[0], later_ttft_ms=1e3 * later)
        print(f"  shared prefix of {args.shared_prefix} tokens: first request {1e3 * ttfts[0]:.2f} ms, later ones "
              f"{1e3 * later:.2f} ms (median; {statistics.median(r[2] for r in runs[1:])} prompt tokens cached)")
    if args.roofline and llm.device == "cuda":
        _print_roofline(llm, args, result)
    elif args.roofline:
        print("  --roofline: the device's ceilings are measured on CUDA only")
    write_json(args.json, result)
    return 0


def _print_roofline(llm, args, result: dict) -> None:
    ceilings = measure_ceilings()
    prompt_len = args.shared_prefix + args.input_len
    lim = batch1_limits(llm.model, prompt_len, args.output_len, ceilings, kv_element_bytes(llm))
    result.update(ceilings=ceilings, roofline=lim)
    copy, gemm = ceilings["copy_bytes_per_s"], ceilings["gemm_flops_per_s"]
    rate = result["decode_tokens_per_s"]
    share = f"this run reached {rate / lim['decode_limit_tokens_per_s']:.1%} of it" if rate else "no decode steps"
    what = "weights"
    if "embedding_bytes_left_out" in lim:
        what = "the weights a step reads (the embedding table left out)"
    print(f"  decode roofline {lim['decode_limit_tokens_per_s']:,.1f} tok/s ({lim['decode_step_bytes'] / 1e9:.3f} "
          f"GB a step: {what} + K/V at mean context {lim['decode_mean_context']:.0f}, at {copy / 1e9:,.0f} GB/s "
          f"copy bandwidth): {share}")
    if "embedding_bytes_left_out" in lim:
        with_embed = lim["decode_limit_tokens_per_s_with_embedding"]
        print(f"    counting the {lim['embedding_bytes_left_out'] / 1e9:.2f} GB embedding table as the dense rooflines "
              f"do: {with_embed:,.1f} tok/s" + (f", {rate / with_embed:.1%} of it" if rate else ""))
    ttft = result["ttft_ms"] / 1e3
    print(f"  time to first token: FLOP limit {lim['ttft_flop_limit_s'] * 1e3:.2f} ms (active parameters at "
          f"{gemm / 1e12:.0f} TFLOP/s; this run at {lim['ttft_flop_limit_s'] / ttft:.1%} of it); the weights a "
          f"{prompt_len}-token prompt reads take {lim['ttft_weight_read_s'] * 1e3:.2f} ms at copy bandwidth (run at "
          f"{max(lim['ttft_flop_limit_s'], lim['ttft_weight_read_s']) / ttft:.1%} of the larger)")
    if "moe" in lim:
        print(moe_summary_line(lim["moe"]))
