"""The library entry point: `LLM(model).generate(prompts, SamplingParams(...))`, chat, streaming and logits.

An `LLM` may be shared by any number of threads: every call hands its requests to the LLM's engine thread
(xserv/engine/engine_thread.py), which batches them with everyone else's, and waits for its own results. An
exception in a caller (KeyboardInterrupt included) aborts that caller's requests only. `close()` (or leaving a
`with LLM(...)` block, or dropping the last reference) gives the device memory back."""
from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import deque
from typing import Iterator

import numpy as np

from .engine.config import EngineConfig
from .engine.engine_thread import EngineThread, Submission, Update
from .engine.llm_engine import LLMEngine, RequestOutput, choice_params
from .engine_builder import EngineBuilder


class LLMClosed(RuntimeError):
    """The LLM was closed: its weights and KV cache are gone."""


_open_on_cuda = 0  # LLMs on the GPU not yet closed; when the last one goes, cached device memory goes back too
_open_lock = threading.Lock()


class _DeviceState:
    """Everything an LLM holds on the device (model, KV cache, graphs, workspaces: all reachable from the engine)
    and its engine thread. The LLM's finalizer holds this object, never the LLM, and clears it once."""

    def __init__(self, model, engine: LLMEngine, thread: EngineThread, device: str):
        self.model, self.engine, self.thread, self.device = model, engine, thread, device
        self.group = None  # tensor parallelism: rank 0's TPGroup (the worker processes of ranks 1..tp-1)
        self.closed = False


def _release(state: _DeviceState) -> None:
    """Close an LLM: stop its engine thread (aborting its requests), destroy its CUDA graphs, drop every reference
    to its device buffers, and when it was the last open GPU LLM, return the allocator's cached blocks to the
    driver. Runs once, from close() or from the garbage collector (weakref.finalize)."""
    global _open_on_cuda
    if state.closed:
        return
    state.closed = True
    stopped = _stop_and_drop(state)
    if state.device != "cuda":
        return
    with _open_lock:
        _open_on_cuda -= 1
        last = _open_on_cuda == 0
    if last and stopped:
        _give_back_cached_memory()


def _stop_and_drop(state: _DeviceState) -> bool:
    """Stop the engine thread (its last act closes the engine), or close the engine here when the thread never
    ran, and drop the state's references. A function of its own so that no local of the caller still holds the
    engine when the cached memory is given back. True when the thread has ended."""
    thread, engine = state.thread, state.engine  # thread None: LLM() failed before it made one
    stopped = thread.stop(timeout=60) if thread is not None else True
    if (thread is None or thread._thread is None) and engine is not None:
        _close_engine(engine, state.device)
    if state.group is not None:  # after the engine: its graphs are gone on rank 0; the workers close theirs
        state.group.close()
    state.model = state.engine = state.thread = state.group = None
    if thread is not None:
        thread.engine = None
    return stopped


def _give_back_cached_memory() -> None:
    """The last GPU LLM has gone: its buffers are back in the allocator's cache; return them to the driver, with
    the process-wide workspaces that its graphs may have used."""
    import gc

    from .ops._launch import release_pooled_buffers
    from .runtime import release_cached_memory

    gc.collect()  # anything of the engine's kept alive by a reference cycle
    release_pooled_buffers()
    release_cached_memory()


def _close_engine(engine: LLMEngine, device: str) -> None:
    if device == "cuda":
        from .runtime import get_device

        get_device().bind_to_thread()  # the thread that closes may not be the one that made the LLM
    engine.close()


def _wake(batch) -> None:
    """The engine thread's sink for library callers: file each item under its request and wake its thread."""
    for request, item in batch:
        with request.ready:
            request.items.append(item)
            request.ready.notify()


class _Request:
    """One request (one prompt, its n choices) as the thread that made it waits for it."""
    __slots__ = ("items", "ready", "num_choices", "outputs", "num_prompt_tokens")
    sink = staticmethod(_wake)

    def __init__(self, num_choices: int):
        self.items: deque = deque()
        self.ready = threading.Condition(threading.Lock())
        self.num_choices = num_choices
        self.outputs: list = [None] * num_choices  # each choice's RequestOutput once it has finished
        self.num_prompt_tokens = 0

    @property
    def done(self) -> bool:
        return all(o is not None for o in self.outputs)

    def take(self) -> list:
        """Wait for the next items (a short timed wait in a loop: Ctrl-C reaches a waiting main thread at once)."""
        with self.ready:
            while not self.items:
                self.ready.wait(0.5)
            items = list(self.items)
            self.items.clear()
        updates = []
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):  # ("accepted", number of prompt tokens)
                self.num_prompt_tokens = item[1]
                continue
            if item.finish_reason is not None:
                self.outputs[item.index] = item.output
            updates.append(item)
        return updates


