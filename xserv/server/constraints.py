"""A request's constraint on its answer: `response_format`, vLLM's `guided_*` aliases and `structured_outputs` ->
one StructuredOutput (xserv/structured.py); `logit_bias` checked; and, for chat answers with thinking on, the
constraint moved after the reasoning (`reasoning_first`).

Reasoning first. The engine's constraint covers the whole answer from its first token. With thinking on, Qwen3
writes `<think>\\n...\\n</think>\\n\\n` before the answer, so the constraint is rewritten as one Lark grammar (in
llguidance's dialect) whose first part is an optional think block and whose second part is the request's
constraint, embedded whole:

    start: think? answer
    think: <think> /(.|\\n)*/ </think> /\\n{0,2}/
    answer: %json {...}                  (json_schema, json_object: the schema as llguidance compiles it)
    answer: %lark { ...the grammar... }  (regex: llguidance's one-rule grammar of it; Lark grammars and tool calls:
                                          nested whole, so their rule names cannot clash with ours)

`<think>` and `</think>` are single tokens in Qwen3's tokenizer (151667, 151668), which llguidance's tokenizer
treats as special: `<think>` in a rule names that token (a string literal "</think>" would not match it, and the
reasoning's regex never matches a special token, so the reasoning ends exactly at the model's `</think>` token).
A template whose prompt already opens the block (ends with `<think>`) gets `start: /(.|\\n)*/ </think> ... answer`.
A tokenizer without those tokens gets the tags as text, the reasoning ending lazily at the first `</think>`.

A thinking budget (the request's `thinking_token_budget`, N >= 1) makes the reasoning one lexeme of at most N tokens
(`think_body[max_tokens=N]: /(.|\\n)*/`): after N tokens only `</think>` fits, and the answer follows. A budget
without a constraint gets the answer `<[ids]>*`, any token but the think tags (xserv/structured.py's free_answer).
A budget of 0 is thinking off (the template's `enable_thinking` false): no grammar at all. A budget needs the tags
as tokens (llguidance ends a lazy text lexeme at its max_tokens without its tag): with text tags it is a 400.
"""
from __future__ import annotations

import json
import math

from ..structured import StructuredOutput, has_tokens, reasoning_first  # noqa: F401 (re-exported)
from .protocol import APIError

# the request fields that constrain the answer, in the order a conflict names them
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                     "structured_outputs")
from ..structured import THINK_TOKENS  # noqa: E402,F401 (re-exported)
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def _regex_escape(text: str) -> str:
    """`text` as a literal in llguidance's (Rust) regex syntax."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def choice_regex(choices) -> str:
    """guided_choice's alternatives as one regex (each matched literally)."""
    return "(" + "|".join(_regex_escape(c) for c in choices) + ")"


def _make(field: str, make, *args) -> StructuredOutput:
    try:
        return make(*args)
    except ValueError as e:  # llguidance's message: a bad schema, regex or grammar
        raise APIError(400, f"{field}: {e}", field, "invalid_value") from None


