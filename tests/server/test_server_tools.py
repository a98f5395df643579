"""Tool calls, reasoning content and the 400s for fields xserv does not implement, in /v1/chat/completions and
/v1/completions: the FastAPI app in process (httpx's ASGI transport) with the real Qwen3 tokenizer and chat template,
in front of a scripted engine that answers every request with text the test writes down, in pieces the test chooses
(so that a tag can be split at every place). The engine also records the prompt text the template rendered."""
import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from server_process import ROOT, stream_message  # noqa: E402

TOKENIZER = ROOT.parent / "shared" / "qwen3-tokenizer"
if not (TOKENIZER / "tokenizer.json").is_file():
    from xserv.models.config import presets_dir

    TOKENIZER = presets_dir() / "tokenizer"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}
CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": oops}\n</tool_call>'
THINK = "<think>\nThe user wants the weather.\n</think>\n\n"


class ScriptedEngine:
    """Stands in for AsyncEngine: each request's choices get `answer` in `pieces`-character updates (1: a character at a
    time), then finish with `finish_reason`. `prompts` collects the prompt texts."""

    def __init__(self):
        self.answer, self.pieces, self.finish_reason = "", 1000, "stop"
        self.prompts: list[str] = []
        self.params: list = []  # each request's SamplingParams (one per choice)
        self.num_in_flight = 0
        self.error = None
        self.running = True

    def stats(self):
        return {}

    async def generate(self, prompt_ids, params, prompt_text=None):
        from xserv.server.async_engine import Update

        self.prompts.append(prompt_text)
        self.params.append(params)
        text, k = self.answer, self.pieces
        chunks = [text[i:i + k] for i in range(0, len(text), k)] or [""]
        for j, piece in enumerate(chunks):
            last = j == len(chunks) - 1
            lp = [{"token_id": 9, "logprob": -0.5, "top": []}] * len(piece)  # one "token" per character
            yield [Update(i, piece, j + 1, lp if params[i].logprobs is not None else None,
                          self.finish_reason if last else None) for i in range(len(params))]


@pytest.fixture(scope="module")
def app():
    from xserv.server.app import create_app
    from xserv.server.openai_api import ServerContext
    from xserv.tokenizer import Tokenizer

    engine = ScriptedEngine()
    ctx = ServerContext(engine=engine, tokenizer=Tokenizer.from_folder(TOKENIZER), model_name="m",
                        max_model_len=4096, vocab_size=151936, max_in_flight=64)
    a = create_app(ctx)
    a.engine = engine
    return a


def post(app, path, body, answer=None, pieces=1000, finish="stop"):
    """(status, json body or list of SSE chunks) of one request."""
    if answer is not None:
        app.engine.answer, app.engine.pieces, app.engine.finish_reason = answer, pieces, finish

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            r = await c.post(path, json=body)
            if not body.get("stream") or r.status_code != 200:
                return r.status_code, r.json()
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            return r.status_code, [json.loads(ln) for ln in lines[:-1]]

    return asyncio.run(asyncio.wait_for(go(), 30))


def chat(app, answer, stream=False, pieces=1000, finish="stop", **body):
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "stream": stream, **body}
    status, out = post(app, "/v1/chat/completions", body, answer, pieces, finish)
    assert status == 200, out
    return out


def joined(chunks):
    """(reasoning, content, {call index: (id, name, arguments joined)}, finish_reason, chunks in order) of a stream."""
    reasoning, content, calls, finish, order = "", "", {}, None, []
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["name"]
                    calls[tc["index"]] = [tc["id"], tc["function"]["name"], tc["function"].get("arguments", "")]
                    order.append(("name", tc["index"]))
                else:
                    calls[tc["index"]][2] += tc["function"]["arguments"]  # a KeyError: arguments before the name
                    order.append(("arguments", tc["index"]))
            finish = ch["finish_reason"] or finish
    return reasoning, content, {k: tuple(v) for k, v in calls.items()}, finish, order


