"""The request side of tool calls: `tools` and `tool_choice` checked, and the constraint that "required" and a named
function need (the answer must be Qwen3's `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks whose
JSON validates against the tools' schemas).

That constraint is enforced by structured output: the grammar below becomes the request's SamplingParams.structured
(and with thinking on it follows the think block: constraints.reasoning_first).
"""
from __future__ import annotations

import json

from .protocol import APIError, NamedToolChoice, Tool

# tool_choice "required" / named are served (tool_call_constraint's grammar as the request's constraint); False
# answers them with a 400 instead.
STRUCTURED_TOOL_CHOICE = True
# The call's JSON as Qwen3's template writes it (json.dumps' separators, no other whitespace): a model that may emit
# whitespace anywhere (a weak or random one) would otherwise never close the object.
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ANY_OBJECT = {"type": "object"}


def _call_schema(tool: Tool) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": tool.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_constraint(tools: list[Tool] | None, tool_choice, parallel: bool = True,
                         tag_tokens: bool = True) -> dict | None:
    """None for "auto"/"none"/no choice; else {"json_schema": one call's schema, "grammar": the whole answer as a
    Lark grammar in llguidance's dialect}: for "required" one or more calls (one when `parallel` is false) of any
    of the tools, for a named function exactly one call of it. tag_tokens: `<tool_call>` and `</tool_call>` are
    single tokens of the tokenizer (Qwen3's; llguidance treats them as special tokens, which a string literal
    does not match: the grammar names them `<tool_call>`), else they are text."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools or [] if t.function.name == tool_choice.function.name]
        parallel = False
    else:
        chosen = list(tools or [])
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    open_, close = ("<tool_call>", "</tool_call>") if tag_tokens else ('"<tool_call>"', '"</tool_call>"')
    call = (f'call: {open_} "\\n" json_call "\\n" {close}\n'
            f"json_call: %json {json.dumps({**schema, 'x-guidance': _CALL_JSON})}\n")
    start = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
    return {"json_schema": schema, "grammar": start + call}


def check_tool_choice(tools: list[Tool] | None, tool_choice) -> None:
    """400s for a tool_choice the tools do not allow; "required"/named also need structured output."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function name {dup!r} is given more than once", "tools")
    if tool_choice is None or tool_choice in ("auto", "none"):
        return
    label = "required" if tool_choice == "required" else f"function {tool_choice.function.name!r}"
    if not tools:
        raise APIError(400, f"tool_choice {label} needs tools", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {tool_choice.function.name!r}, which is not among the "
                            f"tools ({', '.join(names)})", "tool_choice")
    if not STRUCTURED_TOOL_CHOICE:
        kind = "'required'" if tool_choice == "required" else "naming a function"
        raise APIError(400, f"tool_choice {kind} needs structured output, not available yet: use \"auto\"",
                       "tool_choice", "unsupported_field")
