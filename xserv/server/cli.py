"""`xserv serve`: builds the engine from the command line and runs the HTTP server.

Shutdown: the first SIGTERM or SIGINT starts a drain (new requests and /health get 503, in-flight requests run
to their end for up to --drain-timeout seconds, then the rest are aborted and their blocks freed) and the process
exits 0; a second signal aborts at once. An engine failure ends every in-flight request with an error and exits 1.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

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
    if args.revision is not None and (args.model is None or Path(args.model).expanduser().exists()):
        raise ValueError(f"--revision {args.revision} picks a version of a Hugging Face hub model: give --model a hub "
                         f"id (e.g. Qwen/Qwen3-0.6B), not {'a local folder' if args.model else 'the bundled model'}")
    chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    sockets = listening_sockets(args.host, args.port)  # a port in use fails here, before the model loads
    try:
        return _serve(args, uvicorn, sockets, chat_template)
    finally:
        for sock in sockets:
            sock.close()


def default_served_model_name(model: str | None, folder: Path) -> str:
    """The name /v1/models lists when --served-model-name is not given: a local folder's own name (`Qwen3-0.6B`
    for ~/models/Qwen3-0.6B/, whatever path reached it), a hub id as given (`Qwen/Qwen3-0.6B`: what vLLM lists, so
    what its clients send); `folder` is the model's resolved folder (the bundled model's when `model` is None)."""
    if model is None:
        return folder.name
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def read_chat_template(value: str) -> str:
    """--chat-template's template: the file's text when `value` names a file, else `value` itself, which must then
    be template text (a value without Jinja's braces or a newline is a path that names no file). A template that
    Jinja cannot parse is refused here, before the model loads, not at the first chat request."""
    path = Path(value).expanduser()
    try:
        kind = "file" if path.is_file() else "other" if path.exists() else None
    except OSError:  # template text is no file name (too long, say)
        kind = None
    if kind == "file":
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--chat-template {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        source = str(path)
    elif kind == "other":
        raise ValueError(f"--chat-template {path} is not a file")
    elif any(c in value for c in "{}\n"):
        text, source = value, "the --chat-template text"
    else:
        raise FileNotFoundError(f"--chat-template {value}: no such file (nor a template: it has no Jinja tags)")
    if not text.strip():
        raise ValueError(f"--chat-template: {source} is empty")
    import jinja2

    from ..tokenizer import render_chat_template

    try:
        render_chat_template(text, [{"role": "user", "content": "Hi"}])
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {source} is not a valid Jinja template: {e.message} (line {e.lineno})") \
            from None
    except Exception:  # noqa: BLE001 - it parsed; a template may refuse this one-message chat (raise_exception)
        pass
    return text


def _requirement(package: str) -> str:
    """The version range xserv's installed metadata declares for `package` (e.g. ">=1.0,<2"), or ""."""
    from importlib import metadata

    try:
        requires = metadata.requires("xserv") or []
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return ""
    for line in requires:
        m = re.match(rf"{re.escape(package)}\s*\(?([^;()]*)\)?\s*(;.*)?$", line)
        if m and not (m.group(2) and "extra" in m.group(2)):
            parts = [part.strip() for part in m.group(1).split(",") if part.strip()]
            return ",".join(sorted(parts, key=lambda part: not part.startswith(">")))  # the floor first
    return ""


def _installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def structured_output_error(error: BaseException) -> str:
    """The one-line start-up error when structured output does not work: what failed, llguidance's installed
    version and the command that fixes it."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    version = _installed_version("llguidance")
    installed = f"the installed llguidance {version}" if version else "llguidance, which is not installed"
    spec = _requirement("llguidance")
    return (f"structured output (response_format, guided_*, tool_choice) does not work with {installed} "
            f"({type(error).__name__}: {detail}); every constrained request would fail. Fix: "
            f'pip install -U "llguidance{spec}"')


# the start-up probe: a one-key object, as small as a schema gets while still compiling llguidance's JSON grammar
PROBE_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}


def check_structured_output(engine) -> None:
    """Raise RuntimeError (structured_output_error) unless a constrained request can run: the engine builds a
    sequence's matcher for PROBE_SCHEMA as it does for a request (make_constraint: xserv/structured.py's
    tokenizer and matcher on the loaded tokenizer), its first token mask is computed and the matcher takes one of
    the tokens that the mask allows. A broken or missing llguidance then stops the start with the fix, instead of
    failing every constrained request with a 500. The tokenizer it builds (~2 s for Qwen3's) is the one requests
    reuse."""
    import numpy as np

    try:
        from ..structured import StructuredOutput, fill_masks

        constraint = engine.make_constraint(StructuredOutput.json_schema(PROBE_SCHEMA))
        masks = np.zeros((1, constraint.words), np.int32)
        fill_masks([constraint], masks)
        allowed = np.flatnonzero(np.unpackbits(masks.view(np.uint8), bitorder="little"))  # bit i of word i // 32
        if not allowed.size:
            raise RuntimeError("the matcher's first token mask allows no token")
        if not constraint.consume(int(allowed[0])):
            raise RuntimeError(f"the matcher refused token {allowed[0]}, which its own mask allowed")
    except Exception as e:  # noqa: BLE001 - whatever the installed llguidance raises, the fix is the same
        raise RuntimeError(structured_output_error(e)) from None


def _serve(args, uvicorn, sockets, chat_template: str | None) -> int:
    from ..model_options import load_llm
    from ..models.checkpoint import resolve_model_source

    load_args = args
    if args.revision is not None:  # load_llm takes a folder: the hub revision is fetched here
        folder = resolve_model_source(args.model, revision=args.revision)
        load_args = argparse.Namespace(**{**vars(args), "model": str(folder)})
    llm = load_llm(load_args)
    try:
        if chat_template is not None:
            llm.tokenizer.chat_template = chat_template
        check_structured_output(llm.engine)  # before the first request, while no engine thread runs
        model_name = args.served_model_name or default_served_model_name(args.model, Path(llm.folder))
        return _run(args, uvicorn, sockets, llm, model_name)
    finally:
        llm.close()


def _run(args, uvicorn, sockets, llm, model_name: str) -> int:
    from ..generation_config import sampling_defaults
    from .app import create_app
    from .async_engine import AsyncEngine
    from .context import ServerContext
    from .uvicorn_server import DrainingServer, log_config

    defaults = sampling_defaults(llm.folder)
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
    server.run(sockets=sockets)
    if ctx.engine.error is not None:
        return EXIT_ENGINE_FAILED
    if not server.started:
        raise RuntimeError(f"the server could not start on {args.host}:{port}")
    return 0
