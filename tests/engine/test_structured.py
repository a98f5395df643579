"""Structured output (xserv/structured.py) and logit_bias, end to end on the tiny random-weight model: its logits are
noise, so only the constraint can make an answer valid. The op-level mask and bias (reference and kernel) are in
tests/ops/test_sampling_op.py.

Answers per schema: XSERV_STRUCTURED_ANSWERS (default 2 on the CPU; the GPU test takes 200 unless set)."""
import dataclasses
import json
import os
import re

import numpy as np
import pytest

from xserv.sampling import SamplingParams
from xserv.structured import StructuredOutput

from batch_shape import assert_same_runs
from qwen3_reference import tiny_model_dir  # noqa: F401

jsonschema = pytest.importorskip("jsonschema")


def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


_PT = _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 0}})
# Strings are bounded (maxLength, enum, pattern): a noise model never closes an unbounded string.
SCHEMAS = [
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "name": {"type": "string", "maxLength": 6}})}),
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}),
    _obj({"x": {"type": "number", "minimum": 0, "maximum": 1},
          "n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    _obj({"a": {"type": "boolean"}, "b": {"type": "null"}, "c": {"type": "integer", "minimum": 0, "maximum": 3}},
         required=["a"]),
    {"$defs": {"pt": _PT}, **_obj({"a": {"$ref": "#/$defs/pt"},
                                   "b": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}})},
    _obj({"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "minItems": 1,
                   "maxItems": 3},
          "ok": {"type": "boolean"}}),
    _obj({"inner": _obj({"deeper": _obj({"v": {"enum": ["a", "b", None, 7]}})}), "k": {"const": "fixed"}}),
    {"anyOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 5}}),
               _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 5}})]},
    _obj({"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1},
                               "minItems": 2, "maxItems": 2}}}),
]
# Ten more: the same shapes with other bounds and enums (the GPU run's 20 schemas).
SCHEMAS += [
    _obj({"id": {"type": "integer", "minimum": 100, "maximum": 120}, "code": {"type": "string", "pattern": "^[A-F]{2}$"}}),
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 3, "maxItems": 3},
    _obj({"p": {"type": "number", "minimum": -2.5, "maximum": 2.5}, "q": {"type": "boolean"}}, required=["q"]),
    {"$defs": {"c": {"enum": ["lo", "hi"]}}, **_obj({"a": {"$ref": "#/$defs/c"}, "b": {"$ref": "#/$defs/c"}})},
    _obj({"list": {"type": "array", "items": _PT, "minItems": 1, "maxItems": 2}}),
    _obj({"name": {"type": "string", "minLength": 1, "maxLength": 3}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 150}}),
    _obj({"flag": {"type": "boolean"}, "opt": {"type": "integer", "minimum": 5, "maximum": 6}}, required=[]),
    {"type": "array", "items": _obj({"k": {"enum": [0, 1]}}), "minItems": 0, "maxItems": 2},
    _obj({"v": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
]
REGEX = r"[a-c]{3}-[0-9]{2}(\.[xy])?"
LARK = """start: greeting " " name end
greeting: "hi" | "hello" | "hey"
name: /[A-Z][a-z]{1,4}/
end: "!" | "." | "?"
"""
LARK_LANGUAGE = r"(hi|hello|hey) [A-Z][a-z]{1,4}[!.?]"  # the same language, to check answers


def _answers(default):
    return int(os.environ.get("XSERV_STRUCTURED_ANSWERS", default))


def _run_mixed(llm, constrained, answers, temperature, max_tokens):
    """Each constrained params `answers` times, batched with four unconstrained seeded requests; checks the plain
    ones against their runs alone. Returns the constrained outputs, grouped per params."""
    plain = [SamplingParams(temperature=t, seed=50 + i, max_tokens=12) for i, t in enumerate((1.0, 0.0, 0.7, 1.0))]
    plain_prompts = ["plain one", "plain two", "a third", "and four"]
    alone = llm.generate(plain_prompts, plain)
    prompts, params = [], []
    for j, p in enumerate(constrained):
        for a in range(answers):
            prompts.append(f"answer {j} {a}")
            seed = None if temperature == 0 else 1000 * j + a
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured=p))
    outs = llm.generate(plain_prompts + prompts, plain + params)
    # unconstrained rows untouched by their neighbours, up to the rounding a batch shape may move (batch_shape.py)
    assert_same_runs(outs[:len(plain)], alone, plain, llm)
    rest = outs[len(plain):]
    return [rest[j * answers:(j + 1) * answers] for j in range(len(constrained))]


