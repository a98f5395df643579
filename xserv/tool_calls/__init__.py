"""Tool calls as Qwen models write them inside `<tool_call>...</tool_call>`, in one of two forms:

- "json" (Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  (parsed by xserv/chat_output.py's parse_tool_call; its grammar is xserv/server/tools.py's);
- "xml" (Qwen3-Coder, Qwen3.5, Qwen3.6): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`, string values raw, other values as JSON (xml_form.py parses it, xml_grammar.py
  forces it).

A model answers in the form its chat template shows it: the form is read from the template (`tool_call_format`),
never from the model's name, so a fine-tune or a new size with the same template is served right.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from ..chat_output import ToolCall, parse_tool_call

FORMATS = ("json", "xml")
XML_MARKER = "<function="  # the XML templates show the model this tag; the JSON ones never write it


def tool_call_format(chat_template: str | None) -> str:
    """"xml" when the chat template teaches the Qwen3-Coder XML form, else "json" (Qwen3's, the default for a
    template that shows no form at all)."""
    return "xml" if chat_template and XML_MARKER in chat_template else "json"


def call_parser(form: str, schemas: Mapping[str, dict | None] | None = None) -> Callable[[str], ToolCall | None]:
    """The function that turns one `<tool_call>` block's inside into a ToolCall (None: not a call). schemas: each
    tool's parameters schema by function name (the XML form converts a parameter's value by its type)."""
    if form == "json":
        return parse_tool_call
    if form == "xml":
        from .xml_form import XMLCallParser

        return XMLCallParser(schemas or {})
    raise ValueError(f"tool-call format must be one of {', '.join(FORMATS)}, got {form!r}")


def decode_history_arguments(messages: list) -> list:
    """`messages` with each assistant call's `arguments` given as JSON text (OpenAI's way) decoded to the object, as
    the XML-form templates need (they iterate over its items); ValueError naming the call when the text is not
    the JSON of an object. Messages without such calls are passed through as they are."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if not isinstance(calls, (list, tuple)) or not any(_text_arguments(c) for c in calls):
            out.append(m)
            continue
        decoded = []
        for k, call in enumerate(calls):
            if _text_arguments(call):
                fn = call["function"] if "function" in call else call
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ValueError(f"messages[{i}].tool_calls[{k}]: arguments must be the JSON text of an object")
                fn = {**fn, "arguments": args}
                call = {**call, "function": fn} if "function" in call else fn
            decoded.append(call)
        out.append({**m, "tool_calls": decoded})
    return out


def _text_arguments(call) -> bool:
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    return isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str)
