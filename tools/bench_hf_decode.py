"""The `transformers` peer of tools/bench_decode.py: greedy decode tok/s of a Hugging Face folder with a static
KV cache, which generate() compiles with torch.compile itself (its own CUDA-graph decode path), the fastest way
`transformers` offers.

    python -m tools.bench_hf_decode --model DIR [--context 512 --steps 128 --batch-sizes 1,64]

A decode step's time is the difference between two generate() calls of the same prompt that produce
warmup + steps and warmup new tokens, divided by `steps`: prefill and compilation cancel out.
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--no-compile", action="store_true", help="eager transformers (static cache only)")
    args = ap.parse_args(argv)
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        print(f"transformers peer skipped: {exc}")
        return 0
    torch.manual_seed(0)
    model = _load(args.model, torch, AutoModelForCausalLM)
    # the hybrid models' recurrent state has no static cache: they decode with their own dynamic cache, eagerly
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    static = "linear_attention" not in (getattr(text, "layer_types", None) or ())
    mode = ("compiled by generate()" if not args.no_compile else "eager") if static else "eager"
    print(f"device: {torch.cuda.get_device_name()}; transformers, {'static' if static else 'its hybrid'} cache, "
          f"{mode}; context {args.context}")
    print(f"{'batch':>6}{'ms/step':>10}{'tok/s':>12}")
    vocab = text.vocab_size
    for bs in [int(s) for s in args.batch_sizes.split(",")]:
        ids = torch.randint(0, vocab, (bs, args.context), device="cuda")
        mask = torch.ones_like(ids)

        def generate(new):
            torch.cuda.synchronize()
            t = time.perf_counter()
            cache = {"cache_implementation": "static", "disable_compile": args.no_compile} if static else {}
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, **cache)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        long_new = args.warmup + args.steps
        generate(long_new)  # compiles (for this batch size) and warms up
        generate(args.warmup)
        dt = (min(generate(long_new) for _ in range(2)) - min(generate(args.warmup) for _ in range(2))) / args.steps
        print(f"{bs:>6}{dt * 1e3:>10.3f}{bs / dt:>12.1f}", flush=True)
    return 0


def _load(folder, torch, auto):
    """The causal LM of a folder in bf16 on the GPU; a Qwen3.5 release (a multimodal config) through its text model
    class, which reads the text weights of the release layout."""
    import json
    from pathlib import Path

    config = json.loads((Path(folder) / "config.json").read_text())
    if "text_config" in config:
        import transformers

        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    else:
        model = auto.from_pretrained(folder, dtype=torch.bfloat16)
    return model.cuda().eval()


if __name__ == "__main__":
    sys.exit(main())