def test_tool_calls_parsed_whole_and_streamed_at_every_split(app):
    answer = "Checking.\n" + CALL_1 + "\n" + CALL_2
    whole = chat(app, answer, tools=[WEATHER, TIME])["choices"][0]
    msg = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and msg["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("function", "get_weather", {"city": "Oslo"}), ("function", "get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    for pieces in (1, 2, 5, 11):  # every split of the tags across updates
        _, content, calls, finish, order = joined(chat(app, answer, stream=True, pieces=pieces, tools=[WEATHER, TIME]))
        assert content == "Checking." and "<" not in content and finish == "tool_calls"
        assert [(name, json.loads(args)) for _, name, args in calls.values()] == \
            [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
        assert order == [("name", 0), ("arguments", 0), ("name", 1), ("arguments", 1)]


def test_parallel_tool_calls_false_keeps_the_first_call(app):
    answer = CALL_1 + "\n" + CALL_2
    msg = chat(app, answer, tools=[WEATHER, TIME], parallel_tool_calls=False)["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] and msg["content"] is None
    _, content, calls, finish, _ = joined(chat(app, answer, stream=True, pieces=4, tools=[WEATHER, TIME],
                                                parallel_tool_calls=False))
    assert [name for _, name, _ in calls.values()] == ["get_weather"] and content == "" and finish == "tool_calls"


@pytest.mark.parametrize("answer, content, names, finish", [
    (BAD, BAD, [], "stop"),  # bad JSON inside the block
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', [], "stop"),  # no name
    (CALL_1 + "\n" + BAD, BAD, ["get_weather"], "tool_calls"),  # the good call stays a call
    ("Sure.\n" + CALL_1[:30], "Sure.\n" + CALL_1[:30], [], "length"),  # cut off inside the block
    ("a <tool_ b", "a <tool_ b", [], "stop"),  # looked like a tag for a while
])
def test_malformed_tool_output_is_content(app, answer, content, names, finish):
    reason = "length" if finish == "length" else "stop"
    whole = chat(app, answer, finish=reason, tools=[WEATHER])["choices"][0]
    assert whole["message"]["content"] == content and whole["finish_reason"] == finish
    assert [c["function"]["name"] for c in whole["message"].get("tool_calls", [])] == names
    _, streamed, calls, sfinish, _ = joined(chat(app, answer, stream=True, pieces=3, finish=reason, tools=[WEATHER]))
    assert streamed == content and [n for _, n, _ in calls.values()] == names and sfinish == finish


def test_tool_choice_none_and_no_tools_leave_the_text_alone(app):
    answer = "Checking.\n" + CALL_1
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        msg = chat(app, answer, **body)["choices"][0]["message"]
        assert msg["content"] == answer and "tool_calls" not in msg
    assert "<tools>" in app.engine.prompts[-2] and "<tools>" not in app.engine.prompts[-1]  # none: still rendered


def test_reasoning_split_whole_and_streamed(app):
    answer = THINK + "It is sunny."
    msg = chat(app, answer)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is sunny.",
                   "reasoning_content": "\nThe user wants the weather.\n"}
    for pieces in (1, 2, 3, 7):
        reasoning, content, _, _, _ = joined(chat(app, answer, stream=True, pieces=pieces))
        assert (reasoning, content) == ("\nThe user wants the weather.\n", "It is sunny.")
    # thinking and a tool call in one answer
    reasoning, content, calls, finish, _ = joined(chat(app, THINK + CALL_1, stream=True, pieces=2, tools=[WEATHER]))
    assert reasoning == "\nThe user wants the weather.\n" and content == "" and finish == "tool_calls"
    assert [n for _, n, _ in calls.values()] == ["get_weather"]


@pytest.mark.parametrize("constraint", [{}, {"response_format": {"type": "json_object"}},
                                        {"tools": [WEATHER], "tool_choice": "required"}])
def test_max_tokens_spent_while_thinking_is_length_with_content_null(app, constraint):
    """An answer cut off inside its think block (max_tokens spent before </think>; a constraint applies only after
    it) is HTTP 200, finish_reason "length", reasoning_content the thinking so far and content null: red while it
    reports content "" (an empty answer to a client that does not know about the think block), whole or streamed
    (the stream's opening delta gave content "")."""
    cut = "<think>\nHmm, let me</thi"  # a tag's start held back, then the end: it is reasoning
    whole = chat(app, cut, finish="length", **constraint)["choices"][0]
    assert whole["finish_reason"] == "length"
    assert whole["message"] == {"role": "assistant", "content": None, "reasoning_content": "\nHmm, let me</thi"}
    for pieces in (1, 4, 100):
        chunks = chat(app, cut, stream=True, pieces=pieces, finish="length", **constraint)
        assert stream_message(chunks) == {"role": "assistant", "content": None,
                                          "reasoning_content": "\nHmm, let me</thi"}
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    # an answer after the block is content as before, streamed too (the opening null joins the content deltas)
    for stream in (False, True):
        out = chat(app, THINK + "{}", stream=stream, pieces=2, finish="length", **constraint)
        msg = stream_message(out) if stream else out["choices"][0]["message"]
        assert msg["content"] == "{}" and msg["reasoning_content"] == "\nThe user wants the weather.\n"


def test_thinking_off_is_all_content(app):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = chat(app, "<think>x</think>y", **off)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "<think>x</think>y"}  # no split, no reasoning_content key
    assert app.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")


def test_streamed_logprobs_of_held_back_text_go_out_with_it(app):
    answer = THINK + "Yes."
    chunks = chat(app, answer, stream=True, pieces=1, logprobs=True)
    n = sum(len(ch["logprobs"]["content"]) for c in chunks[1:] for ch in c["choices"])
    assert n == len(answer)  # one entry per "token" (character), none lost while the tags were held back
    assert all(ch["delta"] or ch["finish_reason"] for c in chunks[1:] for ch in c["choices"])  # no empty chunk


def test_tool_history_is_rendered_through_the_template(app):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "reasoning_content": "Need a tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = chat(app, "It is 21 degrees.", tools=[WEATHER], messages=messages)
    assert out["choices"][0]["message"]["content"] == "It is 21 degrees."
    prompt = app.engine.prompts[-1]
    assert ('<|im_start|>assistant\n<think>\nNeed a tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_openai_client_tool_loop(app):
    openai = pytest.importorskip("openai")

    async def go():
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http_client, max_retries=0)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        app.engine.answer, app.engine.pieces, app.engine.finish_reason = THINK + CALL_1, 3, "stop"
        r = await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        # the streamed second turn, with the SDK's own stream accumulation
        app.engine.answer = "It is 21 C."
        async with client.beta.chat.completions.stream(model="m", messages=messages, tools=[WEATHER]) as s:
            final = await s.get_final_completion()
        assert final.choices[0].message.content == "It is 21 C." and final.choices[0].finish_reason == "stop"
        assert "<tool_response>\n21 C\n</tool_response>" in app.engine.prompts[-1]
        # a streamed tool call, accumulated by the SDK
        app.engine.answer, app.engine.pieces = CALL_1 + "\n" + CALL_2, 2
        async with client.beta.chat.completions.stream(model="m", messages=messages[:1], tools=[WEATHER, TIME]) as s:
            final = await s.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
        await http_client.aclose()

    asyncio.run(asyncio.wait_for(go(), 30))


UNSUPPORTED_CHAT = [("echo", True), ("functions", [{"name": "f"}]), ("function_call", "auto"),
                    ("guided_whitespace_pattern", " *"),
                    ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]), ("prediction", {"type": "content"}),
                    ("web_search_options", {}), ("reasoning_effort", "low"), ("use_beam_search", True),
                    ("min_tokens", 3), ("best_of", 2)]
