"""`xserv bench latency`: one request at a time: time to first token for a prompt of `--input-len` tokens, then
decode tokens/s over `--output-len` tokens (median of `--iters` runs). With `--shared-prefix N`, every prompt
starts with the same N tokens (a system prompt): the first request computes them, the later ones find them in the
prefix cache, and the time to first token of the first is reported against the later ones'."""
from __future__ import annotations

import statistics
import time

import numpy as np

from .common import device_name, write_json


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
    from ..cli import load_llm
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
              "ttft_ms_each": [1e3 * t for t in ttfts], "cached_tokens_each": [r[2] for r in runs]}
    rate = f"{result['decode_tokens_per_s']:,.1f} tok/s" if rates else "n/a"
    print(f"{device}: prompt {args.shared_prefix + args.input_len} tokens: time to first token "
          f"{result['ttft_ms']:.2f} ms (median); decode {rate} at batch 1 (median of {args.iters})")
    if args.shared_prefix and args.iters > 1:
        later = statistics.median(ttfts[1:])
        result.update(first_ttft_ms=1e3 * ttfts[0], later_ttft_ms=1e3 * later)
        print(f"  shared prefix of {args.shared_prefix} tokens: first request {1e3 * ttfts[0]:.2f} ms, later ones "
              f"{1e3 * later:.2f} ms (median; {statistics.median(r[2] for r in runs[1:])} prompt tokens cached)")
    write_json(args.json, result)
    return 0
