"""/v1/chat/completions with the Qwen3.5 tokenizer and chat template (xserv/presets/tokenizer_qwen3_5): tool calls in
the Qwen3-Coder XML form, chosen because the template teaches it; reasoning that starts in the prompt's open
`<think>`; tool_choice "required" / named as a grammar of the XML form; history calls rendered by the template;
and image content parts refused with a 400 for every model. The app runs in process in front of
test_server_tools.py's scripted engine (it answers with the text the test writes down, in pieces the test
chooses)."""
import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from server_process import stream_message  # noqa: E402
from test_server_tools import TOKENIZER as QWEN3_TOKENIZER  # noqa: E402
from test_server_tools import ScriptedEngine, joined, post  # noqa: E402

from xserv.models.config import presets_dir  # noqa: E402

QWEN3_5 = presets_dir() / "tokenizer_qwen3_5"
VOCAB_ROWS = 248320

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array",
                                                                              "items": {"type": "integer"}}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ARGS_1 = {"city": "Oslo", "days": 3, "metric": True, "hours": [9, 18]}
ARGS_2 = {"zone": "CET"}
CALL_1 = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
          "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 18]\n</parameter>\n"
          "</function>\n</tool_call>")
CALL_2 = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
REASONING = "The user wants the weather.\n"
THOUGHT = REASONING + "</think>\n\n"  # the prompt opened <think>\n: the answer starts inside the block


def _app(folder, vocab_rows):
    from xserv.server.app import create_app
    from xserv.server.openai_api import ServerContext
    from xserv.tokenizer import Tokenizer

    engine = ScriptedEngine()
    ctx = ServerContext(engine=engine, tokenizer=Tokenizer.from_folder(folder), model_name="m",
                        max_model_len=4096, vocab_size=vocab_rows, max_in_flight=64)
    a = create_app(ctx)
    a.engine = engine
    return a


@pytest.fixture(scope="module")
def app():
    return _app(QWEN3_5, VOCAB_ROWS)


@pytest.fixture(scope="module")
def qwen3_app():
    return _app(QWEN3_TOKENIZER, 151936)


def chat(app, answer, stream=False, pieces=1000, finish="stop", **body):
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "stream": stream, **body}
    status, out = post(app, "/v1/chat/completions", body, answer, pieces, finish)
    assert status == 200, out
    return out


def test_xml_tool_calls_whole_and_streamed_at_every_split(app):
    """Red while the XML form is not parsed (the calls stay content), a typed value comes back as a string, or a
    stream differs from the whole answer."""
    answer = THOUGHT + "Checking both.\n\n" + CALL_1 + "\n" + CALL_2
    out = chat(app, answer, tools=[WEATHER, TIME])
    assert app.engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == "Checking both." and msg["reasoning_content"] == REASONING
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] \
        == [("function", "get_weather", ARGS_1), ("function", "get_time", ARGS_2)]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    for pieces in (1, 2, 5, 11):
        reasoning, content, calls, finish, order = joined(chat(app, answer, stream=True, pieces=pieces,
                                                               tools=[WEATHER, TIME]))
        assert (reasoning, content, finish) == (REASONING, "Checking both.", "tool_calls")
        assert [(name, json.loads(args)) for _, name, args in calls.values()] == \
            [("get_weather", ARGS_1), ("get_time", ARGS_2)]
        assert order == [("name", 0), ("arguments", 0), ("name", 1), ("arguments", 1)]