def _lark_of(field: str, grammar) -> StructuredOutput:
    """A Lark grammar in llguidance's dialect; a GBNF grammar (llama.cpp's, vLLM's xgrammar default: `root ::= ...`)
    is converted by llguidance's converter first."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise APIError(400, f"{field} must be a non-empty grammar string", field, "invalid_value")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        grammar = any_to_lark(grammar)
    except Exception as e:  # noqa: BLE001 - GbnfToLarkError and parse errors of a malformed GBNF grammar
        raise APIError(400, f"{field}: not a Lark or GBNF grammar: {e}", field, "invalid_value") from None
    return _make(field, StructuredOutput.lark, grammar)


def _schema_of(field: str, schema) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{field}: the schema is not valid JSON ({e})", field, "invalid_value") from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{field}: the JSON schema must be an object", field, "invalid_value")
    return _make(field, StructuredOutput.json_schema, schema)


def _choice_of(field: str, choices) -> StructuredOutput:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise APIError(400, f"{field} must be a non-empty list of non-empty strings", field, "invalid_value")
    return _make(field, StructuredOutput.regex, choice_regex(choices))


def _response_format(rf) -> StructuredOutput | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput.json_object()
    if rf.json_schema is None:
        raise APIError(400, "response_format: type json_schema needs a json_schema object ({\"name\", \"schema\"})",
                       "response_format", "missing_field")
    if rf.json_schema.schema_ is None:
        raise APIError(400, "response_format: json_schema.schema is required", "response_format", "missing_field")
    return _schema_of("response_format", rf.json_schema.schema_)


def _structured_outputs(so) -> StructuredOutput | None:
    """vLLM's newer form: {"json": ..., "regex": ..., "choice": [...], "grammar": ..., "json_object": true}."""
    if so is None:
        return None
    if not isinstance(so, dict):
        raise APIError(400, "structured_outputs must be an object", "structured_outputs", "invalid_value")
    makers = {"json": _schema_of, "regex": lambda f, v: _regex_of(f, v), "choice": _choice_of, "grammar": _lark_of,
              "json_object": lambda f, v: StructuredOutput.json_object() if v else None}
    given = [k for k in makers if so.get(k) not in (None, False)]
    unknown = [k for k, v in so.items() if k not in makers and v not in (None, False, "", [], {})]
    if unknown:
        raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this server (json, regex, choice, "
                            f"grammar, json_object are)", "structured_outputs", "unsupported_field")
    if len(given) > 1:
        raise APIError(400, f"structured_outputs: {given[0]} and {given[1]} both constrain the answer: give one",
                       "structured_outputs", "invalid_value")
    return makers[given[0]]("structured_outputs", so[given[0]]) if given else None


def _regex_of(field: str, pattern) -> StructuredOutput:
    if not isinstance(pattern, str) or not pattern:
        raise APIError(400, f"{field} must be a non-empty regular expression", field, "invalid_value")
    return _make(field, StructuredOutput.regex, pattern)


def request_constraint(req) -> tuple[str, StructuredOutput] | None:
    """(the field that gave it, the constraint) of a request, or None. Two constraining fields: a 400 naming both;
    a bad schema, regex or grammar: a 400 naming the field with llguidance's message."""
    given = [f for f in CONSTRAINT_FIELDS if _present(f, getattr(req, f, None))]
    if len(given) > 1:
        raise APIError(400, f"{given[0]} and {given[1]} both constrain the answer: give one of them", given[1],
                       "invalid_value")
    if not given:
        return None
    field = given[0]
    value = getattr(req, field)
    if field == "response_format":
        s = _response_format(value)
    elif field == "guided_json":
        s = _schema_of(field, value)
    elif field == "guided_regex":
        s = _regex_of(field, value)
    elif field == "guided_grammar":
        s = _lark_of(field, value)
    elif field == "guided_choice":
        s = _choice_of(field, value)
    else:
        s = _structured_outputs(value)
    return (field, s) if s is not None else None


def _present(field: str, value) -> bool:
    if value is None:
        return False
    if field == "response_format":
        return value.type != "text"
    if field == "structured_outputs":
        return not isinstance(value, dict) or any(v not in (None, False) for v in value.values())
    return True


def logit_bias_of(bias, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id as a string": bias in [-100, 100]}) as SamplingParams takes it; every problem
    is a 400 naming logit_bias."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to biases", "logit_bias", "invalid_value")
    out = {}
    for key, value in bias.items():
        token = key.strip() if isinstance(key, str) else key
        if not isinstance(token, str) or not token.isdigit() or not token.isascii():
            raise APIError(400, f"logit_bias: the key {key!r} is not a token id (a non-negative integer)",
                           "logit_bias", "invalid_value")
        token = int(token)
        if token >= vocab_size:
            raise APIError(400, f"logit_bias: token id {token} is outside the vocabulary (size {vocab_size})",
                           "logit_bias", "invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key!r}]: the bias must be a number in [-100, 100], got {value!r}",
                           "logit_bias", "invalid_value")
        out[token] = float(value)
    return out or None
