"""`xserv serve` end to end: one real server process (the perturbed tiny model on the CPU) driven by the official
`openai` client and by raw HTTP: responses, streaming, stop strings, bad input, concurrency, dropped clients."""
import asyncio
import json
import random
import time

import pytest

httpx = pytest.importorskip("httpx")

from batch_shape import assert_same_completion  # noqa: E402
from qwen3_reference import perturbed_model_dir  # noqa: E402,F401
from server_process import ServerProcess, http, skip_unless_installed, stream_text, openai_client  # noqa: E402

skip_unless_installed("fastapi", "uvicorn", "openai")

MODEL = "tiny"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(perturbed_model_dir):  # noqa: F811
    s = ServerProcess(perturbed_model_dir, "--served-model-name", MODEL, "--max-model-len", "256").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http().get(server.url + "/health").json() == {"status": "ok"}


def test_chat_and_completion_streaming_equals_whole(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 10 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])

    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, **GREEDY,
                                      extra_body={"ignore_eos": True})
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, stream=True,
                                         **GREEDY, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.usage.completion_tokens == 10 and plain.choices[0].finish_reason == "length"
    # chat_template_kwargs reach the template: thinking off adds an empty think block to the prompt
    off = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens


def test_token_id_prompt_and_stop_strings_never_leak(client):
    prompt = [791, 6722, 315, 9625, 374]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 12
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop, "\x00never"], **GREEDY,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                              **GREEDY, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=7, temperature=1.0,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # seed + i per choice
    assert a.usage.completion_tokens == 24
    streamed = client.completions.create(stream=True, **kw)
    texts = ["", "", ""]
    for c in streamed:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in a.choices]


BAD_BODIES = [
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1000}, "max_tokens"),  # prompt + 1000 > max_model_len 256
    ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 999999999]}, "prompt"),
    ({"prompt": "word " * 300}, "prompt"),  # longer than the context
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": 5}, "prompt"),
]

BAD_CHAT = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
]


def _check_error(r, status: int, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,param", BAD_BODIES + BAD_CHAT)
def test_bad_input_is_400_naming_the_field(server, body, param):
    route = "/v1/chat/completions" if param.startswith(("messages", "top_logprobs", "max_completion")) else \
        "/v1/completions"
    _check_error(http().post(server.url + route, json=body, timeout=30), 400, param)


def test_bad_json_unknown_model_and_routes(server):
    for raw in (b"{not json", b"[1, 2]", b"", b'{"prompt": "x", "temperature": NaN}',
                b'{"prompt": "x", "temperature": Infinity}'):
        r = http().post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        _check_error(r, 400)
    err = _check_error(http().post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404,
                       "model")
    assert "gpt-9" in err["message"]
    _check_error(http().get(server.url + "/v1/nothing"), 404)
    _check_error(http().get(server.url + "/v1/completions"), 405)
    r = http().post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "some_new_field": 1})
    assert r.status_code == 200  # unknown fields are ignored


def test_64_concurrent_streams_match_each_request_alone(server, rng):
    """64 streams of 16 prompts at once: each stream's text is its request's text alone, up to the rounding a batch
    shape may move on the CPU (tests/batch_shape.py): the same tokens up to a first difference at a near tie of
    the run alone (asked with logprobs to find it), the same logprobs to ROUNDING_ATOL, the whole text when every
    token agrees."""
    prompts = [rng.integers(0, 5000, int(rng.integers(3, 40))).tolist() for _ in range(16)]
    body = dict(max_tokens=8, ignore_eos=True, logprobs=2, **GREEDY)
    alone = []
    for p in prompts:
        r = http().post(server.url + "/v1/completions", json={"prompt": p, **body}, timeout=60)
        assert r.status_code == 200
        alone.append(r.json()["choices"][0])
    assert len({a["text"] for a in alone}) > 8  # the prompts matter

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as c:
            return await asyncio.gather(*[stream_text(c, server.url, {"prompt": prompts[i % 16], **body})
                                          for i in range(64)])

    results = asyncio.run(all_at_once())
    for i, (text, finish, chunks) in enumerate(results):
        assert finish == "length"
        # the chunks' logprobs, joined, name the stream's tokens
        logprobs = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
        got = {"text": text, "logprobs": {key: [v for lp in logprobs for v in lp[key]]
                                          for key in ("tokens", "token_logprobs", "top_logprobs")}}
        assert len(got["logprobs"]["tokens"]) == 8, i
        assert_same_completion(got, alone[i % 16], context=i)
    # multi-byte characters did stream (whole: a delta is a str, a character cannot be cut in two on the wire;
    # a U+FFFD here comes from the random model emitting invalid byte sequences, and then the alone text has it too)
    assert any(ord(ch) > 127 for text, _, _ in results for ch in text)