def test_the_form_follows_the_template_not_the_model(app, qwen3_app):
    """Each template's own form is parsed and the other one stays content (the model name is "m" for both)."""
    json_call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    msg = chat(app, THOUGHT + json_call, tools=[TIME])["choices"][0]["message"]
    assert msg["content"] == json_call and "tool_calls" not in msg
    msg = chat(qwen3_app, CALL_2, tools=[TIME])["choices"][0]["message"]
    assert msg["content"] == CALL_2 and "tool_calls" not in msg
    msg = chat(qwen3_app, json_call, tools=[TIME])["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize("answer, content", [
    ("<tool_call>\n<function=get_time>\nCET\n</function>\n</tool_call>", None),  # text outside a parameter
    ("Sure.\n" + CALL_2[:40], None),  # cut off inside the block
])
def test_malformed_xml_blocks_are_content(app, answer, content):
    finish = "length" if answer.startswith("Sure.") else "stop"
    whole = chat(app, THOUGHT + answer, finish=finish, tools=[TIME])["choices"][0]
    assert whole["message"]["content"] == answer and "tool_calls" not in whole["message"]
    assert whole["finish_reason"] == finish
    _, streamed, calls, _, _ = joined(chat(app, THOUGHT + answer, stream=True, pieces=3, finish=finish, tools=[TIME]))
    assert streamed == answer and not calls


def test_thinking_off_and_history(app):
    """Thinking off: the template's empty block is in the prompt and the answer is content and calls. A history call
    (arguments as OpenAI's JSON text) is rendered by the template in its XML form, typed values as JSON."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = chat(app, CALL_2, tools=[TIME], **off)["choices"][0]["message"]
    assert app.engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "reasoning_content" not in out and [c["function"]["name"] for c in out["tool_calls"]] == ["get_time"]
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps(ARGS_1)}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    chat(app, "It is 21 C.", tools=[WEATHER], messages=messages)
    prompt = app.engine.prompts[-1]
    assert CALL_1 + "<|im_end|>" in prompt and "<tool_response>\n21 C\n</tool_response>" in prompt
    messages[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2]"
    status, out = post(app, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER]}, "x")
    assert status == 400 and out["error"]["param"] == "messages", out
    assert "messages[1].tool_calls[0]: arguments must be the JSON text of an object" in out["error"]["message"]


@pytest.fixture(scope="module")
def matcher(app):
    """accepts(structured, text): the Qwen3.5 tokens of the text fit the constraint and complete it."""
    from xserv.structured import GrammarConstraint, grammar_tokenizer
    from xserv.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(QWEN3_5)
    llt = grammar_tokenizer(tok, [248046, 248044], VOCAB_ROWS)

    def accepts(structured, text):
        c = GrammarConstraint(llt, structured)
        return all(c.consume(t) for t in tok.encode(text)) and c.accepting
    return accepts


def last_constraint(app):
    return app.engine.params[-1][0].structured


def test_required_and_named_tool_choice_force_the_xml_form(app, matcher):
    """tool_choice "required": one or more calls of the tools in the XML form, after the reasoning (the prompt opened
    the block); named: exactly one call of that function. Red while the grammar is the JSON form's or ignores the
    parameters' types."""
    msg = chat(app, THOUGHT + CALL_1, tools=[WEATHER, TIME], tool_choice="required")["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert json.loads(msg["message"]["tool_calls"][0]["function"]["arguments"]) == ARGS_1
    s = last_constraint(app)
    assert matcher(s, THOUGHT + CALL_1 + "\n" + CALL_2) and matcher(s, THOUGHT + CALL_2)
    assert not matcher(s, CALL_1)  # the answer starts inside the think block the prompt opened
    assert not matcher(s, THOUGHT + "It is sunny.")
    assert not matcher(s, THOUGHT + CALL_1.replace("\n3\n", "\nthree\n"))
    assert not matcher(s, THOUGHT + '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    named = {"type": "function", "function": {"name": "get_time"}}
    chat(app, CALL_2, tools=[WEATHER, TIME], tool_choice=named, chat_template_kwargs={"enable_thinking": False})
    s = last_constraint(app)
    assert matcher(s, CALL_2) and not matcher(s, CALL_1) and not matcher(s, CALL_2 + "\n" + CALL_2)
    chat(app, THOUGHT + CALL_1, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    s = last_constraint(app)
    assert matcher(s, THOUGHT + CALL_1) and not matcher(s, THOUGHT + CALL_1 + "\n" + CALL_2)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a>b": {"type": "string"}}}}}
    status, out = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": [bad], "tool_choice": "required"}, "x")
    assert status == 400 and out["error"]["param"] == "tools" and "cannot be written" in out["error"]["message"]


def test_openai_client_xml_tool_loop(app):
    openai = pytest.importorskip("openai")

    async def go():
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http_client, max_retries=0)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        app.engine.answer, app.engine.pieces, app.engine.finish_reason = THOUGHT + CALL_1, 3, "stop"
        r = await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == ARGS_1
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        app.engine.answer, app.engine.pieces = THOUGHT + CALL_1 + "\n" + CALL_2, 2
        async with client.beta.chat.completions.stream(model="m", messages=messages, tools=[WEATHER, TIME]) as s:
            final = await s.get_final_completion()
        assert CALL_1 in app.engine.prompts[-1]  # the first turn's call, rendered back in the XML form
        calls = final.choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", ARGS_1), ("get_time", ARGS_2)]
        await http_client.aclose()

    asyncio.run(asyncio.wait_for(go(), 30))


# ---- image input ----------------------------------------------------------------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("part, kind", [(IMAGE, "image"), ({"type": "input_audio", "input_audio": {
    "data": "AAAA", "format": "wav"}}, "audio"), ({"type": "file", "file": {"file_id": "f"}}, "file")])
