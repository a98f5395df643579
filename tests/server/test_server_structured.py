"""Structured output, logit_bias and constrained tool calls through a real `xserv serve` process on the tiny
random-weight model: its logits are noise, so only the constraint can make an answer valid. One server for the
module. Thinking is switched off in chat requests (a noise model that enters a think block rarely leaves it), except
where logit_bias walks it through an empty one. The grammar side of reasoning-first, the request checks and the
400s are in tests/server/test_server_tools.py (in process, scripted engine)."""
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from qwen3_reference import tiny_model_dir  # noqa: E402,F401
from server_process import ServerProcess, http, openai_client, skip_unless_installed, stream_message  # noqa: E402

skip_unless_installed("fastapi", "uvicorn", "openai", "llguidance")

MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK_START, THINK_END = 151667, 151668  # Qwen3's <think> and </think> tokens


def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


# strings bounded (enum, maxLength, pattern): a noise model never closes an unbounded string
SCHEMAS = [
    _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}})}),  # nested object
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}),
    _obj({"x": {"type": "number", "minimum": 0, "maximum": 1},
          "n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": _obj({
    "city": {"enum": ["Oslo", "Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}})}},
         {"type": "function", "function": {"name": "get_time", "parameters": _obj({
             "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}})}}]
MESSAGES = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):  # noqa: F811
    s = ServerProcess(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "512").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):  # noqa: F811
    from xserv.tokenizer import Tokenizer

    return Tokenizer.from_folder(tiny_model_dir)


def test_response_format_json_schema_answers_validate(client):
    for i, schema in enumerate(SCHEMAS):
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, temperature=1.0, seed=i,
                                           max_tokens=120, response_format=rf, extra_body=NO_THINK)
        assert len(r.choices) == 4
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), schema)


def test_openai_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        label: Literal["a", "b"]

    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Point, max_tokens=40,
                                      temperature=1.0, seed=3, extra_body=NO_THINK)
    p = r.choices[0].message.parsed
    assert isinstance(p, Point) and 0 <= p.x <= 9 and p.label in ("a", "b")


def test_json_object_and_streaming_with_a_constraint(client, tokenizer):
    # json_object, completions endpoint: any object; a bias towards "}" lets the noise close its objects
    close = tokenizer.encode("}")[0]
    r = client.completions.create(model=MODEL, prompt="json:", n=3, max_tokens=60, temperature=1.0, seed=5,
                                  extra_body={"response_format": {"type": "json_object"},
                                              "logit_bias": {str(close): 8}})
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text
    # streamed: the deltas join to the whole answer (greedy), which validates
    schema = SCHEMAS[2]
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.0,
                                           response_format=rf, extra_body=NO_THINK).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.0,
                                                 response_format=rf, stream=True, extra_body=NO_THINK))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="re:", max_tokens=20, temperature=1.0, seed=2, stream=True,
        extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"}))
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", text), text


def test_guided_regex_grammar_and_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, max_tokens=20, temperature=1.0, seed=1,
                                       extra_body={"guided_regex": r"[a-c]{3}-[0-9]{2}(\.[xy])?", **NO_THINK})
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}(\.[xy])?", c.message.content) for c in r.choices), r
    lark = 'start: greeting " " NAME end\ngreeting: "hi" | "hello" | "hey"\nNAME: /[A-Z][a-z]{1,4}/\nend: "!" | "."\n'
    r = client.completions.create(model=MODEL, prompt="g:", n=4, max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"guided_grammar": lark})
    assert all(re.fullmatch(r"(hi|hello|hey) [A-Z][a-z]{1,4}[!.]", c.text) for c in r.choices), r
    r = client.completions.create(model=MODEL, prompt="c:", n=4, max_tokens=10, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["yes (1)", "no.", "a|b"]})
    assert all(c.text in ("yes (1)", "no.", "a|b") for c in r.choices), r


def test_logit_bias_forces_and_forbids(client, tokenizer):
    hello = tokenizer.encode(" hello")
    assert len(hello) == 1
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=1.0, seed=0,
                                  logit_bias={str(hello[0]): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " hello" * 5
    # -100 forbids: a choice of "A" or "B" (one token each) never picks the banned one
    a, b = tokenizer.encode("A"), tokenizer.encode("B")
    assert len(a) == len(b) == 1
    free = client.completions.create(model=MODEL, prompt="ab", n=8, max_tokens=3, temperature=1.0, seed=0,
                                     extra_body={"guided_choice": ["A", "B"]})
    assert {c.text for c in free.choices} == {"A", "B"}  # both occur without the bias
    banned = client.completions.create(model=MODEL, prompt="ab", n=8, max_tokens=3, temperature=1.0, seed=0,
                                       logit_bias={str(a[0]): -100}, extra_body={"guided_choice": ["A", "B"]})
    assert {c.text for c in banned.choices} == {"B"}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.0,
                                          logit_bias={str(hello[0]): 100}, extra_body={"ignore_eos": True, **NO_THINK})
    assert chat.choices[0].message.content == " hello" * 4


