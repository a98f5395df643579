"""`xserv serve`: builds the engine from the command line and runs the HTTP server."""
from __future__ import annotations


def cmd_serve(args) -> int:
    raise RuntimeError("xserv serve is not built yet")
