"""`xserv bench latency`."""
from __future__ import annotations


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    raise RuntimeError("xserv bench latency is not built yet")