def _check_json(groups, schemas):
    for schema, outs in zip(schemas, groups):
        for o in outs:
            assert o.finish_reason == "stop", (schema, o.text)
            jsonschema.validate(json.loads(o.text), schema)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):  # noqa: F811
    from xserv.llm import LLM

    m = LLM(str(tiny_model_dir), device="cpu", max_model_len=512, progress=False, max_num_seqs=64)
    yield m
    m.close()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_json_schemas_validate(llm, temperature):
    schemas = SCHEMAS[:10] if temperature else SCHEMAS[10:]
    groups = _run_mixed(llm, [StructuredOutput.json_schema(s) for s in schemas], _answers(2 if temperature else 1),
                        temperature, max_tokens=120)
    _check_json(groups, schemas)


def test_regex_and_lark(llm):
    n = _answers(3)
    groups = _run_mixed(llm, [StructuredOutput.regex(REGEX), StructuredOutput.lark(LARK)], n, 1.0, max_tokens=80)
    for o in groups[0]:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    for o in groups[1]:
        assert o.finish_reason == "stop" and re.fullmatch(LARK_LANGUAGE, o.text), o.text
    greedy = _run_mixed(llm, [StructuredOutput.regex(REGEX)], 1, 0.0, max_tokens=40)[0][0]
    assert re.fullmatch(REGEX, greedy.text)


DATE = r"\d{4}-\d{2}-\d{2}"


def test_regex_digits_are_ascii(llm):
    """`\\d` in a regex constraint is [0-9], as in vLLM's and SGLang's regexes and xserv's own JSON-schema `pattern`:
    red while a regex reaches llguidance with Rust's Unicode classes (a noise model then writes dates like
    `߂４𑱗1-໒` from the thousands of Unicode digits in the vocabulary)."""
    n = _answers(8)
    params = [SamplingParams(temperature=1.0, seed=300 + i, max_tokens=40, structured=StructuredOutput.regex(DATE))
              for i in range(n)]
    outs = llm.generate([f"date {i}" for i in range(n)], params)
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", o.text), o.text


@pytest.fixture(scope="module")
def accepts(llm):
    """accepts(structured, text): the text's tokens fit the constraint and complete it."""
    from xserv.structured import GrammarConstraint, grammar_tokenizer

    llt = grammar_tokenizer(llm.tokenizer, llm.engine.eos_token_ids, llm.engine.vocab_size)

    def check(structured, text):
        c = GrammarConstraint(llt, structured)
        return all(c.consume(t) for t in llm.tokenizer.encode(text)) and c.accepting
    return check


@pytest.mark.parametrize("pattern, good, bad", [
    (r"\d", ["7"], ["٣", "４", "x"]),
    (r"\\d", ["\\d"], ["7", "\\7"]),  # an escaped backslash, then a literal d
    (r"\\\d", ["\\7"], ["\\d", "\\٣"]),  # an escaped backslash, then a digit
    (r"[\d]", ["7"], ["٣"]),
    (r"[^\d]", ["٣", "x"], ["7"]),
    (r"\D", ["٣", "x"], ["7"]),
    (r"[a\D]", ["a", "٣"], ["7"]),
    (r"[\d.]+", ["1.5"], ["١.٥"]),
    (r"\w+", ["ab_9"], ["é", "ab٣"]),
    (r"\W", ["é", "-"], ["a", "_"]),
    (r"a\sb", ["a b", "a\tb"], ["a\u00a0b", "a\u3000b"]),
    (r"\S", ["\u00a0", "x"], [" "]),
    (r"[\\d]", ["\\", "d"], ["7"]),  # a class of a backslash and d: no digit
    (r"a/b\d", ["a/b1"], ["a/b٣"]),  # a slash survives the translation
    (r"\p{Nd}", ["٣", "7"], ["x"]),  # a Unicode class asked for by name stays Unicode
])
def test_regex_classes_are_ascii(accepts, pattern, good, bad):
    """\\d, \\w, \\s and their negations mean ASCII classes, inside and outside brackets, while escaped backslashes
    and named Unicode classes keep their meaning: red while the regex reaches llguidance untranslated (Unicode
    classes) or a translation that rewrites `\\\\d` or misses `[\\d]`, `[^\\d]`, `\\D`."""
    s = StructuredOutput.regex(pattern)
    for text in good:
        assert accepts(s, text), (pattern, text)
    for text in bad:
        assert not accepts(s, text), (pattern, text)


