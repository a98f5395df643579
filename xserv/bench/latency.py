"""`xserv bench latency`: one request at a time: time to first token for a prompt of `--input-len` tokens, then
decode tokens/s over `--output-len` tokens (median of `--iters` runs)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from .common import device_name, write_json


def add_arguments(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=512, metavar="N", help="prompt tokens (default 512)")
    g.add_argument("--output-len", type=int, default=128, metavar="N", help="tokens to generate (default 128)")
    g.add_argument("--iters", type=int, default=5, metavar="N", help="runs; the median is reported (default 5)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")


def run(args) -> int:
    from ..cli import load_llm
    from ..sampling import SamplingParams

    for name in ("input_len", "output_len", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len
    if args.max_num_seqs is None:
        args.max_num_seqs = 1
    llm = load_llm(args)
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True,
                            seed=args.seed)
    ttfts, rates = [], []
    for i in range(args.iters + 1):  # the first run warms up
        prompt = rng.integers(0, min(llm.config.vocab_size, 10_000), args.input_len).tolist()
        start = time.perf_counter()
        seq = engine.add_request(prompt, params)
        first = None
        while not seq.is_finished:
            engine.step()
            if first is None and seq.num_output_tokens >= 1:
                first = time.perf_counter()
        end = time.perf_counter()
        if i == 0:
            continue
        ttfts.append(first - start)
        if seq.num_output_tokens > 1 and end > first:
            rates.append((seq.num_output_tokens - 1) / (end - first))
    device = device_name(llm.device)
    result = {"device": device, "model": str(llm.folder), "input_len": args.input_len,
              "output_len": args.output_len, "iters": args.iters,
              "ttft_ms": 1e3 * statistics.median(ttfts),
              "decode_tokens_per_s": statistics.median(rates) if rates else None}
    rate = f"{result['decode_tokens_per_s']:,.1f} tok/s" if rates else "n/a"
    print(f"{device}: prompt {args.input_len} tokens: time to first token {result['ttft_ms']:.2f} ms; "
          f"decode {rate} at batch 1 (median of {args.iters})")
    write_json(args.json, result)
    return 0
