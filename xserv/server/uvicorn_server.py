"""uvicorn's Server with xserv's shutdown (see xserv/server/cli.py) and its log setup."""
from __future__ import annotations

import asyncio
import copy
import logging

import uvicorn
from uvicorn.config import LOGGING_CONFIG

log = logging.getLogger("xserv.server")


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
