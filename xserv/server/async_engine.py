"""The one interface between the HTTP server and the engine.

The engine runs on its LLM's engine thread (xserv/engine/engine_thread.py), the one thread that calls its methods;
the library's callers may share it with the server. This module serves that thread to coroutines: a request is
submitted with a handle whose sink hands each step's batch of updates to the event loop (`call_soon_threadsafe`),
which files them under the request and wakes its reader. No HTTP handler ever waits on a step.

A failed step (a CUDA error, say) marks the engine broken: every in-flight request gets an `EngineBroken` error
instead of its next update, new requests are refused, and `on_broken` is called on the event loop so that the
server can report 503 and exit non-zero.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from ..engine.engine_thread import EngineBroken, EngineStopped, EngineThread, Submission, Update

__all__ = ["AsyncEngine", "EngineBroken", "EngineStopped", "Update"]


def _merged(updates: list[Update]) -> list[Update]:
    """One update per choice out of several (in arrival order): texts and logprobs joined, the latest counts."""
    if len(updates) == 1:
        return updates
    by_index: dict[int, list[Update]] = {}
    for u in updates:
        by_index.setdefault(u.index, []).append(u)
    out = []
    for index, us in by_index.items():
        if len(us) == 1:
            out.append(us[0])
            continue
        last = us[-1]
        logprobs = None
        if any(u.logprobs is not None for u in us):
            logprobs = [entry for u in us for entry in (u.logprobs or ())]
        out.append(Update(index, "".join(u.text for u in us), last.num_tokens, logprobs, last.finish_reason,
                          last.num_cached_tokens, last.output))
    return out


class RequestHandle:
    """One request (n choices) as the event loop sees it. Updates land in `pending` (a plain list: the engine
    hands over one batch per step, and the consumer takes everything at once) and `waiter` wakes the consumer."""

    __slots__ = ("num_choices", "pending", "waiter", "accepted", "num_prompt_tokens", "num_unfinished", "sink")

    def __init__(self, num_choices: int, sink: Callable):
        self.num_choices = num_choices
        self.pending: list = []  # Update | BaseException, not yet taken by generate()
        self.waiter: asyncio.Future | None = None
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.num_prompt_tokens = 0
        self.num_unfinished = num_choices
        self.sink = sink  # called on the engine thread with each step's [(handle, item)] for this server


class AsyncEngine:
    """Serves an engine thread (see the module doc) to coroutines.

    `generate()` is the whole per-request API: it yields `Update`s and aborts the request if the caller stops
    early (a client disconnect cancels the coroutine). `stats()` is the engine's latest `stats()` snapshot.
    """

    def __init__(self, thread: EngineThread, *, on_broken: Callable[[BaseException], None] | None = None):
        self.thread = thread
        self.on_broken = on_broken
        self.num_in_flight = 0  # sequences submitted and not finished (event-loop side count)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()

    # ---- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving; call from the event loop that will consume the updates."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self.thread.on_broken = self._broken
        self.thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs, free its blocks and end the engine thread."""
        await asyncio.to_thread(self.thread.stop)

    @property
    def error(self) -> BaseException | None:
        return self.thread.error

    @property
    def running(self) -> bool:
        return self.thread.running

    def stats(self) -> dict:
        return self.thread.stats()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False when the timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self) -> None:
        self.thread.abort_all()

    # ---- requests -----------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params_per_choice: list, prompt_text: str | None = None
                       ) -> AsyncIterator[list[Update]]:
        """Submit one request (one SamplingParams per choice) and yield its new updates, a list at a time (all
        that arrived since the caller last asked, at most one per choice: a slow reader gets bigger, fewer
        updates), until every choice finished. Raises ValueError when the engine rejects the prompt,
        EngineBroken / EngineStopped when it cannot serve. Leaving the loop early (or being cancelled) aborts
        the request."""
        if self.error is not None:
            raise EngineBroken(f"the engine failed: {self.error}")
        if not self.running:
            raise EngineStopped("the engine is not running")
        handle = RequestHandle(len(params_per_choice), self._sink)
        self._enter(handle.num_choices)
        self.thread.submit(Submission(handle, prompt_ids, params_per_choice, prompt_text))
        try:
            await handle.accepted
            while handle.num_unfinished:
                if not handle.pending:
                    handle.waiter = self._loop.create_future()
                    await handle.waiter
                    handle.waiter = None
                items, handle.pending = handle.pending, []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if item.finish_reason is not None:
                        handle.num_unfinished -= 1
                        self._leave(1)
                yield _merged(items)
        finally:
            if handle.num_unfinished:
                self._leave(handle.num_unfinished)
                handle.num_unfinished = 0
                self.thread.abort(handle)

    def _enter(self, n: int) -> None:
        self.num_in_flight += n
        self._idle.clear()

    def _leave(self, n: int) -> None:
        self.num_in_flight -= n
        if self.num_in_flight <= 0:
            self.num_in_flight = 0
            self._idle.set()

    # ---- from the engine thread ---------------------------------------------------------------------------
    def _sink(self, batch: list) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch)

    def _broken(self, error: BaseException) -> None:
        if self.on_broken is not None:
            self._loop.call_soon_threadsafe(self.on_broken, error)

    # ---- back on the event loop ---------------------------------------------------------------------------
    def _deliver(self, batch: list) -> None:
        woken = {}
        for handle, item in batch:
            if item.__class__ is Update or handle.accepted.done():
                handle.pending.append(item)
                woken[id(handle)] = handle
            elif isinstance(item, tuple):  # ("accepted", num_prompt_tokens)
                handle.num_prompt_tokens = item[1]
                handle.accepted.set_result(True)
            else:  # refused: the prompt (ValueError) or a broken engine
                handle.accepted.set_exception(item)
        for handle in woken.values():
            if handle.waiter is not None and not handle.waiter.done():
                handle.waiter.set_result(None)