def test_every_end_of_sequence_token_ends_an_accepted_answer(llm):
    """Each of the model's end-of-sequence ids is allowed exactly where the grammar accepts: red when only the one id
    given to llguidance gets the bit (llguidance before 1.7 takes a single eos token)."""
    from xserv.structured import GrammarConstraint, fill_masks, grammar_tokenizer, mask_words

    eos = [151645, 151643]  # Qwen3's <|im_end|> and <|endoftext|>
    llt = grammar_tokenizer(llm.tokenizer, eos, llm.engine.vocab_size)
    words = mask_words(llm.engine.vocab_size)

    def allowed(row):
        bits = row.view(np.uint32)
        return [bool((bits[t // 32] >> (t % 32)) & 1) for t in eos]

    cs = [GrammarConstraint(llt, StructuredOutput.regex("ab?")) for _ in range(3)]
    row = np.zeros(words, np.int32)
    cs[0].fill(row)
    assert allowed(row) == [False, False]
    assert cs[1].consume(llm.tokenizer.encode("a")[0]) and cs[2].consume(llm.tokenizer.encode("a")[0])
    assert cs[2].consume(llm.tokenizer.encode("b")[0]) and cs[2].done  # complete: nothing but eos follows
    cs[1].fill(row)
    assert allowed(row) == [True, True]
    masks = np.zeros((4, words), np.int32)
    fill_masks(cs, masks)
    assert [allowed(r) for r in masks[:3]] == [[False, False], [True, True], [True, True]]
    assert list(np.flatnonzero(np.unpackbits(masks[2].view(np.uint8), bitorder="little"))) == sorted(eos)


def test_stream_and_logprobs_with_a_constraint(llm):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=40, logprobs=2, structured=StructuredOutput.regex(REGEX))
    out = llm.generate(["q"], p)[0]
    assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop"
    # the log-probs are of the masked distribution: every top token is an allowed one (finite), the sampled
    # token's log-prob is at most 0 and the top-N are sorted
    for lp in out.logprobs:
        assert lp["logprob"] <= 0 and np.isfinite(lp["logprob"])
        vals = [v for _, v in lp["top"]]
        assert vals == sorted(vals, reverse=True)
    assert "".join(llm.stream("q", p)) == out.text


def test_grammar_end_allows_eos_only_when_accepting(llm):
    """`a+b?`: after each `a` the grammar accepts, so EOS is allowed and a noise model ends somewhere; it never
    ends before the first `a` (EOS not allowed there) and never emits anything but the pattern."""
    eos = sorted(llm.engine.eos_token_ids)[0]
    # a strong push towards EOS: it still cannot come before the grammar accepts
    p = SamplingParams(temperature=1.0, max_tokens=30, logit_bias={eos: 30.0}, structured=StructuredOutput.regex("a+b?"))
    outs = llm.generate([f"p{i}" for i in range(6)], [dataclasses.replace(p, seed=i) for i in range(6)])
    for o in outs:
        assert re.fullmatch("a+b?", o.text), o.text
        assert o.finish_reason == "stop"
        assert o.token_ids[-1] in llm.engine.eos_token_ids or o.text.endswith("b")


def test_logit_bias_forces_and_forbids(llm):
    target = llm.tokenizer.encode(" hello")[0]
    for t in (0.0, 1.0):
        out = llm.generate(["x"], SamplingParams(temperature=t, seed=1, max_tokens=6, logit_bias={target: 100}))[0]
        assert out.token_ids == [target] * 6
    free = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    banned = {t: -100 for t in set(free)}
    out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=banned))[0]
    assert not set(out.token_ids) & set(free)
    sampled = llm.generate(["x"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=8, logit_bias=banned)
                                       for s in range(4)])
    assert all(not set(o.token_ids) & set(free) for o in sampled)


