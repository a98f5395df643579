"""What every command that runs a model shares (`xserv generate`, `chat`, `serve`, `bench throughput|latency`):
the options that pick and configure the model, and the LLM they load. Below the command modules that use it, so
that none of them imports another for it."""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("xserv")


def add_model_args(p: argparse.ArgumentParser, max_num_seqs: int | None = None) -> None:
    from .engine.config import EngineConfig

    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None,
                   help="a Hugging Face Qwen3 folder or hub id (default: the bundled tiny model, random weights)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda when a GPU is present, else cpu)")
    EngineConfig.add_cli_arguments(p, max_num_seqs=max_num_seqs)


def load_llm(args):
    """The LLM that the parsed model options describe (the bundled tiny model when --model is left out)."""
    from .engine.config import EngineConfig
    from .llm import LLM
    from .models.checkpoint import resolve_model_source

    model = args.model
    if model is None:
        from .models.random_checkpoint import bundled_tiny_model

        model = str(bundled_tiny_model())
        log.warning("no --model given, using the bundled tiny model. Its weights are RANDOM: the answers are "
                    "gibberish. Pass --model PATH (a Qwen3 folder or hub id) for a real model.")
    folder = resolve_model_source(model)  # a bad path is reported before anything about the device
    log.info("loading %s ...", model)
    return LLM(str(folder), device=args.device, config=EngineConfig.from_cli_args(args))
