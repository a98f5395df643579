"""The FastAPI application: routes, the API-key and body-size guard, and OpenAI-shaped errors for everything
(bad JSON, wrong types, unknown routes, internal faults: never a traceback in a response)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat_endpoint import ChatEndpoint
from .context import ServerContext
from .metrics import CONTENT_TYPE
from .openai_api import CompletionEndpoint, Endpoint
from .options import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_REQUEST_BYTES
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, validation_error

log = logging.getLogger("xserv.server")

BODY_TOO_LARGE = "xserv.body_too_large"  # set in the ASGI scope when the guard cut a body off


def _json(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False, separators=(",", ":")), status, headers,
                    media_type="application/json")


class Guard:
    """ASGI middleware in front of everything: the header-size limit (431), the API key (every route but /health;
    constant-time comparison) and the body-size limit (413 from Content-Length alone, or as soon as a chunked body
    passes the limit: a large body is never read whole).

    The header limit is decided here, not by uvicorn: httptools takes a request head of any size and h11 refuses
    one only when it arrives in pieces larger than its buffer (then with a bare 400); see cli.py for h11's
    buffer."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int, max_header_bytes: int):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > self.max_header_bytes:
            return await _send(send, 431, error_body(
                431, f"the request headers are {header_bytes} bytes, more than {self.max_header_bytes} "
                     f"(--max-header-bytes)", None, "request_headers_too_large"))
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send(send, 401, error_body(401, "a valid API key is required: send the header "
                                                              "'Authorization: Bearer KEY'", None, "invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send(send, 413, _too_large(self.max_bytes))
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    scope[BODY_TOO_LARGE] = True
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send(send, 413, _too_large(self.max_bytes))


def _too_large(max_request_bytes: int) -> dict:
    return error_body(413, f"the request body is larger than {max_request_bytes} bytes (--max-request-bytes)", None,
                      "request_too_large")


class _BodyTooLarge(Exception):
    pass


async def _send(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _until_disconnect(request: Request, work):
    """Run `work` (a non-streaming request) unless the client goes away first; then cancel it (which aborts the
    request in the engine) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    return task.result()


def create_app(ctx: ServerContext, *, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES):
    @asynccontextmanager
    async def lifespan(app):
        ctx.engine.start()
        try:
            yield
        finally:
            ctx.engine.abort_all()
            await ctx.engine.stop()

    app = FastAPI(title="xserv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return _json(e.body(), e.status, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return _json(err.body(), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        if request.scope.get(BODY_TOO_LARGE):
            return _json(_too_large(max_request_bytes), 413)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _json(error_body(e.status_code, message.get(e.status_code, str(e.detail))), e.status_code)

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return _json(error_body(500, f"internal server error ({type(e).__name__})"), 500)

    async def serve(endpoint: Endpoint, request: Request):
        start = time.perf_counter()
        run = await endpoint.prepare(start)
        if endpoint.req.stream:
            return StreamingResponse(endpoint.stream(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await _until_disconnect(request, endpoint.respond(run))
        if body is None:
            return Response(status_code=499)  # nobody is listening any more
        return _json(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serve(ChatEndpoint(ctx, req), request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serve(CompletionEndpoint(ctx, req), request)

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": 0,
                                                  "owned_by": "xserv", "max_model_len": ctx.max_model_len}]})

    @app.get("/health")
    async def health():
        if ctx.engine.error is not None:
            return _json({"status": "engine failed"}, 503)
        if ctx.draining or not ctx.engine.running:
            return _json({"status": "draining"}, 503)
        return _json({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(ctx.engine.stats()), media_type=CONTENT_TYPE)

    return Guard(app, api_key, max_request_bytes, max_header_bytes)