@pytest.mark.parametrize("which", ["qwen3_5", "qwen3"])
def test_media_parts_are_a_400_naming_the_input(app, qwen3_app, which, part, kind):
    """Every model here is served text-only: an image (audio, file) part is refused by name, whole or streamed,
    with the position of the part. Red while it is a 500, a validation error about text parts, or a prompt."""
    a = app if which == "qwen3_5" else qwen3_app
    n = len(a.engine.prompts)
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    for stream in (False, True):
        status, out = post(a, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                       "stream": stream}, "x")
        assert status == 400, out
        assert out["error"]["message"].startswith(f"{kind} input is not supported"), out
        assert out["error"]["param"] == "messages[0].content[1]" and out["error"]["code"] == "unsupported_content"
    assert len(a.engine.prompts) == n  # nothing reached the engine
    ok = chat(a, (THOUGHT if a is app else "") + "Hi.", messages=[{"role": "user", "content": content[:1]}])
    assert ok["choices"][0]["message"]["content"] == "Hi."


@pytest.mark.parametrize("part, needle", [({"type": "text"}, "text must be a string"),
                                          ({"type": "text", "text": 5}, "text must be a string"),
                                          ({"type": "hologram"}, "unknown content part type 'hologram'")])
def test_bad_content_parts(app, part, needle):
    status, out = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]}, "x")
    assert status == 400 and needle in out["error"]["message"], out


def test_openai_client_image_is_a_bad_request(app):
    openai = pytest.importorskip("openai")

    async def go():
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="k", http_client=http_client, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="image input is not supported"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
                {"type": "text", "text": "Describe"}, IMAGE]}])
        await http_client.aclose()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_stream_message_of_an_xml_answer(app):
    """The SDK's way of joining a stream gives the whole answer's message (content null, as there is none)."""
    chunks = chat(app, THOUGHT + CALL_2, stream=True, pieces=4, tools=[TIME])
    msg = stream_message(chunks)
    assert msg["content"] is None and msg["reasoning_content"] == REASONING


def test_thinking_budget_then_the_xml_call(app, matcher):
    """thinking_token_budget N with tool_choice "required": at most N reasoning tokens in the block the prompt
    opened, then only the XML calls."""
    from xserv.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(QWEN3_5)
    assert len(tok.encode(" a" * 5)) == 5  # the reasoning below counts one token per " a"
    chat(app, " a a</think>\n\n" + CALL_2, tools=[TIME], tool_choice="required", thinking_token_budget=2)
    s = last_constraint(app)
    assert matcher(s, " a a</think>\n\n" + CALL_2) and matcher(s, "</think>\n\n" + CALL_2)
    assert not matcher(s, " a a a</think>\n\n" + CALL_2) and not matcher(s, " a</think>\n\nSunny.")
