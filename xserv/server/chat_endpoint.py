"""/v1/chat/completions: the chat template's prompt, and the answer split into reasoning_content, tool_calls and
content (ChatOutputParser), whole or as stream deltas."""
from __future__ import annotations

import asyncio
import uuid

from ..chat_output import THINK_END, THINK_START, ChatOutputParser, Part
from ..structured import StructuredOutput, free_answer
from ..tool_calls import call_parser, tool_call_format
from ..tool_calls.xml_grammar import xml_call_grammar
from .chat_request import chat_prompt, check_content, enable_thinking_of, prompt_ids_of
from .constraints import THINK_TOKENS, TOOL_TOKENS, has_tokens, reasoning_first
from .logprobs import chat_logprobs
from .openai_api import Endpoint
from .protocol import UNSUPPORTED_CHAT, APIError, NamedToolChoice
from .tools import check_tool_choice, tool_call_constraint


class ChatEndpoint(Endpoint):
    """Chat answers are split by ChatOutputParser (xserv/chat_output.py): `<think>` text -> reasoning_content (when
    thinking is on and the template knows <think>), `<tool_call>` blocks -> tool_calls (when tools are given and
    tool_choice is not "none"; in the form the chat template teaches, JSON or XML: xserv/tool_calls/), the rest ->
    content. Streams hold back text that may be the start of a tag; the logprobs of held-back tokens go out with
    the next delta. An answer that ends inside its think block (max_tokens
    spent while thinking) has content null, not "": there is no answer, only reasoning_content; with thinking on,
    a stream's opening delta has content null too, so that its deltas add up to the same message."""
    object_name, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    prompt_param = "messages"
    unsupported = UNSUPPORTED_CHAT

    def check_request(self):
        req = self.req
        check_content(req.messages)
        self.parse_tools = bool(req.tools) and req.tool_choice != "none"
        self.parallel = req.parallel_tool_calls is not False
        check_tool_choice(req.tools, req.tool_choice)
        super().check_request()
        template = getattr(self.ctx.tokenizer, "chat_template", None) or ""
        self.tool_format = tool_call_format(template)
        self.parse_call = call_parser(self.tool_format, {t.function.name: t.function.parameters
                                                         for t in req.tools or []})
        if req.tool_choice is not None and req.tool_choice not in ("auto", "none"):
            label = "'required'" if req.tool_choice == "required" else "naming a function"
            if self.structured is not None:
                raise APIError(400, f"tool_choice {label} and {self.structured_param} both constrain the answer: "
                                    f"give one of them", self.structured_param, "invalid_value")
            try:
                self.structured = StructuredOutput.lark(self._tool_grammar())
            except ValueError as e:  # a tool's parameters are not a schema llguidance can compile
                raise APIError(400, f"tools: the parameters of the tool_choice {label} do not compile: {e}",
                               "tools", "invalid_value") from None
            self.structured_param = "tool_choice"
        self.reasoning = THINK_START in template and enable_thinking_of(req)
        self.in_reasoning = False
        self.parsers: dict[int, ChatOutputParser] = {}
        self.pending_logprobs: dict[int, list] = {}
        self.num_calls: dict[int, int] = {}

    def _tool_grammar(self) -> str:
        """The grammar of tool_choice "required" or a named function, in the template's form of tool calls."""
        req = self.req
        tag_tokens = has_tokens(self.ctx.tokenizer, TOOL_TOKENS)
        if self.tool_format == "json":
            return tool_call_constraint(req.tools, req.tool_choice, self.parallel, tag_tokens=tag_tokens)["grammar"]
        chosen = list(req.tools)
        if isinstance(req.tool_choice, NamedToolChoice):
            chosen = [t for t in chosen if t.function.name == req.tool_choice.function.name]
        return xml_call_grammar([(t.function.name, t.function.parameters) for t in chosen], tag_tokens=tag_tokens,
                                parallel=self.parallel and not isinstance(req.tool_choice, NamedToolChoice))

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
        return ChatOutputParser(reasoning=self.reasoning, in_reasoning=self.in_reasoning, tools=self.parse_tools,
                                parse_call=self.parse_call)

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
