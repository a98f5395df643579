"""The Qwen3-Coder XML tool-call form, parsed: the inside of one `<tool_call>` block,

    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    ...
    </function>

-> ToolCall(NAME, arguments as compact JSON text). The chat templates write a string value as it is and any other
value as JSON, each between one newline after `<parameter=P>` and one before `</parameter>`; parsing undoes that:
one newline is taken off each end, then the parameter's schema decides (`value_kind`):

- a string parameter (or one whose schema names no type, or a tool without a schema, or a parameter the schema
  does not list) keeps the text as it is;
- integer, number, boolean, null, object and array parameters are parsed as JSON (Python's spellings too:
  True, None, single-quoted dicts, as models trained on Python sometimes write them) and kept when the result has
  one of the schema's types; otherwise the raw text stays, so that a value the model got wrong reaches the client
  as it was written instead of disappearing.

Lenient where a model is often sloppy: a value with no `</parameter>` after it in the block ends at the next
`<parameter=` or at the end, a missing `</function>` at the end of the block. (A value followed by a closer runs
to it, `<parameter=` inside included: the grammar lets a string hold that text, and what it allows must parse.)
Anything else (text outside the tags, no `<function=`) is not a call: the block then stays in the content as the
model wrote it (xserv/chat_output.py).
"""
from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping

from ..chat_output import ToolCall

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.S)
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>")
_JSON_TYPES = ("integer", "number", "boolean", "null", "object", "array")


# ---- a parameter's schema -> how its value is written ---------------------------------------------------------------
def schema_types(schema) -> set[str]:
    """The JSON types a schema allows, as far as `type`, `enum`/`const` and anyOf/oneOf/allOf say (empty: any)."""
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    values = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if values is not None:
        return {_type_of(v) for v in values}
    out: set[str] = set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            sub_types = schema_types(sub)
            if not sub_types:
                return set()  # one branch allows anything
            out |= sub_types
    return out


def value_kind(schema) -> str:
    """"string" (the value is written raw: a string is allowed, or the schema names no type) or "json"."""
    types = schema_types(schema)
    return "string" if not types or "string" in types else "json"


def _type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, (list, tuple)) else "object"


def param_schema(parameters, name: str):
    """The schema of parameter `name` in a tool's parameters schema (None: not listed), a local `$ref` resolved."""
    if not isinstance(parameters, Mapping):
        return None
    props = parameters.get("properties")
    schema = props.get(name) if isinstance(props, Mapping) else None
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
        _, where, key = ref.split("/", 2)
        schema = (parameters.get(where) or {}).get(key, schema)
    return schema


# ---- values ---------------------------------------------------------------------------------------------------------
class _NotAValue(Exception):
    pass


def _reject_constant(name):  # NaN, Infinity: not JSON, and nothing a client can parse
    raise _NotAValue(name)


def _parse_json(text: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, _NotAValue, RecursionError):
        pass
    try:  # Python's literals: True, None, {'a': 1}, (1, 2)
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)  # sets, bytes, complex numbers are no JSON value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _NotAValue(text) from None
    return value


def _fits(value, types: set[str]) -> bool:
    t = _type_of(value)
    if t == "integer" and "number" in types:
        return True
    if t == "number" and "integer" in types and math.isfinite(value) and float(value).is_integer():
        return True
    return t in types


def convert_value(text: str, schema) -> object:
    """A parameter's written value -> its JSON value, by the parameter's schema (the module's docstring)."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    if value_kind(schema) == "string":
        return text
    types = schema_types(schema)
    try:
        value = _parse_json(text.strip())
    except _NotAValue:
        return text
    if not _fits(value, types):
        return text
    if isinstance(value, float) and "number" not in types:
        return int(value)  # 3.0 for an integer parameter
    if isinstance(value, tuple):
        return list(value)
    return value


# ---- a block --------------------------------------------------------------------------------------------------------
def parse_xml_call(block: str, schemas: Mapping[str, dict | None]) -> ToolCall | None:
    """The call in one `<tool_call>` block's inside, or None when it is not one."""
    m = _FUNCTION.match(block)
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    if not name:
        return None
    parameters = schemas.get(name)
    args: dict = {}
    pos = 0
    while True:
        p = _PARAM.match(body, pos)
        if p is None:
            if body[pos:].strip():
                return None  # text that is no parameter
            break
        key = p.group(1).strip()
        end = body.find(PARAM_CLOSE, p.end())
        after = end + len(PARAM_CLOSE)
        if end < 0:  # no closing tag: up to the next parameter, or to the end
            following = body.find(PARAM_OPEN, p.end())
            end = after = following if following >= 0 else len(body)
        if not key:
            return None
        args[key] = convert_value(body[p.end():end], param_schema(parameters, key))
        pos = after
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class XMLCallParser:
    """parse_xml_call with the tools' parameter schemas bound (the callable ChatOutputParser takes)."""

    def __init__(self, schemas: Mapping[str, dict | None]):
        self.schemas = dict(schemas)

    def __call__(self, block: str) -> ToolCall | None:
        return parse_xml_call(block, self.schemas)
