"""`xserv serve`: builds the engine from the command line and runs the HTTP server.

Shutdown: the first SIGTERM or SIGINT starts a drain (new requests and /health get 503, in-flight requests run
to their end for up to --drain-timeout seconds, then the rest are aborted and their blocks freed) and the process
exits 0; a second signal aborts at once. An engine failure ends every in-flight request with an error and exits 1.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("xserv.server")

EXIT_ENGINE_FAILED = 1
H11_HEAD_SLACK = 64 << 10  # a request head's bytes beyond its header fields: the request line, ": " and CRLFs


def _import_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise RuntimeError(f"xserv serve needs the server extra ({e.name} is missing): "
                           f"pip install 'xserv[server]'") from None
    return uvicorn


def cmd_serve(args) -> int:
    uvicorn = _import_web()
    from .uvicorn_server import listening_sockets

    for name in ("max_waiting", "max_request_bytes", "max_header_bytes"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    sockets = listening_sockets(args.host, args.port)  # a port in use fails here, before the model loads
    try:
        return _serve(args, uvicorn, sockets)
    finally:
        for sock in sockets:
            sock.close()


def _serve(args, uvicorn, sockets) -> int:
    from ..cli import load_llm
    from ..generation_config import sampling_defaults
    from .app import create_app
    from .async_engine import AsyncEngine
    from .openai_api import ServerContext
    from .uvicorn_server import DrainingServer, log_config

    llm = load_llm(args)
    defaults = sampling_defaults(llm.folder)
    model_name = args.served_model_name or args.model or str(llm.folder)
    server_box: list = []

    def on_broken(error: BaseException) -> None:
        log.error("the engine failed (%s: %s); ending in-flight requests and exiting", type(error).__name__, error)
        server_box[0].engine_failed()

    ctx = ServerContext(engine=AsyncEngine(llm.engine_thread, on_broken=on_broken),
                        tokenizer=llm.tokenizer,
                        model_name=model_name, max_model_len=llm.max_model_len, vocab_size=llm.config.vocab_size,
                        max_in_flight=llm.engine_config.max_num_seqs + args.max_waiting, sampling_defaults=defaults)
    app = create_app(ctx, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     max_header_bytes=args.max_header_bytes)
    # h11 (uvicorn's fallback without httptools) refuses a request head that arrives in pieces larger than its
    # buffer (default 16 KiB) with a bare 400: give it room for every head that the Guard's 431 limit lets through
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            log_config=log_config(args.log_level), lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=5, h11_max_incomplete_event_size=args.max_header_bytes + H11_HEAD_SLACK)
    server = DrainingServer(config, ctx, args.drain_timeout)
    server_box.append(server)
    port = sockets[0].getsockname()[1]
    print(f"xserv: serving {model_name!r} on http://{args.host}:{port} (sampling defaults {defaults or 'none'}"
          f"{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
    try:
        server.run(sockets=sockets)
    finally:
        llm.close()
    if ctx.engine.error is not None:
        return EXIT_ENGINE_FAILED
    if not server.started:
        raise RuntimeError(f"the server could not start on {args.host}:{port}")
    return 0
