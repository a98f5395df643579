"""The request side of tool calls: `tools` and `tool_choice` checked, and the constraint that "required" and a named
function need (the answer must be Qwen3's `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks whose
JSON validates against the tools' schemas).

That constraint is enforced by structured output (a SamplingParams constraint); until the server wires it,
`check_tool_choice` answers "required" and named functions with a 400 instead of returning unconstrained text.
"""
from __future__ import annotations

import json

from .protocol import APIError, NamedToolChoice, Tool

# Set when the engine's structured output is wired to tool_choice "required" / named (tool_call_constraint's
# grammar as the request's constraint).
STRUCTURED_TOOL_CHOICE = False

_ANY_OBJECT = {"type": "object"}


def _call_schema(tool: Tool) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name},
                           "arguments": tool.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_constraint(tools: list[Tool] | None, tool_choice, parallel: bool = True) -> dict | None:
    """None for "auto"/"none"/no choice; else {"json_schema": one call's schema, "grammar": the whole answer as a
    Lark grammar in llguidance's dialect}: for "required" one or more calls (one when `parallel` is false) of any
    of the tools, for a named function exactly one call of it."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools or [] if t.function.name == tool_choice.function.name]
        parallel = False
    else:
        chosen = list(tools or [])
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = 'call: "<tool_call>\\n" json_call "\\n</tool_call>"\n' f"json_call: %json {json.dumps(schema)}\n"
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
