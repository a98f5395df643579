"""A chat answer's text split into its parts: the reasoning (`<think>...</think>`), the content, and the tool calls
(`<tool_call>...</tool_call>` blocks: Qwen3's and Hermes' JSON form by default, or the form `parse_call` reads, such
as the Qwen3-Coder XML form of xserv/tool_calls/).

`ChatOutputParser` takes the text in pieces as it is generated (`push`) and returns the parts that are decided;
`finish()` returns the rest. Whole answers go through the same machine (`parse_chat_output`), so a streamed answer's
parts, joined, always equal the whole answer's. Pure Python (no server, no engine): the library can use it too.

- Reasoning (when on): an answer that starts with `<think>` (or whose prompt already opened it:
  `in_reasoning=True`) is reasoning up to `</think>`; an answer that ends before `</think>` is all reasoning. The
  tags are never part of either; the newlines the model puts after `</think>` are dropped from the content.
- Tool calls (when on): each `<tool_call>...</tool_call>` block whose inside `parse_call` reads as a call becomes
  one (arguments as JSON text); the default, parse_tool_call, takes a JSON object with a string `name` and an
  object `arguments`. A block that is not a call (bad JSON, no name, cut off by the end of the answer) stays in
  the content as the model wrote it. Whitespace around the blocks is dropped; text before and between them is
  content.
- Text that might be the start of a tag (`<tool` at the end of a piece) is held back until the next piece decides.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Part:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_call(block: str) -> ToolCall | None:
    """The call in one `<tool_call>` block's inside, or None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ChatOutputParser:
    def __init__(self, *, reasoning: bool = False, in_reasoning: bool = False, tools: bool = False,
                 parse_call: Callable[[str], ToolCall | None] = parse_tool_call):
        self.tools = tools
        self.parse_call = parse_call
        self.mode = "reasoning" if in_reasoning else ("start" if reasoning else "content")
        self.buf = ""
        self.content_started = not (reasoning or in_reasoning)  # after </think>: drop the newlines first
        self.held_space = ""  # content's trailing whitespace: it may turn out to lie next to a tool call
        self.call_space = ""  # the whitespace before the open block (content again if the block is no call)
        self.after_call = False
        self.num_calls = 0

    def push(self, text: str) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        while True:
            before = (self.mode, len(self.buf))
            if self.mode == "start":
                if self.buf.startswith(THINK_START):
                    self.buf = self.buf[len(THINK_START):]
                    self.mode = "reasoning"
                elif THINK_START.startswith(self.buf):
                    return out  # could still become <think>
                else:
                    self.mode, self.content_started = "content", True
            elif self.mode == "reasoning":
                end = self.buf.find(THINK_END)
                if end >= 0:
                    self._emit(out, "reasoning", self.buf[:end])
                    self.buf = self.buf[end + len(THINK_END):]
                    self.mode = "content"
                else:
                    keep = _partial_tag_len(self.buf, THINK_END)
                    self._emit(out, "reasoning", self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
            elif self.mode == "content":
                if not self.content_started:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return out
                    self.content_started = True
                start = self.buf.find(TOOL_START) if self.tools else -1
                if start >= 0:
                    self._content(out, self.buf[:start])
                    self.call_space, self.held_space = self.held_space, ""  # dropped if the block is a call
                    self.buf = self.buf[start + len(TOOL_START):]
                    self.mode = "call"
                else:
                    keep = _partial_tag_len(self.buf, TOOL_START) if self.tools else 0
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
            elif self.mode == "call":
                end = self.buf.find(TOOL_END)
                if end < 0:
                    return out
                block, self.buf = self.buf[:end], self.buf[end + len(TOOL_END):]
                self.mode = "content"
                call = self.parse_call(block)
                if call is None:
                    self._content(out, self.call_space + TOOL_START + block + TOOL_END)
                else:
                    self.num_calls += 1
                    self.after_call = True
                    out.append(Part("tool_call", call=call))
            if (self.mode, len(self.buf)) == before:  # pragma: no cover - every branch above moves on
                raise AssertionError("ChatOutputParser made no progress")

    def finish(self) -> list[Part]:
        """The parts still held back, at the end of the answer."""
        out: list[Part] = []
        if self.mode == "start":
            self._content(out, self.buf)
        elif self.mode == "reasoning":
            self._emit(out, "reasoning", self.buf)
        elif self.mode == "content":
            self._content(out, self.buf)
        elif self.mode == "call":  # cut off inside a block: the model's text, as content
            self._content(out, self.call_space + TOOL_START + self.buf)
        self.buf = ""
        if self.held_space and not self.num_calls:
            self._emit(out, "content", self.held_space)
        self.held_space = ""
        return out

    def _content(self, out: list[Part], text: str) -> None:
        if not self.tools:
            self._emit(out, "content", text)
            return
        if self.after_call:  # the gap after a call's block
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.held_space + text
        kept = text.rstrip()
        self.held_space = text[len(kept):]
        self._emit(out, "content", kept)

    def _emit(self, out: list[Part], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1].kind == kind:
            out[-1] = Part(kind, out[-1].text + text)
        else:
            out.append(Part(kind, text))


def parse_chat_output(text: str, **kwargs) -> tuple[str | None, str, list[ToolCall]]:
    """(reasoning or None, content, tool calls) of a whole answer; kwargs as ChatOutputParser's."""
    parser = ChatOutputParser(**kwargs)
    parts = parser.push(text) + parser.finish()
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    content = "".join(p.text for p in parts if p.kind == "content")
    return (reasoning if any(p.kind == "reasoning" for p in parts) else None), content, \
        [p.call for p in parts if p.kind == "tool_call"]
