"""Command-line options of `xserv serve` (argparse only: importing this module pulls in no web framework)."""
from __future__ import annotations

import argparse

from .. import settings

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_HEADER_BYTES = 64 << 10


# --dtype's values (vLLM's option): xserv runs the model in bfloat16 whatever the checkpoint stores (float16 and
# float32 weights are converted at load), so these are the values that describe what it does
DTYPES = ("auto", "bfloat16")
_DTYPE_ALIASES = {"bf16": "bfloat16"}


def dtype_argument(text: str) -> str:
    """--dtype's value, checked when the command line is read (a usage error naming the option, before anything
    loads)."""
    value = _DTYPE_ALIASES.get(text, text)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not supported: xserv runs the model in bfloat16 (float16 and float32 checkpoints are "
            f"converted at load); choose {' or '.join(DTYPES)}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port to listen on, 1-65535 (a larger one reached the socket modulo 65536, and 0 is
    any free port: either way not the port the user named)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    # next to --model and --device (xserv/cli.py's "model" group) in the help, where vLLM's users look for them
    m = next((g for g in p._action_groups if g.title == "model"), None) or p.add_argument_group("model")
    m.add_argument("--dtype", type=dtype_argument, default="auto", metavar="DTYPE",
                   help="the model's type: auto (default) or bfloat16; xserv runs the model in bfloat16 (float16 "
                        "and float32 checkpoints are converted at load)")
    m.add_argument("--revision", default=None, metavar="REV",
                   help="the branch, tag or commit of a hub model to fetch (default: main); only with a hub id")
    m.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template, as a file or as the template text itself, in place of the "
                        "tokenizer's (tokenizer_config.json)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=settings.API_KEY.get(), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health (default: the "
                        "XSERV_API_KEY environment variable, which keeps the key out of `ps`; none = open)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: a folder's name, e.g. "
                        "Qwen3-0.6B for --model ~/models/Qwen3-0.6B; a hub id as given, e.g. Qwen/Qwen3-0.6B)")
    g.add_argument("--max-waiting", type=int, default=1024, metavar="N",
                   help="sequences queued beyond the --max-num-seqs running ones before new requests get 503 "
                        "(default 1024)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="B",
                   help=f"largest request body; bigger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES, metavar="B",
                   help=f"largest total size of a request's header fields (names and values); bigger ones get "
                        f"431 (default {DEFAULT_MAX_HEADER_BYTES})")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default 30)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info; warning hides the access log)")
