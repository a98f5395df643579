"""/v1/chat/completions and /v1/completions: a validated request -> prompt token ids and SamplingParams -> the
AsyncEngine -> an OpenAI response body or an SSE stream of chunks."""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..chat_output import THINK_END, THINK_START, ChatOutputParser, Part
from ..sampling import SamplingParams
from ..structured import StructuredOutput, free_answer
from .async_engine import AsyncEngine, EngineBroken, EngineStopped, Update
from .metrics import ServerMetrics
from .protocol import (MAX_STOP_STRINGS, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, APIError, ChatCompletionRequest,
                       error_body, unsupported_field)
from .constraints import (THINK_TOKENS, TOOL_TOKENS, has_tokens, logit_bias_of, reasoning_first,
                          request_constraint)
from .tools import check_tool_choice, tool_call_constraint

# SamplingParams fields a request may leave to the model's generation_config.json defaults
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty")


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    vocab_size: int
    max_in_flight: int  # sequences running + queued before new requests get 503
    sampling_defaults: dict = field(default_factory=dict)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    draining: bool = False
    num_requests: int = 0  # requests in the engine (a request has n sequences)

    def check_serving(self, num_choices: int) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine.error is not None:
            raise APIError(503, "the engine failed; the server is exiting", code="engine_failed")
        if self.engine.num_in_flight + num_choices > self.max_in_flight:
            self.metrics.rejected += 1
            raise APIError(503, f"the server is overloaded: {self.engine.num_in_flight} sequences in flight, the "
                                f"limit is {self.max_in_flight} (--max-num-seqs + --max-waiting); retry later",
                           code="overloaded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")