UNSUPPORTED_COMPLETION = [("echo", True), ("best_of", 3), ("suffix", "end"), ("guided_whitespace_pattern", " *")]


@pytest.mark.parametrize("field, value", UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_refused_by_name(app, field, value):
    status, out = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], field: value})
    assert status == 400 and out["error"]["param"] == field and field in out["error"]["message"], out


@pytest.mark.parametrize("field, value", UNSUPPORTED_COMPLETION)
def test_unsupported_completion_fields_are_refused_by_name(app, field, value):
    status, out = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert status == 400 and out["error"]["param"] == field and field in out["error"]["message"], out


def test_harmless_values_and_platform_fields_pass(app):
    ok = {"echo": False, "logit_bias": {}, "response_format": {"type": "text"}, "modalities": ["text"],
          "user": "u1", "metadata": {"a": "b"}, "store": False, "n": 2, "best_of": 2, "parallel_tool_calls": True}
    assert chat(app, "hi", **ok)["choices"][1]["message"]["content"] == "hi"
    status, out = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "suffix": None, "echo": False,
                                                "best_of": 1}, "ok")
    assert status == 200 and out["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice 'required' and response_format both constrain"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}],
      "tool_choice": "required"}, "tools", "do not compile"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", ""),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice", ""),
])
def test_tool_choice_errors(app, body, param, needle):
    status, out = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400 and out["error"]["param"] == param and needle in out["error"]["message"], out


