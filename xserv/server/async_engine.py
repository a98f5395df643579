"""The one interface between the HTTP server and the engine.

`LLMEngine` is not thread-safe, so exactly one thread (the engine thread started here) calls its methods. The
asyncio side talks to that thread through a command queue (add / abort / abort all / stop) and gets back, once
per engine step, a batch of `Update`s that the event loop files under each request (waking its reader). While
any request is unfinished the thread steps the engine back to back: every concurrent request shares each forward
(continuous batching) and no HTTP handler ever waits on a step.

An exception from `engine.step()` (a CUDA error, say) marks the engine broken: every in-flight request gets an
`EngineBroken` error instead of its next update, new requests are refused, and `on_broken` is called so that the
server can report 503 and exit non-zero.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable


class EngineBroken(RuntimeError):
    """The engine failed (its step raised); it serves nothing more."""


class EngineStopped(RuntimeError):
    """The engine thread has stopped (the server is shutting down)."""


@dataclass(slots=True)
class Update:
    """New output of one choice (one sequence) of a request since its previous update."""
    index: int  # the choice (0..n-1)
    text: str  # new text; never contains or splits a stop string or a multi-byte character
    num_tokens: int  # output tokens of this choice so far
    logprobs: list[dict] | None = None  # entries for the new tokens, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the choice is done
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the finishing update)


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
                          last.num_cached_tokens))
    return out


class RequestHandle:
    """One request (n choices) as the event loop sees it. Updates land in `pending` (a plain list: the engine
    hands over one batch per step, and the consumer takes everything at once) and `waiter` wakes the consumer."""

    def __init__(self, num_choices: int):
        self.num_choices = num_choices
        self.pending: list = []  # Update | BaseException, not yet taken by generate()
        self.waiter: asyncio.Future | None = None
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.num_prompt_tokens = 0
        self.num_unfinished = num_choices


class _Tracked:
    """Engine-thread bookkeeping of one sequence."""
    __slots__ = ("handle", "index", "logprobs_sent")

    def __init__(self, handle: RequestHandle, index: int):
        self.handle = handle
        self.index = index
        self.logprobs_sent = 0


class AsyncEngine:
    """Runs `engine` (an LLMEngine) on its own thread and serves it to coroutines.

    `generate()` is the whole per-request API: it yields `Update`s and aborts the request if the caller stops
    early (a client disconnect cancels the coroutine). `stats()` is the engine's latest `stats()` snapshot.
    """

    def __init__(self, engine, *, on_broken: Callable[[BaseException], None] | None = None,
                 thread_setup: Callable[[], None] | None = None):
        self.engine = engine
        self.on_broken = on_broken
        self.thread_setup = thread_setup  # run first on the engine thread (CUDA: make the context current there)
        self.error: BaseException | None = None
        self.num_in_flight = 0  # sequences submitted and not finished (event-loop side count)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = dict(engine.stats())
        self._idle = asyncio.Event()

    # ---- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the updates."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="xserv-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs, free its blocks and end the engine thread."""
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stats(self) -> dict:
        return self._stats

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False when the timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None))

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
        handle = RequestHandle(len(params_per_choice))
        self._enter(handle.num_choices)
        self._commands.put(("add", (handle, prompt_ids, params_per_choice, prompt_text)))
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
                self._commands.put(("abort", handle))

    def _enter(self, n: int) -> None:
        self.num_in_flight += n
        self._idle.clear()

    def _leave(self, n: int) -> None:
        self.num_in_flight -= n
        if self.num_in_flight <= 0:
            self.num_in_flight = 0
            self._idle.set()

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        tracked: dict = {}  # Sequence -> _Tracked
        by_handle: dict = {}  # RequestHandle -> [Sequence]
        if self.thread_setup is not None:
            try:
                self.thread_setup()
            except BaseException as e:  # noqa: BLE001 - an engine that cannot run on this thread is broken
                self._fail(e, by_handle, [])
                return
        while True:
            outbox: list = []
            stop = self._apply_commands(tracked, by_handle, outbox, block=not engine.has_unfinished())
            if stop:
                self._abort_all(tracked, by_handle, outbox)
                self._publish(outbox)
                return
            if engine.has_unfinished():
                try:
                    results = engine.step()
                except BaseException as e:  # noqa: BLE001 - any failure ends the engine, see the module doc
                    self._fail(e, by_handle, outbox)
                    return
                for seq, delta in results:
                    self._update(seq, delta, tracked, by_handle, outbox)
            self._publish(outbox)

    def _apply_commands(self, tracked, by_handle, outbox, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); True when told to stop."""
        while True:
            try:
                command, arg = self._commands.get(block=block)
            except queue.Empty:
                return False
            block = False
            if command == "stop":
                return True
            if command == "add":
                self._add(*arg, tracked=tracked, by_handle=by_handle, outbox=outbox)
            elif command == "abort":
                for seq in by_handle.pop(arg, ()):
                    self.engine.abort(seq)
                    tracked.pop(seq, None)
            elif command == "abort_all":
                self._abort_all(tracked, by_handle, outbox)

    def _add(self, handle, prompt_ids, params_per_choice, prompt_text, *, tracked, by_handle, outbox) -> None:
        seqs = []
        try:
            for params in params_per_choice:
                seqs.append(self.engine.add_request(prompt_ids, params, prompt_text, stream=True))
        except Exception as e:  # noqa: BLE001 - ValueError for a bad prompt; anything else is reported the same way
            for seq in seqs:
                self.engine.abort(seq)
            outbox.append((handle, e))
            return
        by_handle[handle] = seqs
        for i, seq in enumerate(seqs):
            tracked[seq] = _Tracked(handle, i)
        outbox.append((handle, ("accepted", seqs[0].num_prompt_tokens)))

    def _update(self, seq, delta: str, tracked, by_handle, outbox) -> None:
        t = tracked.get(seq)
        if t is None:
            return  # aborted meanwhile
        finished = seq.is_finished
        if not delta and not finished:
            return  # the new text is held back (part of a character or a stop string): its logprobs go with the next
        logprobs = None
        if seq.params.logprobs is not None or finished:
            out = seq.output()
            if seq.params.logprobs is not None and out.logprobs is not None:
                logprobs = out.logprobs[t.logprobs_sent:]
                t.logprobs_sent = len(out.logprobs)
        update = Update(t.index, delta, seq.num_output_tokens, logprobs)
        if finished:
            update.finish_reason = seq.finish_reason or "stop"
            update.num_cached_tokens = out.num_cached_tokens
            del tracked[seq]
            seqs = by_handle.get(t.handle)
            if seqs is not None and all(s.is_finished for s in seqs):
                del by_handle[t.handle]
        outbox.append((t.handle, update))

    def _abort_all(self, tracked, by_handle, outbox) -> None:
        for seq, t in list(tracked.items()):
            self.engine.abort(seq)
            outbox.append((t.handle, Update(t.index, "", seq.num_output_tokens, None, "abort")))
        tracked.clear()
        by_handle.clear()

    def _fail(self, error: BaseException, by_handle, outbox) -> None:
        self.error = error
        broken = EngineBroken(f"the engine failed: {type(error).__name__}: {error}")
        for handle in by_handle:
            outbox.append((handle, broken))
        self._publish(outbox)
        # requests added after the failure (still in the queue) get the error too
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                self._loop.call_soon_threadsafe(self._deliver, [(arg[0], broken)], None)
        if self.on_broken is not None:
            self._loop.call_soon_threadsafe(self.on_broken, error)

    def _publish(self, outbox: list) -> None:
        stats = dict(self.engine.stats()) if self.error is None else None
        if outbox or stats != self._stats:
            self._loop.call_soon_threadsafe(self._deliver, outbox, stats)

    # ---- back on the event loop ---------------------------------------------------------------------------
    def _deliver(self, outbox: list, stats: dict | None) -> None:
        if stats is not None:
            self._stats = stats
        woken = {}
        for handle, item in outbox:
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