def test_tool_choice_required_and_named(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in (("required", False), (named, None), ("required", None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, n=3,
                                           temperature=1.0, seed=7, max_tokens=150, extra_body=NO_THINK, **extra)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
            calls = c.message.tool_calls
            assert calls and (len(calls) == 1 or choice == "required" and parallel is None)
            for call in calls:
                assert choice == "required" or call.function.name == "get_time"
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_reasoning_first_on_the_real_model(client):
    """Thinking on: logit_bias walks the noise model through an empty think block (<think> then </think>, each
    +100: unconstrained, it would write <think> forever); the answer after it follows the schema, and the block is
    not content (an empty block: reasoning_content null)."""
    schema = SCHEMAS[2]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=4, n=2, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        logit_bias={str(THINK_START): 100, str(THINK_END): 100})
    for c in r.choices:
        assert [e.token for e in c.logprobs.content[:2]] == ["<think>", "</think>"]
        assert not c.message.reasoning_content and c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)


# a noise model pushed to think forever: <think> first, </think> never of its own accord
THINK_FOREVER = {str(THINK_START): 100, str(THINK_END): -100}


def test_thinking_token_budget_on_the_real_model(client):
    """thinking_token_budget N (sent as the OpenAI client sends extensions, extra_body) on a model that would think
    forever: N reasoning tokens, then the grammar forces </think>, then the answer (a JSON schema's validates; with
    no constraint it is free text that never reopens the block); 0 is no think block at all. Red while the budget is
    ignored: the model thinks until max_tokens (finish_reason length, no answer)."""
    schema = SCHEMAS[2]
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for budget in (1, 5):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=budget,
                                           n=2, logprobs=True, response_format=rf, logit_bias=THINK_FOREVER,
                                           extra_body={"thinking_token_budget": budget})
        for c in r.choices:
            tokens = [e.token for e in c.logprobs.content]
            assert tokens[0] == "<think>" and tokens[budget + 1] == "</think>", tokens[:budget + 2]
            assert "</think>" not in tokens[1:budget + 1] and c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=9, n=2,
                                       logprobs=True, logit_bias=THINK_FOREVER, extra_body={"thinking_token_budget": 4})
    for c in r.choices:
        tokens = [e.token for e in c.logprobs.content]
        assert tokens[0] == "<think>" and tokens[5] == "</think>", tokens[:6]
        assert "<think>" not in tokens[1:] and "</think>" not in tokens[6:] and c.message.content, c
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=0, n=2,
                                       logprobs=True, response_format=rf, logit_bias=THINK_FOREVER,
                                       extra_body={"thinking_token_budget": 0})
    for c in r.choices:
        assert "<think>" not in [e.token for e in c.logprobs.content] and c.finish_reason == "stop"
        assert getattr(c.message, "reasoning_content", None) is None
        jsonschema.validate(json.loads(c.message.content), schema)


def test_max_tokens_spent_while_thinking_on_the_real_model(server):
    """max_tokens runs out inside the think block (the constraint, which binds the answer after </think>, never
    starts): HTTP 200 in strict JSON, finish_reason "length", reasoning_content the thinking so far, content null
    and no tool_calls, whole and streamed; with a JSON schema, tool_choice "required", or a budget larger than
    max_tokens. Red while content is "" (a client that does not know about thinking reads an empty answer)."""
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[2]}}
    for extra in ({"response_format": rf}, {"tools": TOOLS, "tool_choice": "required"},
                  {"response_format": rf, "thinking_token_budget": 50}):
        for stream in (False, True):
            body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2, "logprobs": True,
                    "top_logprobs": 5, "logit_bias": THINK_FOREVER, "stream": stream, **extra}
            out = _strict_body(http().post(server.url + "/v1/chat/completions", json=body, timeout=120))
            if stream:
                finish = [ch["finish_reason"] for c in out for ch in c["choices"] if ch["finish_reason"]]
                messages = [stream_message([{"choices": [ch for ch in c["choices"] if ch["index"] == i]}
                                             for c in out]) for i in range(2)]
            else:
                finish = [c["finish_reason"] for c in out["choices"]]
                messages = [c["message"] for c in out["choices"]]
                assert out["usage"]["completion_tokens"] == 16
            assert finish == ["length", "length"], (extra, stream, out)
            for m in messages:
                assert m["content"] is None and m["reasoning_content"] and "tool_calls" not in m, (extra, stream, m)


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"guided_regex": "a(b"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "guided_json and guided_regex"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
])
def test_bad_specs_are_400s_naming_the_field(server, body, param, needle):
    for path, base in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        r = http().post(server.url + path, json={**base, **body, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and needle in err["message"], (path, err)


def test_bench_serve_with_a_json_schema(server, tmp_path, capsys):
    from xserv.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[2]))
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--url", server.url, "--num-prompts", "4", "--input-len", "4:8", "--output-len",
                 "60", "--json-schema", str(schema_file), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["answers_parsed"] == 4 and result["answers_valid"] == 4
    assert "4 of 4 answers parsed as JSON, 4 valid" in capsys.readouterr().out


