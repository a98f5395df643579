"""The engine thread: the one thread that calls an `LLMEngine`'s methods.

`LLMEngine` is not thread-safe, and a step cut short (a KeyboardInterrupt landing inside it) would leave every
running request's state half-booked. So one thread per engine, started here, owns it: callers on any other thread
(the library's `LLM` from any number of threads, the HTTP server's event loop) talk to it through a command queue
(add / abort / abort all / call / stop) and get back what their requests produced. While any request is unfinished
the thread steps the engine back to back: requests from every caller share each forward (continuous batching).
Signals are delivered to the main thread only, never to this one: an interrupted caller aborts its own requests
through the queue and the others go on untouched.

A caller submits a request with a *handle*: any object with a `sink` attribute, a callable that takes a list of
(handle, item) pairs. Once per step the thread calls each sink that has news with its batch (on this thread: a sink
only hands the batch over, to an event loop or a waiting thread). An item is one of
- ("accepted", number of prompt tokens): the request is queued (the first item of every accepted request);
- an `Update`: new output of one choice;
- an exception: the request was refused (a ValueError for a bad prompt) or the engine failed (`EngineBroken`).

An exception from `engine.step()` (a CUDA error, say) marks the engine broken: every in-flight request gets an
`EngineBroken` error instead of its next update, later requests are refused with it, and `on_broken` is called.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable


class EngineBroken(RuntimeError):
    """The engine failed (its step raised); it serves nothing more."""


class EngineStopped(RuntimeError):
    """The engine thread has stopped (its LLM was closed, or the server is shutting down)."""


@dataclass(slots=True)
class Update:
    """New output of one choice (one sequence) of a request since its previous update."""
    index: int  # the choice (0..n-1)
    text: str  # new text; never contains or splits a stop string or a multi-byte character
    num_tokens: int  # output tokens of this choice so far
    logprobs: list[dict] | None = None  # entries for the new tokens, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the choice is done
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the finishing update)
    output: object = None  # the choice's whole RequestOutput, on the finishing update


@dataclass(slots=True)
class Submission:
    """One request as the engine thread receives it: one SamplingParams per choice (each choice its own sequence)."""
    handle: object
    prompt_ids: list[int]
    params_per_choice: list
    prompt_text: str | None = None
    every_step: bool = True  # an update after every step; False: only when a choice finishes (no text deltas)
    on_step: Callable | None = None  # called on the engine thread once per step with the [(sequence, delta)] of
    # every request that shares it (the requests of one generate() call)


class _Tracked:
    """Engine-thread bookkeeping of one sequence."""
    __slots__ = ("submission", "index", "logprobs_sent")

    def __init__(self, submission: Submission, index: int):
        self.submission = submission
        self.index = index
        self.logprobs_sent = 0


class EngineThread:
    """Runs `engine` (an LLMEngine) on a thread of its own, started on first use (or by `start()`).

    thread_setup: run first on the new thread (CUDA: make the device's context current there). on_broken: called on
    the engine thread with the exception when a step fails. on_exit: called with the engine as the thread's last
    act (after a stop or a failure). on_stats: called on the engine thread with a snapshot
    of the engine's stats whenever they change (the server's /metrics)."""

    def __init__(self, engine, *, thread_setup: Callable[[], None] | None = None,
                 on_broken: Callable[[BaseException], None] | None = None,
                 on_stats: Callable[[dict], None] | None = None, on_exit: Callable | None = None,
                 name: str = "xserv-engine"):
        self.engine = engine
        self.thread_setup = thread_setup
        self.on_broken = on_broken
        self.on_stats = on_stats
        self.on_exit = on_exit
        self.name = name
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = False
        self._stats: dict = dict(engine.stats()) if engine is not None else {}  # None: never started

    # ---- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._stopped:
                raise EngineStopped("the engine has been stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float | None = None) -> bool:
        """Abort every request (their callers get a finishing "abort" update), end the thread, wait for it (unless
        called on the engine thread itself). True when the thread has ended (or never started)."""
        with self._start_lock:
            self._stopped = True
            thread = self._thread
        if thread is None:
            return True
        self._commands.put(("stop", None))
        if threading.current_thread() is thread:
            return False
        thread.join(timeout)
        return not thread.is_alive()

    # ---- requests (any thread) ----------------------------------------------------------------------------
    def submit(self, *submissions: Submission) -> None:
        """Queue requests, all added before the next step; each handle's sink hears "accepted" (or the refusal)."""
        if self.error is not None:
            raise EngineBroken(f"the engine failed: {type(self.error).__name__}: {self.error}")
        self.start()
        self._commands.put(("add", submissions))

    def abort(self, handle) -> None:
        """End a handle's unfinished choices: each gets a last update with finish_reason "abort"."""
        self._commands.put(("abort", handle))

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None))

    def call(self, fn: Callable) -> Future:
        """Run fn(engine) on the engine thread between two steps, with no step in flight; its result (or
        exception) in the returned Future."""
        future: Future = Future()
        if self.error is not None:
            future.set_exception(EngineBroken(f"the engine failed: {type(self.error).__name__}: {self.error}"))
            return future
        self.start()
        self._commands.put(("call", (fn, future)))
        return future

    def stats(self) -> dict:
        """The engine's stats as of the last step (requests running and waiting, KV blocks, ...)."""
        return self._stats

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        tracked: dict = {}  # Sequence -> _Tracked
        by_handle: dict = {}  # handle -> [Sequence]
        try:
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
                    self._file(results, tracked, by_handle, outbox)
                self._publish(outbox)
        finally:
            self._refuse_queued()
            self._exit()

    def _exit(self) -> None:
        engine, self.engine = self.engine, None
        if self.on_exit is not None and engine is not None:
            try:
                self.on_exit(engine)
            except Exception:  # noqa: BLE001 - a failed engine may fail to close too; its memory goes with it
                pass

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
                for submission in arg:
                    self._add(submission, tracked, by_handle, outbox)
            elif command == "abort":
                for seq in by_handle.pop(arg, ()):
                    t = tracked.pop(seq, None)
                    if t is not None:
                        self.engine.abort(seq)
                        outbox.append((arg, Update(t.index, "", seq.num_output_tokens, None, "abort",
                                                   output=seq.output())))
            elif command == "abort_all":
                self._abort_all(tracked, by_handle, outbox)
            elif command == "call":
                fn, future = arg
                if future.set_running_or_notify_cancel():
                    try:
                        self._file(self.engine.drain(), tracked, by_handle, outbox)
                        future.set_result(fn(self.engine))
                    except BaseException as e:  # noqa: BLE001 - the caller gets it
                        future.set_exception(e)

    def _add(self, sub: Submission, tracked, by_handle, outbox) -> None:
        seqs = []
        try:
            for params in sub.params_per_choice:
                seqs.append(self.engine.add_request(sub.prompt_ids, params, sub.prompt_text, stream=sub.every_step))
        except Exception as e:  # noqa: BLE001 - ValueError for a bad prompt; anything else is reported the same way
            for seq in seqs:
                self.engine.abort(seq)
            outbox.append((sub.handle, e))
            return
        by_handle[sub.handle] = seqs
        for i, seq in enumerate(seqs):
            tracked[seq] = _Tracked(sub, i)
        outbox.append((sub.handle, ("accepted", seqs[0].num_prompt_tokens)))

    def _file(self, results, tracked, by_handle, outbox) -> None:
        """Turn a step's [(sequence, delta)] into updates for the sequences' handles."""
        per_call: dict = {}  # id(on_step) -> (on_step, [(sequence, delta)])
        for seq, delta in results:
            t = tracked.get(seq)
            if t is None:
                continue  # aborted meanwhile
            sub = t.submission
            if sub.on_step is not None:
                per_call.setdefault(id(sub.on_step), (sub.on_step, []))[1].append((seq, delta))
            finished = seq.is_finished
            if not (finished or (sub.every_step and delta)):
                continue  # no new text (or none wanted before the end): its logprobs go out with the next text
            logprobs = out = None
            if finished or seq.params.logprobs is not None:
                out = seq.output()
                if seq.params.logprobs is not None and out.logprobs is not None:
                    logprobs = out.logprobs[t.logprobs_sent:]
                    t.logprobs_sent = len(out.logprobs)
            update = Update(t.index, delta, seq.num_output_tokens, logprobs)
            if finished:
                update.finish_reason = seq.finish_reason or "stop"
                update.num_cached_tokens = out.num_cached_tokens
                update.output = out
                del tracked[seq]
                seqs = by_handle.get(sub.handle)
                if seqs is not None and all(s.is_finished for s in seqs):
                    del by_handle[sub.handle]
            outbox.append((sub.handle, update))
        for on_step, pairs in per_call.values():
            try:
                on_step(pairs)
            except BaseException as e:  # noqa: BLE001 - the call's caller gets it; all its requests end
                handles = {t.submission.handle for t in tracked.values() if t.submission.on_step is on_step}
                for handle in handles:
                    for seq in by_handle.pop(handle, ()):
                        self.engine.abort(seq)
                        tracked.pop(seq, None)
                    outbox.append((handle, e))

    def _abort_all(self, tracked, by_handle, outbox) -> None:
        for seq, t in list(tracked.items()):
            self.engine.abort(seq)
            outbox.append((t.submission.handle, Update(t.index, "", seq.num_output_tokens, None, "abort",
                                                       output=seq.output())))
        tracked.clear()
        by_handle.clear()

    def _fail(self, error: BaseException, by_handle, outbox) -> None:
        self.error = error
        broken = EngineBroken(f"the engine failed: {type(error).__name__}: {error}")
        broken.__cause__ = error
        for handle in by_handle:
            outbox.append((handle, broken))
        self._publish(outbox)
        if self.on_broken is not None:
            self.on_broken(error)

    def _refuse_queued(self) -> None:
        """Requests and calls still queued when the thread ends get EngineStopped (or the engine's failure)."""
        with self._start_lock:
            self._stopped = True
        error = (EngineBroken(f"the engine failed: {type(self.error).__name__}: {self.error}")
                 if self.error is not None else EngineStopped("the engine has been stopped"))
        outbox = []
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                outbox.extend((sub.handle, error) for sub in arg)
            elif command == "call" and arg[1].set_running_or_notify_cancel():
                arg[1].set_exception(error)
        self._publish(outbox, stats=False)

    def _publish(self, outbox: list, stats: bool = True) -> None:
        if stats and self.error is None:
            snapshot = self.engine.stats()
            if snapshot != self._stats:
                self._stats = snapshot
                if self.on_stats is not None:
                    self.on_stats(snapshot)
        if not outbox:
            return
        by_sink: dict = {}
        for handle, item in outbox:
            by_sink.setdefault(handle.sink, []).append((handle, item))
        for sink, batch in by_sink.items():
            sink(batch)