def test_dropped_streams_free_their_blocks(server):
    idle = server.metrics()
    assert idle["xserv_num_requests_running"] == 0 and idle["xserv_num_requests_waiting"] == 0
    aborted_before = idle['xserv_request_success_total{finish_reason="abort"}']
    rnd = random.Random(5)

    async def many():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as c:
            jobs = []
            for i in range(200):
                drop = rnd.randint(1, 5) if i % 2 else None
                body = {"prompt": [100 + i, 200, 300], "max_tokens": 4 if drop is None else 100, "ignore_eos": True}
                jobs.append(stream_text(c, server.url, body, drop_after=drop))
            return await asyncio.gather(*jobs)

    results = asyncio.run(many())
    assert all(r[1] == "length" for r in results[0::2])  # the kept half completed
    deadline = time.monotonic() + 20
    while True:
        m = server.metrics()
        settled = (m["xserv_num_requests_running"] == 0 and m["xserv_num_requests_waiting"] == 0
                   and m["xserv_kv_blocks_free"] == idle["xserv_kv_blocks_free"])
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m["xserv_num_requests_running"] == 0 and m["xserv_num_requests_waiting"] == 0
    assert m["xserv_kv_blocks_free"] == idle["xserv_kv_blocks_free"], (m, idle)
    assert m['xserv_request_success_total{finish_reason="abort"}'] - aborted_before >= 90  # ~100 dropped mid-way


def test_metrics_page(server):
    text = http().get(server.url + "/metrics").text
    m = server.metrics()
    for name in ("xserv_num_requests_running", "xserv_num_requests_waiting", "xserv_kv_blocks_used",
                 "xserv_kv_blocks_free", "xserv_prefix_cache_hits_total", "xserv_prompt_tokens_total",
                 "xserv_generation_tokens_total", "xserv_time_to_first_token_seconds_count",
                 "xserv_time_per_output_token_seconds_count", "xserv_e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["xserv_generation_tokens_total"] > 0 and m["xserv_time_to_first_token_seconds_count"] > 0
    assert "# TYPE xserv_e2e_request_latency_seconds histogram" in text
    buckets = [v for k, v in m.items() if k.startswith("xserv_e2e_request_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == m["xserv_e2e_request_latency_seconds_count"]


def test_logprobs_chat_and_completions(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, **GREEDY, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None

    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, logprobs=2, **GREEDY,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, logprobs=2, stream=True,
                                              **GREEDY, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert tokens == lp.tokens


def test_bench_serve_against_the_server(server, tmp_path):
    from xserv.cli import build_parser, main

    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", server.url, "--num-prompts", "6", "--input-len", "4:12", "--output-len", "3:5",
            "--max-concurrency", "3", "--json", str(out)]
    build_parser().parse_args(args)
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["model"] == MODEL
    assert 6 * 3 <= result["output_tokens"] <= 6 * 5
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = result[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert result["output_tokens_per_s"] > 0


def test_non_streaming_client_that_leaves_aborts_its_request(server):
    before = server.metrics()['xserv_request_success_total{finish_reason="abort"}']
    with pytest.raises(httpx.TimeoutException):
        http().post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 250, "ignore_eos": True},
                   timeout=0.3)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m['xserv_request_success_total{finish_reason="abort"}'] > before and not m["xserv_num_requests_running"]:
            break
        time.sleep(0.05)
    assert m['xserv_request_success_total{finish_reason="abort"}'] == before + 1
    assert m["xserv_num_requests_running"] == 0


def test_usage_counts_prefix_cached_prompt_tokens(client):
    prompt = list(range(2000, 2070))  # 70 tokens: four full 16-token KV blocks
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 70
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 48  # the full blocks came from the prefix cache
