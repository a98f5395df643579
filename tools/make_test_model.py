"""Write a Hugging Face-format checkpoint folder (Qwen3 or Llama 3) with random weights at a preset's real shapes.

    python -m tools.make_test_model --preset tiny --out models/tiny-random
    python -m tools.make_test_model --preset 8b --out models/qwen3-8b-random --seed 1
    python -m tools.make_test_model --preset llama3-1b --out models/llama3-1b-random

Norm weights are 1 + N(0, 0.1) (so a kernel that ignores them shows); --unit-norms gives transformers' ones. Every
folder carries the Qwen3 tokenizer; the Llama presets use its vocabulary size and special ids (docs/models.md).
"""
from __future__ import annotations

import argparse
import sys
import time

from xserv.models.config import PRESET_NAMES
from xserv.models.random_checkpoint import DEFAULT_SHARD_SIZE, make_test_model, parse_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.make_test_model", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True, choices=PRESET_NAMES)
    ap.add_argument("--out", required=True, help="output folder (replaced if it exists)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-size", default=str(DEFAULT_SHARD_SIZE),
                    help="shard the weights above this size, e.g. 4GB (default), 500MB, 2GiB")
    ap.add_argument("--unit-norms", action="store_true",
                    help="RMSNorm weights all 1 (as transformers initialises them) instead of 1 + N(0, 0.1)")
    ap.add_argument("--untied", action="store_true", help="force tie_word_embeddings=false (a separate lm_head)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    overrides = {}
    if args.untied:
        overrides["tie_word_embeddings"] = False
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    t0 = time.perf_counter()
    try:
        out = make_test_model(args.preset, args.out, seed=args.seed, dtype=args.dtype,
                              perturb_norms=not args.unit_norms, shard_size=parse_size(args.shard_size),
                              overrides=overrides, progress=False if args.no_progress else None)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {args.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
