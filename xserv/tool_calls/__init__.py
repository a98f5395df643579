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
