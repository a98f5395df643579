"""What the LLM's engine thread costs: the same requests run through `LLM.generate` / `LLM.stream` (the engine
stepped on its own thread, the caller waiting) and through `LLMEngine.generate` / `LLMEngine.stream` on the
calling thread (the path before the engine thread), alternating, in one process on one loaded model.

    python -m tools.bench_engine_thread --model DIR [--num-seqs 256] [--rounds 2]

Expected: equal within noise. The engine thread does the same host work per step as the caller did; the caller
only waits (a generate call wakes once, when its requests finish; a stream wakes once per token, beside the
engine's next step)."""
from __future__ import annotations

import argparse
import time

from xserv import LLM, SamplingParams
from xserv.bench.common import device_name
from xserv.bench.throughput import make_workload


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=256)
    args = p.parse_args(argv)
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=256)
    print(f"device: {device_name(llm.device)}")
    prompts, out_lens = make_workload(args.num_seqs, (100, 1024), (100, 1024), 0, llm.config.vocab_size)
    params = [SamplingParams(max_tokens=n, temperature=0.6, seed=i, ignore_eos=True) for i, n in enumerate(out_lens)]
    total = sum(out_lens)
    engine = llm.engine
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up (starts the engine thread)

    def offline(threaded: bool) -> float:
        start = time.perf_counter()
        if threaded:
            llm.generate(prompts, params)
        else:
            engine.generate(prompts, params)
        return total / (time.perf_counter() - start)

    one = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    prompt = prompts[1][:512] + prompts[2][:512 - len(prompts[1][:512])]

    def batch1(threaded: bool) -> float:
        stream = llm.stream(prompt, one) if threaded else engine.stream(prompt, one)
        next(stream)  # the first token (prefill) is not decode
        start = time.perf_counter()
        for _ in stream:
            pass
        return (args.decode_tokens - 1) / (time.perf_counter() - start)

    for name, fn, unit in (("offline, standard workload", offline, "output tok/s"),
                           ("batch-1 stream decode, context ~512", batch1, "tok/s")):
        rates = {True: [], False: []}
        for _ in range(args.rounds):
            for threaded in (False, True):
                rates[threaded].append(fn(threaded))
        direct, threaded = max(rates[False]), max(rates[True])
        print(f"{name}: caller-thread engine {direct:,.1f} {unit}, engine thread {threaded:,.1f} {unit} "
              f"(ratio {threaded / direct:.3f}; all rounds {rates})")
    llm.close()


if __name__ == "__main__":
    main()