def _strict_json(text: str):
    """json.loads that refuses the non-standard constants (NaN, Infinity, -Infinity) Python writes and reads by
    default: RFC 8259 has none of them, and JavaScript's JSON.parse, Go and Rust reject the whole document."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON (RFC 8259)")

    return json.loads(text, parse_constant=refuse)


def _strict_body(r) -> dict | list[dict]:
    """The response body (or every SSE chunk of it) read with the strict parser."""
    assert r.status_code == 200, r.text
    if not r.headers["content-type"].startswith("text/event-stream"):
        return _strict_json(r.text)
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [_strict_json(line) for line in lines[:-1]]


def test_constrained_logprobs_are_strict_json(server):
    """Red when masked tokens' logprobs reach the body: the sampler gives them -inf, which Python's json writes as
    the bare -Infinity. Two tokens are allowed ("A", "B") and 20 top logprobs asked for: the list holds only the
    allowed ones (finite), in chat and completions, whole and streamed."""
    choice = {"guided_choice": ["A", "B"]}
    cases = [("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 20, **NO_THINK}),
             ("/v1/completions", {"prompt": "ab", "logprobs": 20})]
    for path, body in cases:
        for stream in (False, True):
            r = http().post(server.url + path, json={**body, **choice, "max_tokens": 5, "temperature": 1.0, "n": 3,
                                                     "seed": 1, "stream": stream}, timeout=60)
            bodies = _strict_body(r)
            choices = [c for b in (bodies if stream else [bodies]) for c in b["choices"]]
            entries = []
            for c in choices:
                lp = c["logprobs"]
                if lp is None:
                    continue
                if "content" in lp:  # chat
                    entries += [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                                for e in lp["content"]]
                else:
                    entries += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
            assert len(entries) == 3, (path, stream, bodies)  # one token per choice: the grammar is then complete
            for token, logprob, top in entries:
                assert token in ("A", "B") and set(top) <= {"A", "B"} and token in top, (path, stream, top)
                assert -1e4 < logprob <= 0 and all(-1e4 < x <= 0 for x in top.values())


def test_non_finite_logprobs_are_written_as_finite_numbers():
    """Red when a non-finite logprob is written as it is (-Infinity, NaN: not JSON) or a masked top entry is
    listed: the token's own logprob, were it ever -inf or NaN, is written -9999.0 (vLLM's value); top entries
    at -inf (tokens the constraint or a ban masked) are left out."""
    from xserv.server.openai_api import chat_logprobs, completion_logprobs

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)

    inf, nan = float("inf"), float("nan")
    entries = [{"token_id": 1, "logprob": -inf, "top": [(2, -0.5), (1, -inf), (3, -inf)]},
               {"token_id": 4, "logprob": nan, "top": [(4, nan), (5, -inf)]},
               {"token_id": 6, "logprob": -0.25, "top": [(6, -0.25), (7, -1.5)]}]
    chat = _strict_json(json.dumps(chat_logprobs(Tok(), entries, 3)))
    assert [(e["token"], e["logprob"]) for e in chat["content"]] == [("<1>", -9999.0), ("<4>", -9999.0),
                                                                     ("<6>", -0.25)]
    assert [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in chat["content"]] == \
        [[("<2>", -0.5)], [("<4>", -9999.0)], [("<6>", -0.25), ("<7>", -1.5)]]
    comp = _strict_json(json.dumps(completion_logprobs(Tok(), entries, 3, 0)))
    assert comp["token_logprobs"] == [-9999.0, -9999.0, -0.25]
    assert comp["top_logprobs"] == [{"<2>": -0.5}, {"<4>": -9999.0}, {"<6>": -0.25, "<7>": -1.5}]
