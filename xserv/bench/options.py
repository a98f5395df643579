"""The `xserv bench` subcommands: their options and dispatch (each benchmark lives in its own module)."""
from __future__ import annotations

import argparse
import importlib

# (name, help, takes the model options)
BENCHMARKS = (
    ("throughput", "offline throughput, many requests at once (the standard workload on a GPU, a small one on the "
                   "CPU)", True),
    ("latency", "batch-1 decode tokens/s and time to first token", True),
    ("serve", "streaming HTTP clients against a running `xserv serve` (or any OpenAI-compatible server)", False),
)


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    importlib.import_module(f".{name}", __package__).add_arguments(p)


def run(args) -> int:
    return importlib.import_module(f".{args.bench_command}", __package__).run(args)
