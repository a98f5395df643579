"""uvicorn's Server with xserv's shutdown (see xserv/server/cli.py), its listening sockets and its log setup."""
from __future__ import annotations

import asyncio
import copy
import errno
import logging
import socket

import uvicorn
from uvicorn.config import LOGGING_CONFIG

log = logging.getLogger("xserv.server")


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bind host:port now (before the model loads, so that a port in use is a one-line error at once), the way
    uvicorn would bind it through asyncio's create_server: a socket per address the host resolves to,
    SO_REUSEADDR, IPv6 sockets IPv6-only. uvicorn listens on them (`Server.run(sockets=...)`)."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise RuntimeError(f"cannot listen on {where}: {e.strerror} (--host)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        for sock in sockets:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError(f"port {port} is already in use on {host} (another server?); choose another with "
                               f"--port") from None
        raise RuntimeError(f"cannot listen on {where}: {e.strerror}") from None
    return sockets


def log_config(level: str) -> dict:
    """uvicorn's logging setup plus xserv's own loggers (drain, engine failure, internal errors) in its format
    (`INFO:     draining 2 requests (up to 30 s)`), at `level`."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["xserv"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with xserv's shutdown: drain on the first signal (uvicorn would stop listening and then
    re-raise the signal, which kills the process with status -15), abort on the second."""

    def __init__(self, config, ctx, drain_timeout: float):
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self._drain_task = None

    def handle_exit(self, sig, frame) -> None:  # a signal handler: hand over to the event loop
        loop = getattr(self, "_loop", None)
        if loop is None:
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._on_signal)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _on_signal(self) -> None:
        if self._drain_task is None:
            self.ctx.draining = True
            log.info("draining %d requests (up to %g s); a second signal aborts them", self.ctx.num_requests,
                     self.drain_timeout)
            self._drain_task = asyncio.ensure_future(self._drain())
        else:
            log.warning("second signal: aborting in-flight requests now")
            self.ctx.engine.abort_all()

    async def _drain(self) -> None:
        ctx = self.ctx
        if not await ctx.engine.wait_idle(self.drain_timeout):
            log.warning("drain timeout: aborting %d requests", ctx.num_requests)
            ctx.engine.abort_all()
            await ctx.engine.wait_idle(5.0)
        self.should_exit = True

    def engine_failed(self) -> None:
        async def exit_soon():
            await self.ctx.engine.wait_idle(5.0)  # every stream has got its error event
            self.should_exit = True

        asyncio.ensure_future(exit_soon())