# ---- request -> engine input ----------------------------------------------------------------------------------------
def template_message(m) -> dict:
    """A request message as chat templates expect it (transformers' format: content always a string)."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        # arguments stay the JSON text the client sent (Qwen3's template writes a string as it is, a dict as JSON)
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def enable_thinking_of(req: ChatCompletionRequest) -> bool:
    """Thinking as the template renders it: chat_template_kwargs.enable_thinking (default on), off for a
    thinking_token_budget of 0 (the template's own empty block: the form the model knows for no thinking)."""
    value = (req.chat_template_kwargs or {}).get("enable_thinking", True)
    if not isinstance(value, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return value and req.thinking_token_budget != 0


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> str:
    messages = [template_message(m) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    kwargs.pop("enable_thinking", None)
    kwargs.pop("tools", None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 enable_thinking=enable_thinking_of(req), tools=tools, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template's raise_exception and Jinja errors are the request's fault
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None


def prompt_ids_of(ctx: ServerContext, prompt, param: str) -> list[int]:
    ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, f"{param} is empty: give at least one token", param)
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise APIError(400, f"{param}: token id(s) {bad[:5]} outside the vocabulary (size {ctx.vocab_size})", param)
    if len(ids) >= ctx.max_model_len:
        raise APIError(400, f"{param} has {len(ids)} tokens; the model's context is {ctx.max_model_len} tokens "
                            f"(max_model_len), which leaves no room for output", param, "context_length_exceeded")
    return ids


def sampling_params(ctx: ServerContext, req, num_prompt_tokens: int, *, max_tokens: int | None,
                    max_tokens_param: str, logprobs: int | None, structured: StructuredOutput | None = None,
                    logit_bias: dict | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them: the same values, seed + i when a seed is given)."""
    room = ctx.max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = min(ctx.sampling_defaults.get("max_tokens", room), room)
    elif max_tokens > room:
        raise APIError(400, f"{max_tokens_param} {max_tokens} + the prompt's {num_prompt_tokens} tokens is more than "
                            f"the model's context of {ctx.max_model_len} tokens (max_model_len); at most {room} "
                            f"output tokens fit", max_tokens_param, "context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise APIError(400, "stop: stop strings must not be empty", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    kw = {name: getattr(req, name) for name in _DEFAULTED}
    for name, value in kw.items():
        if value is None and name in ctx.sampling_defaults:
            kw[name] = ctx.sampling_defaults[name]
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        params = [SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                                 ignore_eos=req.ignore_eos, logprobs=logprobs, structured=structured,
                                 logit_bias=logit_bias,
                                 seed=None if req.seed is None else (req.seed + i) % 2**64, **kw)
                  for i in range(req.n)]
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name in SamplingParams.__dataclass_fields__ else None) from None
    return params


# ---- engine output -> response ------------------------------------------------------------------------------------
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


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


# A logprob that is not a finite number (-inf, NaN) has no JSON form (RFC 8259: Python would write the bare
# -Infinity, which JavaScript's JSON.parse, Go and Rust refuse): it goes out as this, the value vLLM writes.
NON_FINITE_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NON_FINITE_LOGPROB


def _top(entry: dict, top_n: int) -> list[tuple[int, float]]:
    """The entry's top (token id, logprob) pairs, at most top_n, without the tokens that could not be sampled (at
    -inf, e.g. masked by a constraint): a step that allows fewer tokens than top_n lists fewer."""
    return [(t, _finite(lp)) for t, lp in (entry.get("top") or [])[:top_n] if lp != -math.inf]


def chat_logprobs(tokenizer, entries: list[dict] | None, top_n: int) -> dict | None:
    if entries is None:
        return None

    def one(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for e in entries:
        item = one(e["token_id"], _finite(e["logprob"]))
        item["top_logprobs"] = [one(t, lp) for t, lp in _top(e, top_n)]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer, entries: list[dict] | None, top_n: int, text_offset: int) -> dict | None:
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(_token_text(tokenizer, e["token_id"]))
        text_offset += len(tokens[-1])
    top = [{_token_text(tokenizer, t): lp for t, lp in _top(e, top_n)} for e in entries]
    return {"tokens": tokens, "token_logprobs": [_finite(e["logprob"]) for e in entries],
            "top_logprobs": top if top_n else None, "text_offset": offsets}


def _dumps(payload) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else _dumps(payload)}\n\n".encode()


def _error_event(e: BaseException) -> bytes:
    return sse(error_body(503, str(e), None, "engine_failed" if isinstance(e, EngineBroken) else "shutting_down"))


# ---- the two endpoints ---------------------------------------------------------------------------------------------
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


class ChatEndpoint(Endpoint):
    """Chat answers are split by ChatOutputParser (xserv/chat_output.py): `<think>` text -> reasoning_content (when
    thinking is on and the template knows <think>), `<tool_call>` blocks -> tool_calls (when tools are given and
    tool_choice is not "none"), the rest -> content. Streams hold back text that may be the start of a tag; the
    logprobs of held-back tokens go out with the next delta. An answer that ends inside its think block (max_tokens
    spent while thinking) has content null, not "": there is no answer, only reasoning_content; with thinking on,
    a stream's opening delta has content null too, so that its deltas add up to the same message."""
    object_name, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    prompt_param = "messages"
    unsupported = UNSUPPORTED_CHAT

    def check_request(self):
        req = self.req
        self.parse_tools = bool(req.tools) and req.tool_choice != "none"
        self.parallel = req.parallel_tool_calls is not False
        check_tool_choice(req.tools, req.tool_choice)
        super().check_request()
        tool = tool_call_constraint(req.tools, req.tool_choice, self.parallel,
                                    tag_tokens=has_tokens(self.ctx.tokenizer, TOOL_TOKENS))
        if tool is not None:
            label = "'required'" if req.tool_choice == "required" else "naming a function"
            if self.structured is not None:
                raise APIError(400, f"tool_choice {label} and {self.structured_param} both constrain the answer: "
                                    f"give one of them", self.structured_param, "invalid_value")
            try:
                self.structured = StructuredOutput.lark(tool["grammar"])
            except ValueError as e:  # a tool's parameters are not a schema llguidance can compile
                raise APIError(400, f"tools: the parameters of the tool_choice {label} do not compile: {e}",
                               "tools", "invalid_value") from None
            self.structured_param = "tool_choice"
        template = getattr(self.ctx.tokenizer, "chat_template", None) or ""
        self.reasoning = THINK_START in template and enable_thinking_of(req)
        self.in_reasoning = False
        self.parsers: dict[int, ChatOutputParser] = {}
        self.pending_logprobs: dict[int, list] = {}
        self.num_calls: dict[int, int] = {}

    async def prompt(self):
        text = chat_prompt(self.ctx, self.req)
        # a template that opens the think block itself (the prompt ends with <think>): the answer starts in it
        tail = text.rstrip()
        self.in_reasoning = self.reasoning and tail.endswith(THINK_START) and not tail.endswith(THINK_END)
        ids = await asyncio.to_thread(self.ctx.tokenizer.encode, text)
        return prompt_ids_of(self.ctx, ids, "messages"), text

    def final_constraint(self):
        """With thinking on, the constraint applies to the answer after the think block, which a
        thinking_token_budget bounds (constraints.py); a budget without a constraint gets a free answer."""
        budget = self.req.thinking_token_budget
        if not self.reasoning or (self.structured is None and budget is None):
            return self.structured
        answer = self.structured if self.structured is not None else free_answer(self.ctx.tokenizer)
        try:
            return reasoning_first(answer, opened=self.in_reasoning,
                                   think_tokens=has_tokens(self.ctx.tokenizer, THINK_TOKENS), budget=budget)
        except ValueError as e:
            if budget is None:  # pragma: no cover - the constraint alone compiled
                raise APIError(400, f"{self.structured_param}: {e}", self.structured_param, "invalid_value") from None
            # the one budget the grammar cannot bound: think tags that are text, not tokens
            raise APIError(400, str(e), "thinking_token_budget", "invalid_value") from None

    def max_tokens(self):
        return self.req.max_completion_tokens if self.req.max_completion_tokens is not None else self.req.max_tokens

    def max_tokens_param(self):
        return "max_completion_tokens" if self.req.max_completion_tokens is not None else "max_tokens"

    def engine_logprobs(self):
        return (self.req.top_logprobs or 0) if self.req.logprobs else None

    def _logprobs(self, entries):
        return chat_logprobs(self.ctx.tokenizer, entries, self.req.top_logprobs or 0) if self.req.logprobs else None

    def _parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, in_reasoning=self.in_reasoning, tools=self.parse_tools)

    def _tool_call(self, index: int, part: Part) -> dict | None:
        """The call's OpenAI form, or None for a call past the first when parallel_tool_calls is false."""
        k = self.num_calls.get(index, 0)
        if k and not self.parallel:
            return None
        self.num_calls[index] = k + 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": part.call.name, "arguments": part.call.arguments}}

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls.get(index) else reason

    def opening_chunks(self, n):
        content = None if self.reasoning else ""
        return [{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                 "finish_reason": None} for i in range(n)]

    def final_choice(self, index, c):
        parser = self._parser()
        parts = parser.push("".join(c.text))
        thinking = parser.mode == "reasoning"  # it ended inside the think block
        parts += parser.finish()
        content = "".join(p.text for p in parts if p.kind == "content")
        calls = [call for call in (self._tool_call(index, p) for p in parts if p.kind == "tool_call") if call]
        message = {"role": "assistant", "content": content if content or not (calls or thinking) else None}
        if self.reasoning:
            message["reasoning_content"] = ("".join(p.text for p in parts if p.kind == "reasoning")
                                            if any(p.kind == "reasoning" for p in parts) else None)
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message,
                "logprobs": self._logprobs(c.logprobs if c.has_logprobs else None),
                "finish_reason": self._finish_reason(index, c.finish_reason)}

    def delta_choices(self, u, c, text_offset):
        parser = self.parsers.get(u.index)
        if parser is None:
            parser = self.parsers[u.index] = self._parser()
        parts = parser.push(u.text) if u.text else []
        if u.finish_reason is not None:
            parts += parser.finish()
        deltas = []
        for p in parts:
            if p.kind == "tool_call":
                call = self._tool_call(u.index, p)
                if call is None:
                    continue
                k = self.num_calls[u.index] - 1
                # OpenAI's shape: the id, type and name first (arguments ""), then the argument text
                deltas.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                               "function": {"name": call["function"]["name"], "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
            elif deltas and p.kind == "content" and "content" not in deltas[-1] and "tool_calls" not in deltas[-1]:
                deltas[-1]["content"] = p.text  # reasoning then content: one delta
            else:
                deltas.append({"reasoning_content" if p.kind == "reasoning" else "content": p.text})
        if u.logprobs is not None:
            self.pending_logprobs.setdefault(u.index, []).extend(u.logprobs)
        if not deltas and u.finish_reason is None:
            return []  # all of its text is held back: nothing to send yet (its logprobs wait for the text)
        choices = [{"index": u.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas or [{}]]
        if self.req.logprobs:
            choices[0]["logprobs"] = self._logprobs(self.pending_logprobs.pop(u.index, []))
        choices[-1]["finish_reason"] = self._finish_reason(u.index, u.finish_reason)
        return choices


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
