"""`xserv bench serve`."""
from __future__ import annotations


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    raise RuntimeError("xserv bench serve is not built yet")
