"""One request in flight (RequestRun: the AsyncEngine's updates -> per-choice state, usage and the metrics) and the
server-sent-events framing of a streamed response."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..sampling import SamplingParams
from .async_engine import EngineBroken, EngineStopped, Update
from .context import ServerContext
from .protocol import error_body


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    has_logprobs: bool = False
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_s: float | None = None


class RequestRun:
    """One request in flight: feeds the AsyncEngine's updates into per-choice state and the metrics."""

    def __init__(self, ctx: ServerContext, prompt_ids: list[int], params: list[SamplingParams],
                 prompt_text: str | None, start: float):
        self.ctx = ctx
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompt_text = prompt_text
        self.start = start
        self.choices = [ChoiceState() for _ in params]
        self.num_cached_tokens = 0
        self.reported: set[int] = set()  # choices whose end went into the metrics

    async def updates(self) -> AsyncIterator[list[Update]]:
        unfinished = "abort"  # how choices that end early count: the client went away (or "error" below)
        self.ctx.num_requests += 1
        try:
            async for batch in self.ctx.engine.generate(self.prompt_ids, self.params, self.prompt_text):
                now = time.perf_counter() - self.start
                for u in batch:
                    self._apply(u, now)
                yield batch
        except (EngineBroken, EngineStopped):
            unfinished = "error"
            raise
        finally:
            self.ctx.num_requests -= 1
            now = time.perf_counter() - self.start
            for i in range(len(self.choices)):
                if i not in self.reported:
                    self._report(i, unfinished, now)

    def _apply(self, u: Update, now: float) -> None:
        c = self.choices[u.index]
        if u.num_tokens and c.first_token_s is None:
            c.first_token_s = now
            if all(x.first_token_s is None or x is c for x in self.choices):
                self.ctx.metrics.ttft.observe(now)
        c.text.append(u.text)
        c.num_tokens = u.num_tokens
        if u.logprobs is not None:
            c.has_logprobs = True
            c.logprobs.extend(u.logprobs)
        if u.finish_reason is not None:
            c.finish_reason = u.finish_reason
            self.num_cached_tokens = max(self.num_cached_tokens, u.num_cached_tokens)
            self._report(u.index, u.finish_reason, now)

    def _report(self, index: int, reason: str, now: float) -> None:
        self.reported.add(index)
        c = self.choices[index]
        self.ctx.metrics.finished(reason, len(self.prompt_ids) if index == 0 else 0, c.num_tokens, c.first_token_s,
                                  now)

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


def _dumps(payload) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else _dumps(payload)}\n\n".encode()


def _error_event(e: BaseException) -> bytes:
    return sse(error_body(503, str(e), None, "engine_failed" if isinstance(e, EngineBroken) else "shutting_down"))