class LLM:
    """A model (Qwen3, Qwen3-MoE, the Qwen3.5 hybrids or Llama 3: xserv.models.registry) ready to generate.

    model: a local Hugging Face folder or a hub id. device: "cuda", "cpu", or None (cuda when a GPU exists).
    max_model_len: the longest sequence (prompt + output); default the model's max_position_embeddings, capped by
    the KV cache. tensor_parallel_size: shard the model over this many GPUs (worker processes for ranks 1..tp-1,
    started here; xserv/parallel/group.py); `close()` stops them. kv_cache_tokens: the KV pool size in tokens;
    default from free device memory (gpu_memory_fraction of it) on CUDA, about 1 GiB on CPU. seed: the seed that
    unseeded requests derive theirs from (default None: each unseeded request gets a fresh seed from the OS).

    Safe to share between threads (see the module doc). `close()` or `with LLM(...) as llm:` frees its device
    memory; so does dropping it.
    """

    def __init__(self, model: str, device: str | None = None, config: EngineConfig | None = None, *,
                 progress: bool = True, **overrides):
        global _open_on_cuda
        unknown = set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise TypeError(f"LLM() got unknown engine option(s) {sorted(unknown)}")
        builder = EngineBuilder(model, device, (config or EngineConfig()).replace(**overrides))
        self.engine_config, self.folder, self.device = builder.engine_config, builder.folder, builder.device
        self.config, self.tokenizer = builder.config, builder.tokenizer
        builder.compile_kernels(progress=progress)
        with _open_lock:  # counted from here: a failure below releases what was made (see _release)
            if self.device == "cuda":
                _open_on_cuda += 1
        state = _DeviceState(None, None, None, self.device)
        self._finalizer = weakref.finalize(self, _release, state)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway; no engine thread to stop
        self._state = state
        try:
            builder.load(state, progress=progress)
        except BaseException:
            self._finalizer()
            raise
        self.timings, self.kernel_compile_s = builder.timings, builder.kernel_compile_s
        thread_setup = None
        if self.device == "cuda":
            from .runtime import get_device

            thread_setup = get_device().bind_to_thread
        state.thread = EngineThread(state.engine, thread_setup=thread_setup,
                                    on_exit=lambda engine: _close_engine(engine, state.device))
        self.max_model_len = state.engine.max_model_len

    # ---- life cycle ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Abort whatever runs, free the weights, KV cache, CUDA graphs and workspaces; when this was the last open
        LLM on the GPU, the allocator's cached blocks go back to the driver too. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self) -> _DeviceState:
        state = self._state
        if state.closed:
            raise LLMClosed("this LLM has been closed (close() or a `with` block's end): make a new LLM(...)")
        return state

    def _caller(self) -> _DeviceState:
        """The state, for a call that waits on the engine thread: never from that thread itself (an on_step
        callback), which would wait for itself forever."""
        state = self._live()
        if state.thread.on_engine_thread:
            raise RuntimeError("an LLM call from inside an on_step callback (the engine thread) would wait for "
                               "itself: call it from another thread")
        return state

    @property
    def model(self):
        return self._live().model

    @property
    def engine(self) -> LLMEngine:
        """The engine itself: not thread-safe; only for single-threaded tools (benchmarks) while no call runs."""
        return self._live().engine

    @property
    def engine_thread(self) -> EngineThread:
        """The thread that steps the engine for every caller (the HTTP server submits through it too)."""
        return self._live().thread

    @property
    def runner(self):
        return self.engine.runner

    @property
    def kv_cache(self):
        return self.engine.kv_cache

    # ---- prompts ------------------------------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt)), prompt
        ids = [int(t) for t in prompt]
        return ids, None

    def _normalize_prompts(self, prompts) -> list:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    @staticmethod
    def _params_list(params, n: int) -> list:
        from .sampling import SamplingParams

        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, (list, tuple)):
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling params for {n} prompts")
            return list(params)
        return [params] * n

    def _submit(self, requests: list[tuple[list[int], object, str | None]], *, stream: bool,
                on_step=None) -> list[_Request]:
        """Hand prompts to the engine thread, all in one command (they join the same step); one _Request each."""
        state = self._caller()
        engine = state.engine
        for ids, _, _ in requests:
            engine.check_prompt(ids)  # reads only fixed sizes: safe beside the engine thread
        handles, submissions = [], []
        for ids, params, text in requests:
            choices = choice_params(params)
            handle = _Request(len(choices))
            handles.append(handle)
            submissions.append(Submission(handle, ids, choices, text, every_step=stream, on_step=on_step))
        state.thread.submit(*submissions)
        return handles

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompts, params=None, on_step=None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. One output per prompt, in order
        (params.n > 1: n outputs per prompt, one after the other). `on_step(results)` runs on the engine thread
        after every step with this call's [(sequence, new text)] (progress bars, benchmarks): keep it short; an
        exception in it ends this call's requests and is raised here."""
        prompts = self._normalize_prompts(prompts)
        encoded = [self._encode(p) for p in prompts]
        params_list = self._params_list(params, len(prompts))
        handles = self._submit([(ids, p, text) for (ids, text), p in zip(encoded, params_list)], stream=False,
                               on_step=on_step)
        try:
            for handle in handles:
                while not handle.done:
                    handle.take()
        except BaseException:
            self._abort(handles)
            raise
        return [out for handle in handles for out in handle.outputs]

    def _abort(self, handles) -> None:
        thread = self._state.thread
        if thread is not None:
            for handle in handles:
                if not handle.done:
                    thread.abort(handle)

    def chat_prompt(self, messages, enable_thinking: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking)

    def chat(self, messages, params=None, enable_thinking: bool = True,
             thinking_token_budget: int | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations. With
        thinking on, a `structured` constraint applies to the answer after the `<think>` block, and
        thinking_token_budget N ends that block after at most N tokens (the model then answers); 0 is thinking off."""
        from .structured import thinking_budget

        budget = thinking_budget(thinking_token_budget)
        enable_thinking = enable_thinking and budget != 0
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
        prompts = [self.chat_prompt(c, enable_thinking) for c in conversations]
        params_list = self._params_list(params, len(prompts))
        if enable_thinking and "<think>" in (self.tokenizer.chat_template or ""):
            params_list = [self._answer_after_reasoning(p, prompt, budget) for p, prompt in zip(params_list, prompts)]
        return self.generate(prompts, params_list)

    def _answer_after_reasoning(self, params, prompt: str, budget: int | None = None):
        if params.structured is None and budget is None:
            return params
        from .structured import after_reasoning

        return dataclasses.replace(params, structured=after_reasoning(params.structured, prompt, self.tokenizer,
                                                                      budget))

    def stream(self, prompt, params=None) -> "TextStream":
        """Text deltas as tokens come (never past a stop string). Closing the iterator early (or an exception in
        the loop that reads it) ends the request."""
        ids, text = self._encode(prompt)
        params = self._params_list(params, 1)[0]
        if params.n != 1:
            raise ValueError(f"stream() takes n=1 (got n={params.n}); use generate() for several samples")
        return TextStream(self, self._submit([(ids, params, text)], stream=True)[0])

    def logits(self, token_ids) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the next-token logits at every position."""
        ids = list(token_ids)
        return self._caller().thread.call(lambda engine: engine.logits(ids)).result()


class TextStream:
    """One request's text deltas, as the engine thread produces them. `close()` (or an exception while reading,
    or dropping the iterator) aborts the request. `num_tokens`: output tokens so far; `output`: the
    RequestOutput once the request has ended (None before)."""

    def __init__(self, llm: LLM, request: _Request):
        self._thread = llm._state.thread
        self._request = request
        self._pending: deque = deque()
        self.num_tokens = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            while not self._pending:
                if self._request.done:
                    raise StopIteration
                for update in self._request.take():
                    self.num_tokens = update.num_tokens
                    if update.text:
                        self._pending.append(update.text)
        except StopIteration:
            raise
        except BaseException:
            self._abort(wait=False)  # not waiting: a second Ctrl-C must not land in a wait here
            raise
        return self._pending.popleft()

    @property
    def output(self) -> RequestOutput | None:
        return self._request.outputs[0]

    def close(self) -> None:
        """Abort the request (if still running) and wait until the engine has let go of it (one step at most)."""
        self._abort(wait=True)

    def _abort(self, wait: bool) -> None:
        thread, request = self._thread, self._request
        if request.done or thread is None:
            return
        thread.abort(request)
        if wait and thread.running and not thread.on_engine_thread:
            while not request.done:
                request.take()

    def __del__(self):
        try:
            self._abort(wait=False)
        except Exception:
            pass
