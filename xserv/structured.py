"""Structured output: a request's answer constrained to a JSON schema, any JSON object, a regular expression or a
Lark grammar, through llguidance (https://github.com/guidance-ai/llguidance).

`StructuredOutput` is the request's description (a `SamplingParams.structured` field, validated on construction:
a bad schema, regex or grammar raises ValueError). `GrammarConstraint` is one sequence's live matcher: before each
step the engine asks it for the step's token mask (one bit per token, int32 words, bit i of word i // 32), the
sampling kernel sets the logits of the tokens left out to -inf, and the sampled token advances the matcher when it
is booked. Tokens past the tokenizer's vocabulary (the model's embedding has more rows) are always left out; the
model's end-of-sequence tokens are allowed exactly when the grammar accepts the text so far.

A regex's `\\d`, `\\w` and `\\s` (and `\\D`, `\\W`, `\\S`) are ASCII classes, as in vLLM's and SGLang's regexes and
in a JSON schema's `pattern`: a user who asks for `\\d{4}` wants four of 0-9, not of Unicode's hundreds of decimal
digits. Named Unicode classes (`\\p{Nd}`) keep their meaning.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "grammar")
# Compact JSON (no free whitespace between tokens, ", " and ": " separators): a model that emits whitespace forever
# (a weak or random one) would otherwise never close its object.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llg():
    import llguidance

    return llguidance


@dataclass(frozen=True)
class StructuredOutput:
    """kind: "json_schema" (spec: the schema, a dict or its JSON text), "json_object" (spec None: any JSON object),
    "regex" (spec: the pattern, Rust regex syntax with ASCII \\d, \\w and \\s, matched against the whole answer) or
    "grammar" (spec: a Lark grammar in llguidance's dialect, rule `start`). Construct with the class methods or
    directly."""
    kind: str
    spec: str | None = None  # the schema as canonical JSON text, the pattern, or the grammar

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_object":
            if spec is not None:
                raise ValueError("json_object takes no spec (use kind='json_schema' for a schema)")
        elif self.kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json_schema: not valid JSON: {e}") from None
            if isinstance(spec, bool):
                raise ValueError("json_schema: give an object schema (true/false schemas are not supported)")
            if not isinstance(spec, dict):
                raise ValueError(f"json_schema: the schema must be a JSON object, got {type(spec).__name__}")
            object.__setattr__(self, "spec", json.dumps(spec, sort_keys=True, separators=(",", ":")))
        else:
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"{self.kind}: give the {'pattern' if self.kind == 'regex' else 'grammar'} as a "
                                 f"non-empty string, got {spec!r}")
        error = _validate(self.grammar())
        if error:
            raise ValueError(f"structured output ({self.kind}): {error}")

    @classmethod
    def json_schema(cls, schema) -> "StructuredOutput":
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "StructuredOutput":
        return cls("grammar", grammar)

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (json_schema), {"type": "object"} (json_object), else None."""
        if self.kind == "json_schema":
            return json.loads(self.spec)
        return {"type": "object"} if self.kind == "json_object" else None

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        M = _llg().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            try:
                return M.grammar_from_json_schema(self.schema, defaults=_JSON_OPTIONS)
            except ValueError as e:
                raise ValueError(f"structured output ({self.kind}): {e}") from None
        if self.kind == "regex":
            return M.grammar_from_lark(_regex_lark(self.spec))
        return M.grammar_from_lark(self.spec)


def _regex_lark(pattern: str) -> str:
    """A regex constraint as a one-rule Lark grammar. regex_to_lark rewrites \\d, \\w, \\s and their negations as
    ASCII classes ("dws"; inside brackets too, escaped backslashes left alone) and escapes the pattern for /.../;
    grammar_from_regex would keep them Unicode."""
    return "start: /" + _llg().regex_to_lark(pattern, "dws") + "/"


def _validate(grammar: str) -> str:
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, None)
    return messages[0].strip() if is_error else ""


# ---- the tokenizer llguidance sees ------------------------------------------------------------------------------
_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()


class GrammarTokenizer:
    """llguidance's LLTokenizer (`llt`) and the model's end-of-sequence ids (`eos`, sorted). llguidance before 1.7
    takes one end-of-sequence token (1.7 takes a list too; glibc 2.28 systems get 1.6 at most), so it is given the
    first on every version and the masks give the others its bit: one code path for the whole range."""

    def __init__(self, llt, eos):
        self.llt = llt
        self.eos = tuple(eos)
        self.vocab_size = llt.vocab_size