def test_tool_call_constraint_schema():
    from xserv.server.protocol import NamedToolChoice, Tool
    from xserv.server.tools import tool_call_constraint

    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    assert tool_call_constraint(tools, "auto") is None and tool_call_constraint(tools, None) is None
    required = tool_call_constraint(tools, "required")
    names = [s["properties"]["name"]["const"] for s in required["json_schema"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert required["json_schema"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert 'call: <tool_call> "\\n" json_call "\\n" </tool_call>' in required["grammar"]
    assert "call)*" in required["grammar"]
    text = tool_call_constraint(tools, "required", tag_tokens=False)["grammar"]
    assert 'call: "<tool_call>" "\\n" json_call "\\n" "</tool_call>"' in text
    named = tool_call_constraint(tools, NamedToolChoice.model_validate({"type": "function",
                                                                        "function": {"name": "get_time"}}))
    assert named["json_schema"]["properties"]["name"] == {"const": "get_time"}
    assert named["grammar"].startswith("start: call\n")


# ---- reasoning first, then the constraint ---------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def matcher():
    """accepts(structured, text): the text's tokens (the Qwen3 tokenizer: <think> and </think> one token each) fit the
    constraint and complete it."""
    from xserv.structured import GrammarConstraint, grammar_tokenizer
    from xserv.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(TOKENIZER)
    llt = grammar_tokenizer(tok, [151645, 151643], 151936)

    def accepts(structured, text):
        c = GrammarConstraint(llt, structured)
        return all(c.consume(t) for t in tok.encode(text)) and c.accepting
    return accepts


def last_constraint(app):
    return app.engine.params[-1][0].structured


def test_the_constraint_follows_the_reasoning(app, matcher):
    from xserv.structured import StructuredOutput

    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    msg = chat(app, THINK + '{"a":1}', response_format=rf)["choices"][0]["message"]
    assert msg["reasoning_content"] == "\nThe user wants the weather.\n" and msg["content"] == '{"a":1}'
    s = last_constraint(app)
    assert s.kind == "grammar" and s.spec.startswith("start: think? answer\n")
    assert matcher(s, THINK + '{"a":1}')  # the reasoning is free text, the answer follows the schema
    assert matcher(s, '<think>\n{ not json: "}" \n</think>\n\n{"a":12}')
    assert matcher(s, '{"a":1}')  # no think block at all
    assert not matcher(s, THINK + "It is sunny.") and not matcher(s, THINK + '{"a":"x"}')
    assert not matcher(s, "It is sunny.")
    # thinking off and the completions endpoint: the constraint alone
    chat(app, '{"a":1}', response_format=rf, chat_template_kwargs={"enable_thinking": False})
    assert last_constraint(app) == StructuredOutput.json_schema(SCHEMA)
    status, _ = post(app, "/v1/completions", {"prompt": "x", "response_format": rf}, '{"a":1}')
    assert status == 200 and last_constraint(app) == StructuredOutput.json_schema(SCHEMA)


@pytest.mark.parametrize("body, good, bad", [
    ({"response_format": {"type": "json_object"}}, '{"k":[1]}', "[1]"),
    ({"guided_regex": r"[a-c]{3}/\}"}, "abc/}", "abcd"),
    ({"guided_grammar": 'start: "hi " NAME\nNAME: /[A-Z][a-z]+/\n'}, "hi Bob", "hi bob"),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, "no", "maybe"),  # GBNF, converted
    ({"guided_choice": ["a.b", "c|d", "(e)"]}, "c|d", "a"),
    ({"structured_outputs": {"choice": ["x y", "z"]}}, "x y", "x"),
])
def test_every_kind_follows_the_reasoning(app, matcher, body, good, bad):
    chat(app, "ok", **body)
    s = last_constraint(app)
    assert s.spec.startswith("start: think? answer\n")
    assert matcher(s, THINK + good) and matcher(s, good)
    assert not matcher(s, THINK + bad)
    chat(app, "ok", chat_template_kwargs={"enable_thinking": False}, **body)
    off = last_constraint(app)
    assert matcher(off, good) and not matcher(off, bad) and not matcher(off, THINK + good)


def test_required_tool_call_follows_the_reasoning(app, matcher):
    named = {"type": "function", "function": {"name": "get_weather"}}
    msg = chat(app, THINK + CALL_1, tools=[WEATHER, TIME], tool_choice="required")["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    s = last_constraint(app)
    assert matcher(s, THINK + CALL_1 + "\n" + CALL_2) and matcher(s, CALL_1)
    assert not matcher(s, THINK + "Sure.") and not matcher(s, THINK + CALL_1.replace('"Oslo"', "1"))
    chat(app, CALL_1, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    s = last_constraint(app)
    assert matcher(s, THINK + CALL_1) and not matcher(s, THINK + CALL_1 + "\n" + CALL_2)
    chat(app, CALL_2, tools=[WEATHER, TIME], tool_choice=named, chat_template_kwargs={"enable_thinking": False})
    s = last_constraint(app)
    assert matcher(s, CALL_1) and not matcher(s, CALL_2) and not matcher(s, THINK + CALL_1)


def test_reasoning_first_opened_block_and_text_tags(matcher):
    from xserv.server.constraints import reasoning_first
    from xserv.structured import StructuredOutput

    s = StructuredOutput.regex("[0-9]+")
    opened = reasoning_first(s, opened=True, think_tokens=True)  # the prompt ends with <think>\n
    assert matcher(opened, "\nhmm\n</think>\n\n42") and not matcher(opened, "<think>\nhmm\n</think>\n\n42")
    assert not matcher(opened, "42")
    text = reasoning_first(s, opened=False, think_tokens=False)  # <think> spelled in text tokens
    from xserv.structured import GrammarConstraint, grammar_tokenizer
    from xserv.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(TOKENIZER)
    c = GrammarConstraint(grammar_tokenizer(tok, [151645], 151936), text)
    ids = [27, 26865, 29] + tok.encode("\nhmm 7\n") + [522, 26865, 29] + tok.encode("\n\n42")  # <think> ... </think>
    assert all(c.consume(t) for t in ids) and c.accepting


# ---- a thinking budget -----------------------------------------------------------------------------------------------
def thought(n: int) -> str:
    """A think block of exactly n reasoning tokens (" a" is one token of Qwen3's), then the answer's newlines."""
    return "<think>" + " a" * n + "</think>\n\n"


def test_thinking_token_budget_bounds_the_reasoning(app, matcher):
    """thinking_token_budget N: at most N tokens between <think> and </think>, then the answer (its constraint, or
    any text without a constraint, or the tool call of tool_choice "required"). Red while the budget is ignored (the
    grammar lets the think block run past N, or a request without a constraint gets none)."""
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    msg = chat(app, thought(3) + '{"a":1}', response_format=rf, thinking_token_budget=3)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": '{"a":1}', "reasoning_content": " a a a"}
    s = last_constraint(app)
    assert matcher(s, thought(3) + '{"a":1}') and matcher(s, thought(0) + '{"a":1}') and matcher(s, '{"a":1}')
    assert not matcher(s, thought(4) + '{"a":1}') and not matcher(s, thought(2) + "It is sunny.")
    # no constraint: the answer is free (tool tags included) but cannot open a second, unbounded block
    chat(app, thought(3) + "Sunny.", thinking_token_budget=3)
    s = last_constraint(app)
    assert s is not None and matcher(s, thought(3) + "It is sunny. " + CALL_1) and matcher(s, "Sunny.")
    assert not matcher(s, thought(4) + "Sunny.") and not matcher(s, thought(1) + "Sunny. " + thought(5))
    # tool_choice "required"
    chat(app, thought(2) + CALL_1, tools=[WEATHER], tool_choice="required", thinking_token_budget=2)
    s = last_constraint(app)
    assert matcher(s, thought(2) + CALL_1) and not matcher(s, thought(3) + CALL_1)
    # thinking off: nothing to bound, the request's constraint alone
    chat(app, "Sunny.", thinking_token_budget=3, chat_template_kwargs={"enable_thinking": False})
    assert last_constraint(app) is None


def test_thinking_token_budget_0_is_thinking_off(app):
    """thinking_token_budget 0 renders the prompt as enable_thinking false does (the template's empty think block,
    the model's own form for no thinking): red while 0 leaves thinking on."""
    from xserv.structured import StructuredOutput

    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for body, constraint in (({"response_format": rf}, StructuredOutput.json_schema(SCHEMA)), ({}, None)):
        out = chat(app, '{"a":1}', thinking_token_budget=0, **body)["choices"][0]
        assert app.engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert last_constraint(app) == constraint
        assert out["message"] == {"role": "assistant", "content": '{"a":1}'}  # all content: no reasoning_content


@pytest.mark.parametrize("value", [-1, 2.5, "3", True, [3]])
def test_thinking_token_budget_must_be_a_non_negative_integer(app, value):
    """Red while the field is unknown to the server (ignored: 200)."""
    status, out = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "thinking_token_budget": value}, "ok")
    assert status == 400 and out["error"]["param"] == "thinking_token_budget", out
    # completions have no think block to bound: named, not ignored
    status, out = post(app, "/v1/completions", {"prompt": "x", "thinking_token_budget": 3}, "ok")
    assert status == 400 and out["error"]["param"] == "thinking_token_budget" and "chat" in out["error"]["message"]


def test_thinking_budget_grammar_opened_block_and_text_tags(matcher):
    """The budget's grammar where the prompt already opened the block, and its one refusal: think tags that are
    text (llguidance would end a lazy lexeme at its max_tokens without the closing tag)."""
    from xserv.structured import StructuredOutput, reasoning_first

    s = StructuredOutput.regex("[0-9]+")
    opened = reasoning_first(s, opened=True, think_tokens=True, budget=3)  # "\nhmm" is 3 tokens
    assert matcher(opened, "\nhmm</think>\n\n42") and not matcher(opened, "\nhmm ok</think>\n\n42")
    assert not matcher(opened, "42")
    with pytest.raises(ValueError, match="single tokens"):
        reasoning_first(s, opened=False, think_tokens=False, budget=3)