def test_bad_constraints_and_biases_are_value_errors(llm):
    with pytest.raises(ValueError, match="regex"):
        StructuredOutput.regex("a(b")
    with pytest.raises(ValueError, match="Invalid type"):
        StructuredOutput.json_schema({"type": "nope"})
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput.json_schema("{")
    with pytest.raises(ValueError, match="grammar"):
        StructuredOutput.lark("start: undefined_rule")
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "x")
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured={"type": "json_object"})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={5: float("inf")})
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(logit_bias={-3: 1})
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # JSON keys are strings
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={llm.engine.vocab_size: 1.0}))
    s = StructuredOutput.json_schema({"type": "object"})
    assert s == StructuredOutput.json_schema('{"type": "object"}') and hash(s) == hash(SamplingParams(structured=s).structured)


def test_json_object(llm):
    """Any JSON object: the first character is `{` and every prefix parses as the start of one."""
    out = llm.generate(["j"], SamplingParams(temperature=0.0, max_tokens=10,
                                             structured=StructuredOutput.json_object()))[0]
    assert out.text.startswith("{")


def test_chat_thinking_token_budget(llm):
    """LLM.chat(thinking_token_budget=N) on a model pushed to think forever (<think> +100, </think> -100): N
    reasoning tokens, then </think> (forced by the grammar), then the answer (a schema's validates; with no
    constraint, free text that never reopens the block); 0 is thinking off. Red while chat ignores the budget (the
    model thinks until max_tokens)."""
    think, end = (llm.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    schema = _obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}})
    messages = [{"role": "user", "content": "A digit?"}]
    forever = {think: 100.0, end: -100.0}
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, structured=StructuredOutput.json_schema(schema),
                            logit_bias=forever)
    out = llm.chat(messages, params, thinking_token_budget=3)[0]
    ids = out.token_ids
    assert ids[0] == think and ids[4] == end and end not in ids[1:4] and out.finish_reason == "stop", ids
    jsonschema.validate(json.loads(llm.tokenizer.decode(ids[5:], skip_special_tokens=True)), schema)
    free = llm.chat(messages, SamplingParams(temperature=1.0, max_tokens=12, seed=1, logit_bias=forever),
                    thinking_token_budget=2)[0].token_ids
    assert free[0] == think and free[3] == end and think not in free[1:] and end not in free[4:], free
    off = llm.chat(messages, params, thinking_token_budget=0)[0]
    assert think not in off.token_ids and off.finish_reason == "stop"
    jsonschema.validate(json.loads(off.text), schema)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            llm.chat(messages, params, thinking_token_budget=bad)


@pytest.mark.gpu
def test_structured_on_gpu(tiny_model_dir):  # noqa: F811
    """The whole check on the GPU: 20 schemas x XSERV_STRUCTURED_ANSWERS (200) answers at temperature 1 and 0,
    regex and Lark, batched with unconstrained requests that stay byte-identical; decode steps launched ahead
    with constrained rows (the masks computed after the previous step is booked)."""
    from xserv.llm import LLM

    llm = LLM(str(tiny_model_dir), device="cuda", max_model_len=512, kv_cache_tokens=1 << 17, progress=False,
              max_num_seqs=256)
    try:
        n = _answers(200)
        for t in (1.0, 0.0):
            groups = _run_mixed(llm, [StructuredOutput.json_schema(s) for s in SCHEMAS], n if t else max(1, n // 20),
                                t, max_tokens=160)
            _check_json(groups, SCHEMAS)
        groups = _run_mixed(llm, [StructuredOutput.regex(REGEX), StructuredOutput.lark(LARK)], n, 1.0, max_tokens=80)
        assert all(re.fullmatch(REGEX, o.text) for o in groups[0])
        assert all(re.fullmatch(LARK_LANGUAGE, o.text) for o in groups[1])
        assert llm.engine.num_steps_ahead > 0
        s = llm.engine.sampler
        print(f"host mask time: {s.mask_seconds / max(1, s.mask_rows) * 1e6:.1f} us per row, {s.mask_rows} rows")
    finally:
        llm.close()