def grammar_tokenizer(tokenizer, eos_token_ids, n_vocab: int) -> GrammarTokenizer:
    """llguidance's view of an xserv Tokenizer (built from its tokenizer.json: ~2 s for Qwen3's, so cached per
    tokenizer content, end-of-sequence ids and vocabulary size). Every id in `eos_token_ids` ends an accepted
    answer. n_vocab: the model's vocabulary (its masks then have the model's row width; the ids past the
    tokenizer's own are never allowed)."""
    hf = getattr(tokenizer, "_tok", tokenizer)  # the `tokenizers` object
    if hf.get_vocab_size(with_added_tokens=True) > n_vocab:
        raise ValueError(f"structured output: the tokenizer has {hf.get_vocab_size(with_added_tokens=True)} tokens, "
                         f"more than the model's vocabulary ({n_vocab})")
    text = hf.to_str()
    eos = sorted({int(t) for t in eos_token_ids})
    key = (hashlib.sha1(text.encode()).hexdigest(), tuple(eos), n_vocab)
    with _TOKENIZERS_LOCK:
        gt = _TOKENIZERS.get(key)
        if gt is None:
            llt = _llg().LLTokenizer(text, n_vocab=n_vocab, eos_token=eos[0] if eos else None)
            gt = _TOKENIZERS[key] = GrammarTokenizer(llt, eos)
    return gt


def _share_eos_bit(rows: np.ndarray, eos: tuple) -> None:
    """Every id of `eos` gets the bit of the first (the one llguidance knows) in each mask row of `rows`."""
    if len(eos) < 2:
        return
    bits = rows.view(np.uint32)
    first = eos[0]
    allowed = (bits[..., first >> 5] >> np.uint32(first & 31)) & np.uint32(1)
    for t in eos[1:]:
        bits[..., t >> 5] |= allowed << np.uint32(t & 31)


_EXECUTOR = None


def fill_masks(constraints, masks: np.ndarray) -> None:
    """Row j of `masks` (int32 [>= len(constraints), words], C-contiguous) gets constraints[j]'s next-token
    mask; several at once are computed by llguidance's thread pool (the GIL released)."""
    global _EXECUTOR
    if not constraints:
        return
    words = constraints[0].words
    if masks.dtype != np.int32 or not masks.flags.c_contiguous or masks.shape[1] != words \
            or masks.shape[0] < len(constraints):
        raise ValueError(f"internal: masks must be C-contiguous int32 [>= {len(constraints)}, {words}], got "
                         f"{masks.dtype} {masks.shape}")
    if len(constraints) == 1:
        constraints[0].fill(masks[0])
        return
    if _EXECUTOR is None:
        _EXECUTOR = _llg().LLExecutor()
    _EXECUTOR.unsafe_compute_mask_ptr([(c.matcher, j) for j, c in enumerate(constraints)], masks.ctypes.data,
                                      words * 4, masks.shape[0])
    eos = constraints[0].eos
    if all(c.eos == eos for c in constraints):  # one engine, one tokenizer: the usual case
        _share_eos_bit(masks[:len(constraints)], eos)
    else:
        for j, c in enumerate(constraints):
            _share_eos_bit(masks[j], c.eos)


