"""An LLMEngine driven by hand, on the test's own thread: whole requests and streams for the tests of the engine
itself. A library user has xserv.LLM, whose engine thread steps the engine for every caller."""
from __future__ import annotations

from collections import deque


def generate(engine, prompts: list[list[int]], params_list, prompt_texts=None, on_step=None) -> list:
    """Run the requests to the end; one RequestOutput per sample (params.n of them per prompt, prompts in order).
    `on_step(results)` is called after every step."""
    texts = prompt_texts or [None] * len(prompts)
    seqs = []
    try:
        for ids, params, text in zip(prompts, params_list, texts):
            seqs += engine.add_samples(ids, params, text)
        while any(not s.is_finished for s in seqs):
            results = engine.step()
            if on_step is not None:
                on_step(results)
    finally:
        for s in seqs:
            engine.abort(s)
    return [s.output() for s in seqs]


def stream(engine, prompt_ids, params, prompt: str | None = None) -> "EngineStream":
    """One request's text deltas as they come; `.output` holds the request so far."""
    return EngineStream(engine, engine.add_request(prompt_ids, params, prompt, stream=True))


class EngineStream:
    """Text deltas of one request, stepping the engine on demand (every running request advances: with several
    streams on one engine, each delta lands in its own sequence's buffer). Closing it, or an exception inside the
    loop, aborts the request."""

    def __init__(self, engine, seq):
        self.engine = engine
        self.seq = seq
        seq.stream_buffer = self._pending = deque()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            while not self._pending:
                if self.seq.is_finished:
                    raise StopIteration
                self.engine.step()
        except BaseException:
            self.close()
            raise
        return self._pending.popleft()

    def close(self) -> None:
        self.engine.abort(self.seq)

    @property
    def output(self):
        return self.seq.output()

    @property
    def num_tokens(self) -> int:
        return self.seq.num_output_tokens
