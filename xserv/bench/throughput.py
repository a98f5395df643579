"""`xserv bench throughput`: the standard offline workload (nano-vllm's bench): `--num-seqs` requests of random
token ids, prompt and output lengths uniform in the given ranges, `ignore_eos`, all submitted at once. Prints
output and total tokens/s; `--json` writes them, `--plot` draws tokens/s and batch size per step.

On the CPU the defaults are a small workload (CPU_WORKLOAD): the standard one runs half an hour and more there even
for the tiny model. The workload is said on stderr before it runs; progress follows, as a bar on a terminal and as
lines with the time left elsewhere (a log)."""
from __future__ import annotations

import random
import sys
import time

import numpy as np

from .common import (ProgressLines, add_workload_arguments, device_name, kv_element_bytes, measure_ceilings,
                     moe_summary_line, workload_limit, write_json)

# (requests, prompt lengths, output lengths)
STANDARD_WORKLOAD = (256, (100, 1024), (100, 1024))  # nano-vllm's bench.py
CPU_WORKLOAD = (16, (16, 64), (16, 64))  # ~600 output tokens: seconds for the tiny model on two busy cores


def _range_text(r: tuple[int, int]) -> str:
    return f"{r[0]}:{r[1]}" if r[0] != r[1] else str(r[0])


def add_arguments(p) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-seqs", type=int, default=None, metavar="N",
                   help=f"requests (default {STANDARD_WORKLOAD[0]} on a GPU, {CPU_WORKLOAD[0]} on the CPU)")
    add_workload_arguments(g, cpu_lengths=_range_text(CPU_WORKLOAD[1]))
    g.add_argument("--profile", action="store_true",
                   help="time every step on the GPU (events): busy time by step kind and idle gaps")
    g.add_argument("--plot", default=None, metavar="PNG", help="plot tokens/s and batch size per step "
                   "(needs matplotlib: pip install 'xserv[plot]')")