def mask_words(vocab: int) -> int:
    """int32 words per row of a token bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


class GrammarConstraint:
    """One sequence's matcher. `fill(row)` writes the next token's mask into an int32 row of
    mask_words(tokenizer.vocab_size) words (the model's vocabulary: see grammar_tokenizer); `consume(token)` advances
    it by a sampled token."""

    def __init__(self, tokenizer: GrammarTokenizer, structured: StructuredOutput):
        llg = _llg()
        self.structured = structured
        self.matcher = llg.LLMatcher(tokenizer.llt, structured.grammar(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"structured output ({structured.kind}): {self.matcher.get_error()}")
        self.words = mask_words(tokenizer.vocab_size)
        self.eos = tokenizer.eos

    def fill(self, row: np.ndarray) -> None:
        if row.dtype != np.int32 or not row.flags.c_contiguous or row.shape[-1] != self.words:
            raise ValueError("internal: a token mask row must be contiguous int32 of "
                             f"{self.words} words, got {row.dtype} {row.shape}")
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, self.words * 4)
        _share_eos_bit(row, self.eos)

    def consume(self, token: int) -> bool:
        """False when the token does not fit the grammar (the matcher is then in its error state)."""
        return self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete (nothing but end-of-sequence can follow) or the matcher failed."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


# ---- a chat answer that thinks first ---------------------------------------------------------------------------------
# With thinking on, Qwen3 writes `<think>...</think>` before its answer: the constraint belongs to the answer. The
# grammar that puts it there, and why it names the tags as tokens: xserv/server/constraints.py's module docstring.
THINK_TOKENS = ("<think>", "</think>")


def has_tokens(tokenizer, tags) -> bool:
    """Every tag is one token of `tokenizer` (Qwen3: <think>, </think>, <tool_call>, </tool_call>)."""
    to_id = getattr(tokenizer, "token_to_id", None)
    if to_id is None:
        return False
    try:
        return all(to_id(tag) is not None for tag in tags)
    except Exception:  # noqa: BLE001 - a tokenizer without the lookup: text tags
        return False


def _answer_rule(s: StructuredOutput) -> str:
    if s.kind in ("json_schema", "json_object"):
        # the schema as the core compiles it (its x-guidance options: compact JSON), inline
        grammars = json.loads(s.grammar())["grammars"]
        return "answer: %json " + json.dumps(grammars[0]["json_schema"]) + "\n"
    if s.kind == "regex":
        lark = _regex_lark(s.spec)
    else:
        lark = s.spec
    return "answer: %lark {\n" + lark + "\n}\n"


def reasoning_first(s: StructuredOutput, *, opened: bool, think_tokens: bool,
                    budget: int | None = None) -> StructuredOutput:
    """`s` applied to the answer after an optional think block (see the module's docstring). opened: the prompt
    already opened the block (the answer starts inside it). think_tokens: <think> and </think> are single tokens of
    the tokenizer (Qwen3's). budget: at most this many tokens of reasoning (None: unbounded), then only </think>
    fits."""
    if budget is not None:
        if not think_tokens:  # llguidance ends a lazy lexeme at its max_tokens without the tag it waits for
            raise ValueError("thinking_token_budget needs <think> and </think> to be single tokens of the tokenizer "
                             "(as in Qwen3's)")
        # the reasoning is one lexeme with llguidance's max_tokens; an empty block has none (llguidance 1.6 lets
        # max_tokens=0 through)
        body = "think_body </think>" if budget else "</think>"
        rules = f"think_body[max_tokens={budget}]: /(.|\\n)*/\n" if budget else ""
    elif think_tokens:
        body, rules = "/(.|\\n)*/ </think>", ""
    else:
        body, rules = "think_text", "think_text[lazy]: /(.|\\n)*<\\/think>/\n"
    if opened:
        start = f"start: {body} /\\n{{0,2}}/ answer\n"
    else:
        tag = "<think> " if think_tokens else '"<think>" '
        start = f"start: think? answer\nthink: {tag}{body} /\\n{{0,2}}/\n"
    return StructuredOutput.lark(start + rules + _answer_rule(s))


def free_answer(tokenizer) -> StructuredOutput:
    """An answer without a constraint, as a grammar (a thinking budget needs one for the reasoning): any token of the
    tokenizer but <think> and </think>, so that the answer cannot open a second block past the budget. Ids past the
    tokenizer's vocabulary stay out, as in every constraint."""
    tags = [tokenizer.token_to_id(t) for t in THINK_TOKENS] if has_tokens(tokenizer, THINK_TOKENS) else []
    ranges, low = [], 0
    for t in sorted(tags) + [tokenizer.vocab_size]:
        if low < t:
            ranges.append(f"{low}-{t - 1}")
        low = t + 1
    return StructuredOutput.lark("start: <[" + ",".join(ranges) + "]>*\n")


def thinking_budget(value) -> int | None:
    """A thinking_token_budget checked: None (no budget) or an integer >= 0 (0: no thinking)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
        raise ValueError(f"thinking_token_budget must be an integer >= 0 (0: no thinking), got {value!r}")
    return None if value is None else int(value)


def after_reasoning(s: StructuredOutput | None, prompt: str, tokenizer, budget: int | None = None) -> StructuredOutput:
    """`s` for the answer of a chat prompt rendered with thinking on: it applies after the think block (which the
    prompt may already have opened), of at most `budget` tokens. s None: the answer is free (free_answer)."""
    tail = prompt.rstrip()
    opened = tail.endswith(THINK_TOKENS[0]) and not tail.endswith(THINK_TOKENS[1])
    return reasoning_first(s if s is not None else free_answer(tokenizer), opened=opened,
                           think_tokens=has_tokens(tokenizer, THINK_TOKENS), budget=budget)
