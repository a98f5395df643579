"""The `transformers` peer of a mixture-of-experts model's batch-1 figures (Qwen3MoeForCausalLM), bf16 on one GPU:
greedy decode tok/s after a prompt of --context tokens with a dynamic cache (eager), with a static cache (static:
eager too) and with the static cache compiled by generate() (compiled: where transformers allows it for the
architecture; compiling a 48-layer MoE takes minutes), and the time to first token of a --ttft-token prompt (ttft).

    python -m tools.bench_hf_moe --model DIR [--context 512 --steps 32 --modes eager,static,ttft,compiled]

Unlike tools/bench_hf_decode.py this loads straight onto the GPU (device_map="cuda", which needs `accelerate`): a
30B-A3B folder in /dev/shm is 61 GB of host memory already, and a second copy in process memory would not fit a 128 GB
host (without `accelerate` it loads through host memory where that fits, else says so and skips). transformers v5
fuses the per-expert tensors on load itself. A decode step's time is the difference between two generate() calls of
the same prompt producing warmup + steps and warmup new tokens, divided by steps (prefill cancels out). The modes run
in the order given, each printing its line as it ends; one that fails says why and the next one runs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _available_host_bytes() -> int:
    """MemAvailable (/dev/shm's pages are not in it: they cannot be reclaimed)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load(folder: str):
    """The model in bf16 on the GPU: straight there where `accelerate` is installed (transformers needs it for a
    device_map), else through host memory when a copy of the weights fits there (None when it does not)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    direct = importlib.util.find_spec("accelerate") is not None
    if not direct:
        size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
        avail = _available_host_bytes()
        if size * 1.15 > avail:
            print(f"transformers peer skipped: without the `accelerate` package transformers loads through host "
                  f"memory, and {size / 1e9:.1f} GB of weights do not fit the {avail / 1e9:.1f} GB available (carry "
                  f"its wheel: pip download accelerate --no-deps -d .whl)")
            return None
        print(f"(no `accelerate`: loading through host memory, {size / 1e9:.1f} GB of {avail / 1e9:.1f} GB available)")
    kw = {"device_map": "cuda"} if direct else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **kw)
    except TypeError:  # transformers < 4.56 knows only torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, **kw)
    return (model if direct else model.cuda()).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode (default 512)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--modes", default="eager,static,ttft",
                    help="comma list of eager (dynamic cache), static (static cache, not compiled), compiled (static "
                         "cache compiled by generate()), ttft (default eager,static,ttft)")
    ap.add_argument("--ttft", type=int, default=2048, metavar="N", help="prompt tokens of the ttft mode (default 2048)")
    ap.add_argument("--iters", type=int, default=3, help="ttft runs; the median is reported (default 3)")
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as exc:
        print(f"transformers peer skipped: {exc}")
        return 0
    torch.manual_seed(0)
    t = time.perf_counter()
    model = load(args.model)
    if model is None:
        return 0
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    c = model.config
    experts = getattr(c, "_experts_implementation", None) or getattr(c, "experts_implementation", None)
    print(f"device: {torch.cuda.get_device_name()}; transformers {transformers.__version__}, torch "
          f"{torch.__version__}; {type(model).__name__} loaded in {load_s:.1f} s "
          f"({torch.cuda.memory_allocated() / 1e9:.1f} GB on the GPU); attention "
          f"{getattr(c, '_attn_implementation', None)}, experts {experts or 'default'}, compilable "
          f"{getattr(model, '_can_compile_fullgraph', None)}")
    vocab = c.vocab_size
    ids = torch.randint(0, min(vocab, 10_000), (1, args.context), device="cuda")

    def generate(prompt, new, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    decode_modes = {"eager": {}, "static": {"cache_implementation": "static", "disable_compile": True},
                    "compiled": {"cache_implementation": "static"}}
    for mode in args.modes.split(","):
        try:
            if mode == "ttft":
                prompt = torch.randint(0, min(vocab, 10_000), (1, args.ttft), device="cuda")
                generate(prompt, 1)
                times = [generate(prompt, 1) for _ in range(args.iters)]
                print(f"transformers bf16 eager: time to first token, {args.ttft}-token prompt: "
                      f"{statistics.median(times) * 1e3:.1f} ms (median of {args.iters})", flush=True)
                continue
            kw = decode_modes.get(mode)
            if kw is None:
                print(f"{mode}: unknown mode (expected eager, static, compiled or ttft)")
                continue
            long_new = args.warmup + args.steps
            t = time.perf_counter()
            generate(ids, long_new, **kw)  # warms up (and compiles, where generate() does)
            first = time.perf_counter() - t
            dt = (min(generate(ids, long_new, **kw) for _ in range(2))
                  - min(generate(ids, args.warmup, **kw) for _ in range(2))) / args.steps
            print(f"transformers bf16 {mode}: batch-1 decode at context {args.context}: {dt * 1e3:.2f} ms/step, "
                  f"{1 / dt:.1f} tok/s (first call {first:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run says why; the next mode runs
            print(f"transformers bf16 {mode}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