def make_workload(num_seqs: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                  vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of random ordinary token ids and their output lengths, drawn the way nano-vllm's bench.py draws
    them (Python's `random`, lengths inclusive), so that the defaults with seed 0 give the same workload: 256
    requests, 142,892 output tokens."""
    rng = random.Random(seed)
    high = min(vocab - 1, 10_000)
    prompts = [[rng.randint(0, high) for _ in range(rng.randint(*input_len))] for _ in range(num_seqs)]
    out_lens = [rng.randint(*output_len) for _ in range(num_seqs)]
    return prompts, out_lens


def default_workload(device: str) -> tuple[int, tuple[int, int], tuple[int, int]]:
    return CPU_WORKLOAD if device == "cpu" else STANDARD_WORKLOAD


def workload_line(args, device: str, in_tokens: int, out_tokens: int) -> str:
    """What is about to run; on the CPU's default workload, a hint of how long it takes and of the standard one (the
    progress lines then give the time left)."""
    (lo_in, hi_in), (lo_out, hi_out) = args.input_len, args.output_len
    line = (f"xserv bench throughput: {args.num_seqs} requests, prompts of {lo_in}-{hi_in} tokens, outputs of "
            f"{lo_out}-{hi_out} ({in_tokens:,} prompt + {out_tokens:,} output tokens)")
    if device != "cpu" or (args.num_seqs, args.input_len, args.output_len) != CPU_WORKLOAD:
        return line
    n, inp, out = STANDARD_WORKLOAD
    return (f"{line}: the CPU's default workload; expect seconds with the bundled tiny model, minutes with a real "
            f"one (the standard workload, --num-seqs {n} --input-len {_range_text(inp)} --output-len "
            f"{_range_text(out)}, takes half an hour and more on a CPU)")


def run(args) -> int:
    from ..engine_builder import pick_device
    from ..model_options import load_llm
    from ..sampling import SamplingParams

    device = pick_device(args.device, notice=False)
    defaults = default_workload(device)
    for name, value in zip(("num_seqs", "input_len", "output_len"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_seqs < 1:
        raise ValueError(f"--num-seqs must be >= 1, got {args.num_seqs}")
    if args.max_model_len is None:
        args.max_model_len = args.input_len[1] + args.output_len[1]
    if args.max_num_seqs is None:
        args.max_num_seqs = min(args.num_seqs, 256)
    plot = _plot_module() if args.plot else None
    llm = load_llm(args)
    prompts, out_lens = make_workload(args.num_seqs, args.input_len, args.output_len, args.seed,
                                      llm.config.vocab_size)
    base = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True)
    params = [SamplingParams(max_tokens=n, seed=args.seed + i, **base) for i, n in enumerate(out_lens)]
    total_out = sum(out_lens)
    print(workload_line(args, device, sum(len(p) for p in prompts), total_out), file=sys.stderr, flush=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, **base))  # warm-up: first-call costs

    steps: list[tuple[float, int, int]] = []  # (time, running sequences, tokens booked)
    bar = _progress(total_out)

    def on_step(results):
        steps.append((time.perf_counter(), llm.engine.stats()["num_running"], len(results)))
        bar.update(len(results))

    llm.engine.host_seconds.update(dict.fromkeys(llm.engine.host_seconds, 0.0))
    llm.engine.num_steps_ahead = 0
    if args.profile:
        llm.engine.step_profile = []
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_step=on_step)
    elapsed = time.perf_counter() - start
    bar.close()
    out_tokens = sum(len(o.token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    device = device_name(llm.device)
    result = {
        "device": device, "model": str(llm.folder), "num_seqs": args.num_seqs,
        "input_len": list(args.input_len), "output_len": list(args.output_len),
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
        "elapsed_s": elapsed, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed, "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "num_steps": len(steps), "num_preemptions": llm.engine.num_preemptions,
        "host_seconds": {k: round(v, 4) for k, v in llm.engine.host_seconds.items()},
        "num_steps_ahead": llm.engine.num_steps_ahead,
        "steps": {"t": [round(s[0] - start, 5) for s in steps], "running": [s[1] for s in steps],
                  "booked": [s[2] for s in steps]},
    }
    print(f"{device}: {args.num_seqs} requests, {in_tokens} prompt + {out_tokens} output tokens in {elapsed:.2f} s\n"
          f"  output {result['output_tokens_per_s']:,.0f} tok/s   total {result['total_tokens_per_s']:,.0f} tok/s   "
          f"({len(steps)} steps, {llm.engine.num_preemptions} preemptions)\n"
          f"  host seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in llm.engine.host_seconds.items()))
    if out_tokens != total_out:
        print(f"xserv: warning: {out_tokens} output tokens, expected {total_out}", file=sys.stderr)
    if llm.engine.step_profile:
        result["gpu_profile"] = _gpu_profile(llm.engine.step_profile)
        g = result["gpu_profile"]
        print(f"  GPU busy {g['busy_s']:.2f} s (decode graphs {g['graph_s']:.2f} s in {g['graph_steps']} steps, other "
              f"{g['eager_s']:.2f} s in {g['eager_steps']}), idle between steps {g['idle_s']:.2f} s; "
              f"{llm.engine.num_steps_ahead} steps launched ahead")
    if llm.device == "cuda":
        ceilings = measure_ceilings()
        limit = workload_limit(llm.model, [len(p) for p in prompts], out_lens, ceilings, kv_element_bytes(llm))
        result.update(ceilings=ceilings, limit=limit)
        print(f"  limit {limit['limit_s']:.2f} s = {limit['limit_output_tokens_per_s']:,.0f} output tok/s "
              f"(prefill {limit['prefill_s']:.2f} s at {ceilings['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s, decode "
              f"{limit['decode_s']:.2f} s at {ceilings['copy_bytes_per_s'] / 1e9:,.0f} GB/s copy bandwidth): "
              f"this run reached {limit['limit_s'] / elapsed:.0%} of it")
        if "moe" in limit:  # the decode steps read only the experts their sequences touch: say what was assumed
            print(moe_summary_line(limit["moe"]))
    write_json(args.json, result)
    if plot is not None:
        _plot(plot, steps, start, args.plot)
    return 0


def _gpu_profile(records) -> dict:
    """Busy time of the launched steps (first event to last) and the gaps between consecutive steps."""
    busy = {True: 0.0, False: 0.0}
    count = {True: 0, False: 0}
    idle = 0.0
    for i, (events, _rows, _tokens, replayed, _ahead) in enumerate(records):
        events[1].synchronize()
        busy[replayed] += events[0].elapsed_ms(events[1]) / 1e3
        count[replayed] += 1
        if i:
            idle += max(0.0, records[i - 1][0][1].elapsed_ms(events[0]) / 1e3)
    return {"busy_s": busy[True] + busy[False], "graph_s": busy[True], "graph_steps": count[True],
            "eager_s": busy[False], "eager_steps": count[False], "idle_s": idle}


def _progress(total: int):
    """A bar on a terminal, else whole lines (a log's reader sees the run go on and its time left)."""
    from ..progress import progress_bar

    bar = progress_bar(total, "generating", unit="tok", smoothing=0.1)
    return bar if bar is not None else ProgressLines(total, "generating", "output tokens")


def _plot_module():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'xserv[plot]'") from None
    return plt


def _plot(plt, steps, start, path) -> None:
    t = np.array([s[0] - start for s in steps])
    running = np.array([s[1] for s in steps])
    booked = np.cumsum([s[2] for s in steps])
    # tokens/s over a window of steps (a single step's rate is noise: steps that book nothing, or end the run)
    k = max(3, len(steps) // 50)
    t0 = np.concatenate([[0.0] * k, t])[:len(t)]
    b0 = np.concatenate([[0] * k, booked])[:len(booked)]
    rate = (booked - b0) / np.maximum(t - t0, 1e-9)
    fig, ax = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax[0].plot(t, rate, lw=0.8)
    ax[0].set_ylabel("output tokens/s")
    ax[1].plot(t, running, lw=0.8, color="tab:orange")
    ax[1].set_ylabel("running sequences")
    ax[1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)
