"""A request as the engine tracks it (`Sequence`), what the user gets back (`RequestOutput`), and the stop-string
matcher that decides how much streamed text is safe to show."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[dict] | None = None  # per output token: {"token_id", "logprob", "top": [(id, logprob), ...]}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopStringMatcher:
    """Accumulates detokenized text, finds stop strings, and says how much text is safe to emit: text that could
    still turn into the start of a stop string is held back until the next tokens decide."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        if not self.stops:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _safe_end(self) -> int:
        if self.stopped or not self.stops:
            return len(self.text)
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return len(self.text) - hold

    def take(self, final: bool = False) -> str:
        """The text not yet emitted that is safe to emit (all of it when `final`)."""
        end = len(self.text) if final else self._safe_end()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


class Sequence:
    """One request: its tokens (prompt then output), where its KV lives (block table), and how far it got.

    num_computed: tokens whose K/V are in the cache or being written by the step in flight. num_cached_tokens:
    prompt tokens the prefix cache supplied at (last) admission. The detokenizer runs only for sequences that
    stream or have stop strings; the others decode their text once, when they finish."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params, *, seed: int, stop_ids: frozenset[int],
                 prompt: str | None = None, detokenizer=None, constraint=None):
        self.seq_id = seq_id
        self.prompt = prompt
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.seed = seed
        self.stop_ids = stop_ids
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(list(params.stop)) if detokenizer is not None else None
        self.status = WAITING
        self.num_computed = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_keys: list[int] = []  # prefix-cache keys of the full blocks registered so far
        self.slot = -1  # the sampler's per-sequence state row (penalties), -1 when none
        self.packed_params = None  # the sampler's packed form of `params`, made at the first sampling
        self.constraint = constraint  # structured output's matcher (xserv/structured.py), advanced when booked
        self.finish_reason: str | None = None
        self.final_text: str | None = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # text deltas for a caller that steps the engine itself and sets a deque here (the tests' EngineStream,
        # tests/engine_driver.py); the engine thread behind LLM and the server takes deltas from step()'s results
        self.stream_buffer: deque[str] | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED

    @property
    def text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        return self.matcher.text if self.matcher is not None else ""

    def output(self) -> RequestOutput:
        return RequestOutput(self.seq_id, self.prompt, self.token_ids[:self.num_prompt_tokens], self.text,
                             self.output_ids, self.finish_reason, self.num_cached_tokens,
                             None if self.logprobs is None else list(self.logprobs))
