"""Command-line options of `xserv serve` (argparse only: importing this module pulls in no web framework)."""
from __future__ import annotations

import argparse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
