"""The grammar that forces tool calls in the Qwen3-Coder XML form (tool_choice "required" or a named function), as
a Lark grammar in llguidance's dialect; the server makes it the request's structured output (after the think
block when thinking is on: xserv/structured.py's reasoning_first).

    start: call ("\\n" call)*                        (one call only: a named function, parallel_tool_calls false)
    call:  <tool_call> "\\n" (f0 | f1 | ...) "\\n" </tool_call>
    f0:    "<function=get_weather>\\n" f0_0 f0_1? "</function>"
    f0_0:  "<parameter=city>\\n" STRING_VALUE "\\n"                       (a string: free text)
    f0_1:  "<parameter=days>\\n" f0_1_value "\\n</parameter>\\n"
    f0_1_value: %json {"type": "integer", ...}                         (any other type: JSON of its schema)

What it enforces, and why so:
- The shape the template shows the model, byte for byte (the newlines included), so that the answer parses
  (xml_form.py) and looks like the model's own calls in the history.
- Each function's parameters in the order its schema lists them, the required ones present, the others optional,
  none twice, none the schema does not list. A fixed order keeps the grammar linear in the number of parameters
  (any order of the required ones would need a rule per subset) and is the order models write them in. A tool
  without listed properties takes any parameter names, each with a free-text value.
- A parameter whose schema allows a string (or names no type) is free text without `</parameter>` (the one text
  that would end it early); a string enum is one of its values. Every other parameter is JSON of its own schema
  (the tool's `$defs` brought along for references), compact with ", " and ": " as the template's tojson writes
  it. The split is xml_form.value_kind's, the parser's own, so that every answer the grammar allows parses back to
  values of the schema's types.
- `<tool_call>` and `</tool_call>` name the tokens when the tokenizer has them as single tokens (llguidance does
  not match a special token with a string literal), else they are text.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .xml_form import param_schema, value_kind

# A string value with its closing tag: free text ending in "\n</parameter>" that holds no other "</parameter>".
# One lexeme (the value and the tag together), because llguidance's lexemes are greedy: a value lexeme that
# merely excluded the tag would swallow "\n</parameter" and leave ">" unmatched.
_STRING_VALUE = 'STRING_VALUE: /(.|\\n)*\\n<\\/parameter>/ & ~/(.|\\n)*<\\/parameter>(.|\\n)+/\n'
_PARAM_NAME = "PARAM_NAME: /[^>\\n<]+/\n"
# JSON values as the template's tojson writes them (json.dumps' separators); no free whitespace, so that a model
# that emits whitespace forever (a weak or random one) cannot keep a value open.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _check_name(what: str, name) -> None:
    """The form writes names between `=` and `>` on one line: a name with `>`, `<` or a newline cannot be written."""
    if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
        raise ValueError(f"{what} name {name!r} cannot be written in the XML tool-call form")


def _value_rule(rule: str, schema, defs: dict) -> tuple[str, list[str]]:
    """(what follows `<parameter=P>\\n` in a parameter's rule, extra rules) for a parameter's schema."""
    if value_kind(schema) == "string":
        enum = schema.get("enum") if isinstance(schema, Mapping) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            choices = " | ".join(_literal(v + "\n</parameter>") for v in enum)
            return f"({choices}) \"\\n\"", []
        return 'STRING_VALUE "\\n"', []
    schema = dict(schema) | defs | {"x-guidance": _JSON_OPTIONS}
    return f'{rule}_value "\\n</parameter>\\n"', [f"{rule}_value: %json {json.dumps(schema, ensure_ascii=False)}"]


def _function_rules(rule: str, name: str, parameters) -> list[str]:
    head = _literal(f"<function={name}>\n")
    props = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(props, Mapping) or not props:
        if isinstance(parameters, Mapping) and (props is not None or parameters.get("additionalProperties") is False):
            return [f'{rule}: {head} "</function>"']  # declared with no parameters
        return [f'{rule}: {head} {rule}_any* "</function>"',
                f'{rule}_any: "<parameter=" PARAM_NAME ">\\n" STRING_VALUE "\\n"']
    required = set(parameters.get("required") or [])
    defs = {k: parameters[k] for k in ("$defs", "definitions") if isinstance(parameters.get(k), Mapping)}
    rules, seq = [], []
    for i, key in enumerate(props):
        _check_name("parameter", key)
        prule = f"{rule}_{i}"
        value, extra = _value_rule(prule, param_schema(parameters, key), defs)
        rules.append(f'{prule}: {_literal(f"<parameter={key}>" + chr(10))} {value}')
        rules += extra
        seq.append(prule if key in required else prule + "?")
    return [f"{rule}: {head} {' '.join(seq)} \"</function>\""] + rules


def xml_call_grammar(tools: Sequence[tuple[str, dict | None]], *, parallel: bool = True,
                     tag_tokens: bool = True) -> str:
    """The Lark grammar (module docstring) of an answer made of calls of `tools` ((function name, parameters
    schema) pairs): one or more calls, or exactly one when `parallel` is false. tag_tokens: `<tool_call>` and
    `</tool_call>` are single tokens of the tokenizer."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    for name, _ in tools:
        _check_name("tool", name)
    open_, close = ("<tool_call>", "</tool_call>") if tag_tokens else ('"<tool_call>"', '"</tool_call>"')
    lines = ['start: call ("\\n" call)*' if parallel else "start: call",
             f'call: {open_} "\\n" ({" | ".join(f"f{i}" for i in range(len(tools)))}) "\\n" {close}']
    for i, (name, parameters) in enumerate(tools):
        lines += _function_rules(f"f{i}", name, parameters)
    return "\n".join(lines) + "\n" + _STRING_VALUE + _PARAM_NAME
