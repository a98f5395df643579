"""`xserv make-test-model` (also `python -m tools.make_test_model` in a source tree): write a Hugging Face-format
checkpoint folder (Qwen3, Qwen3-MoE or Llama 3) with random weights at a preset's real shapes.

    xserv make-test-model --preset tiny --out models/tiny-random
    xserv make-test-model --preset 8b --out models/qwen3-8b-random --seed 1
    xserv make-test-model --preset 30b-a3b --out /dev/shm/qwen3-30b-a3b-random   # 61 GB, one thread per core
    xserv make-test-model --preset 8b --fp8 --out models/qwen3-8b-fp8-random     # Qwen3-8B-FP8's layout
    xserv make-test-model --preset llama3-1b --out models/llama3-1b-random

Norm weights are 1 + N(0, 0.1) (so a kernel that ignores them shows); --unit-norms gives transformers' ones. Every
folder carries the Qwen3 tokenizer; the Llama presets use its vocabulary size and special ids (docs/models.md).
The writing itself is xserv/models/random_checkpoint.py; this module holds only the command's options, and stays
light to import (the `xserv` parser is built on every start).
"""
from __future__ import annotations

import argparse
import sys
import time

from .config import PRESET_NAMES

DESCRIPTION = ("Write a Hugging Face-format checkpoint folder (Qwen3, Qwen3-MoE or Llama 3) with random weights at a "
               "preset's real shapes, with the Qwen3 tokenizer: a model to try xserv on without downloading one.")
EPILOG = """\
examples:
  {prog} --preset tiny --out models/tiny-random
  {prog} --preset 0.6b --out models/qwen3-0.6b-random --seed 1
  {prog} --preset 30b-a3b --out /dev/shm/qwen3-30b-a3b-random --workers 16
  {prog} --preset 8b --fp8 --out models/qwen3-8b-fp8-random
  {prog} --preset llama3-1b --out models/llama3-1b-random --shard-size 500MB"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", required=True, choices=PRESET_NAMES, help="the model's shapes")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="output folder: a new or empty one, or one make-test-model wrote before (replaced); any "
                         "other folder is refused unless --force")
    ap.add_argument("--force", action="store_true",
                    help="replace --out whatever it holds (everything in it is deleted)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0; the same seed, the same weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="weight dtype (default bfloat16)")
    ap.add_argument("--shard-size", default=None, metavar="SIZE",
                    help="shard the weights above this size, e.g. 500MB, 2GiB (default 4GB, as transformers does)")
    ap.add_argument("--fp8", action="store_true",
                    help="an FP8 checkpoint as Qwen publishes them (-FP8): e4m3 linear weights in 128x128 blocks with "
                         "float32 *.weight_scale_inv, embeddings, norms, lm_head and MoE routers in --dtype")
    ap.add_argument("--unit-norms", action="store_true",
                    help="RMSNorm weights all 1 (as transformers initialises them) instead of 1 + N(0, 0.1)")
    ap.add_argument("--untied", action="store_true", help="force tie_word_embeddings=false (a separate lm_head)")
    ap.add_argument("--layers", type=int, default=None, metavar="N", help="override num_hidden_layers")
    ap.add_argument("--workers", type=int, default=None, metavar="N",
                    help="threads generating and writing the tensors (default: 1 below 1 GiB, else one per core); "
                         "the same bytes for any N")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stderr is "
                                                               "not a terminal)")


def run(args: argparse.Namespace) -> int:
    """Write the folder the parsed options describe; print where to stdout. A bad value or a folder that cannot be
    written raises ValueError or OSError (the caller reports it)."""
    from pathlib import Path

    from .random_checkpoint import DEFAULT_SHARD_SIZE, check_replaceable, make_test_model, parse_size

    overrides = {}
    if args.untied:
        overrides["tie_word_embeddings"] = False
    if args.layers is not None:
        if args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        overrides["num_hidden_layers"] = args.layers
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    # refused here in the command line's words (make_test_model checks again before it replaces anything)
    check_replaceable(Path(args.out).expanduser().resolve(), force=args.force, force_name="--force")
    start = time.perf_counter()
    out = make_test_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, workers=args.workers,
                          perturb_norms=not args.unit_norms,
                          shard_size=DEFAULT_SHARD_SIZE if args.shard_size is None else parse_size(args.shard_size),
                          overrides=overrides, progress=False if args.no_progress else None, fp8=args.fp8,
                          force=args.force)
    kind = f"FP8 e4m3 128x128 blocks, others {args.dtype}" if args.fp8 else args.dtype
    print(f"wrote {out} ({args.preset}, seed {args.seed}, {kind}) in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv=None, prog: str = "xserv make-test-model") -> int:
    """The command on its own (`python -m tools.make_test_model`): usage errors exit 2, as do values it refuses."""
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG.format(prog=prog),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
