"""/v1/chat/completions and /v1/completions: a validated request -> prompt token ids and SamplingParams
(chat_request.py) -> the AsyncEngine (responses.py: RequestRun) -> an OpenAI response body or an SSE stream of
chunks. Here: what the two endpoints share (Endpoint) and /v1/completions; the chat endpoint is chat_endpoint.py."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from ..structured import StructuredOutput
from .async_engine import EngineBroken, EngineStopped, Update
from .chat_request import prompt_ids_of, sampling_params
from .constraints import logit_bias_of, request_constraint
from .context import ServerContext
# tests reach the logprob formats, sampling_params and ServerContext through this module
from .logprobs import chat_logprobs, completion_logprobs  # noqa: F401
from .protocol import UNSUPPORTED_COMPLETION, APIError, error_body, unsupported_field
from .responses import ChoiceState, RequestRun, _dumps, _error_event, sse


# ---- what both endpoints share, and /v1/completions -------------------------------------------------------------
class Endpoint:
    """What differs between chat and completions: the prompt, the logprob format and the choice shape."""
    object_name: str
    chunk_object: str
    id_prefix: str
    prompt_param: str

    def __init__(self, ctx: ServerContext, req):
        self.ctx = ctx
        self.req = req
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    unsupported: dict = {}
    structured: StructuredOutput | None = None  # the answer's constraint (set by check_request)
    structured_param: str | None = None  # the request field it came from

    async def prepare(self, start: float) -> RequestRun:
        ctx, req = self.ctx, self.req
        ctx.check_model(req.model)
        error = unsupported_field(req, self.unsupported)
        if error is not None:
            raise error
        self.check_request()
        logit_bias = logit_bias_of(req.logit_bias, ctx.vocab_size)
        ctx.check_serving(req.n)
        prompt_ids, prompt_text = await self.prompt()
        params = sampling_params(ctx, req, len(prompt_ids), max_tokens=self.max_tokens(),
                                 max_tokens_param=self.max_tokens_param(), logprobs=self.engine_logprobs(),
                                 structured=self.final_constraint(), logit_bias=logit_bias)
        return RequestRun(ctx, prompt_ids, params, prompt_text, start)

    def final_constraint(self) -> StructuredOutput | None:
        """The constraint the engine gets (after the prompt is rendered)."""
        return self.structured

    def envelope(self, choices: list, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.ctx.model_name,
                "choices": choices}

    async def respond(self, run: RequestRun) -> dict:
        try:
            async for _ in run.updates():
                pass
        except ValueError as e:  # the engine refused the prompt
            raise APIError(400, str(e), self.prompt_param) from None
        except (EngineBroken, EngineStopped) as e:
            raise APIError(503, str(e), code="engine_failed" if isinstance(e, EngineBroken) else "shutting_down")
        body = self.envelope([self.final_choice(i, c) for i, c in enumerate(run.choices)], self.object_name)
        body["usage"] = run.usage()
        return body

    async def stream(self, run: RequestRun) -> AsyncIterator[bytes]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        sent_text = [0] * len(run.choices)

        # the envelope is the same in every chunk: encode it once
        head = _dumps(self.envelope([], self.chunk_object))[:-len(',"choices":[]}')]
        tail = ',"usage":null}\n\n' if include_usage else "}\n\n"

        def chunk(choices):
            return f'data: {head},"choices":{_dumps(choices)}{tail}'.encode()

        try:
            for first in self.opening_chunks(len(run.choices)):
                yield chunk([first])
            async for batch in run.updates():
                # a choice may have several deltas for one update (a tool call's name, then its arguments): the
                # i-th chunk of the batch carries each choice's i-th delta, so no chunk names a choice twice
                rows = []
                for u in batch:
                    rows.append(self.delta_choices(u, run.choices[u.index], sent_text[u.index]))
                    sent_text[u.index] += len(u.text)
                for i in range(max(map(len, rows), default=0)):
                    yield chunk([r[i] for r in rows if i < len(r)])
        except (EngineBroken, EngineStopped) as e:
            yield _error_event(e)
            yield sse("[DONE]")
            return
        except ValueError as e:  # the engine refused the prompt
            yield sse(error_body(400, str(e), self.prompt_param))
            yield sse("[DONE]")
            return
        if include_usage:
            body = self.envelope([], self.chunk_object)
            body["usage"] = run.usage()
            yield sse(body)
        yield sse("[DONE]")

    # hooks
    def check_request(self) -> None:
        given = request_constraint(self.req)
        if given is not None:
            self.structured_param, self.structured = given

    async def prompt(self) -> tuple[list[int], str | None]:
        raise NotImplementedError

    def max_tokens(self) -> int | None:
        return self.req.max_tokens

    def max_tokens_param(self) -> str:
        return "max_tokens"

    def engine_logprobs(self) -> int | None:
        raise NotImplementedError

    def opening_chunks(self, n: int) -> list[dict]:
        return []

    def final_choice(self, index: int, c: ChoiceState) -> dict:
        raise NotImplementedError

    def delta_choices(self, u: Update, c: ChoiceState, text_offset: int) -> list[dict]:
        raise NotImplementedError


class CompletionEndpoint(Endpoint):
    object_name, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"
    prompt_param = "prompt"
    unsupported = UNSUPPORTED_COMPLETION

    async def prompt(self):
        prompt = self.req.prompt
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self.ctx.tokenizer.encode, prompt)
            return prompt_ids_of(self.ctx, ids, "prompt"), prompt
        return prompt_ids_of(self.ctx, prompt, "prompt"), None

    def engine_logprobs(self):
        return self.req.logprobs

    def _logprobs(self, entries, text_offset):
        if self.req.logprobs is None:
            return None
        return completion_logprobs(self.ctx.tokenizer, entries, self.req.logprobs, text_offset)

    def final_choice(self, index, c):
        return {"index": index, "text": "".join(c.text),
                "logprobs": self._logprobs(c.logprobs if c.has_logprobs else None, 0),
                "finish_reason": c.finish_reason}

    def delta_choices(self, u, c, text_offset):
        return [{"index": u.index, "text": u.text, "logprobs": self._logprobs(u.logprobs, text_offset),
                 "finish_reason": u.finish_reason}]
