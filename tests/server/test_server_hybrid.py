"""`xserv serve` with a hybrid Gated DeltaNet model (the tiny Qwen3.5 in its release layout, on the NumPy backend),
through the official `openai` client and raw HTTP read with a strict JSON parser: chat completions whole and
streamed (the answer starting inside the reasoning the template opened), tools accepted in the XML form's template,
an image part refused with a 400, and /v1/models naming the folder."""
import json

import pytest

from server_process import ServerProcess, http, openai_client, skip_unless_installed, stream_message

skip_unless_installed("fastapi", "uvicorn", "openai")

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def strict(text: str):
    """json.loads that refuses NaN / Infinity (what a strict client's parser does)."""
    def no_constants(name):
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from xserv.models.random_checkpoint import make_test_model

    folder = make_test_model("qwen3.5-tiny", tmp_path_factory.mktemp("hybrid") / "qwen3.5-tiny")
    s = ServerProcess(folder, "--max-model-len", "512", "--max-num-seqs", "4").start()
    yield s
    s.stop()


def test_chat_whole_and_streamed(server):
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == ["qwen3.5-tiny"]
    messages = [{"role": "user", "content": "What time is it in Oslo?"}]
    whole = client.chat.completions.create(model="qwen3.5-tiny", messages=messages, max_tokens=12, temperature=0,
                                           tools=[TOOL])
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop", "tool_calls")
    assert whole.usage.completion_tokens == 12 or choice.finish_reason != "length"
    # random weights never close the reasoning the prompt opened: the whole answer is reasoning, content null
    if choice.finish_reason == "length":
        assert choice.message.content is None and choice.message.reasoning_content
    chunks = list(client.chat.completions.create(model="qwen3.5-tiny", messages=messages, max_tokens=12,
                                                 temperature=0, tools=[TOOL], stream=True))
    streamed = stream_message([c.model_dump() for c in chunks])
    assert streamed.get("reasoning_content") == choice.message.reasoning_content  # greedy: the same run


def test_image_input_is_a_400(server):
    r = http().post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "qwen3.5-tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
    assert r.status_code == 400
    body = strict(r.text)
    assert "image input is not supported" in body["error"]["message"]
    ok = http().post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "qwen3.5-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and strict(ok.text)["choices"][0]["finish_reason"] == "length"
