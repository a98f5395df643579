"""`xserv serve` under pressure and at its edges: API key, body-size limit, overload, SIGTERM drain, an engine
failure, and the generation_config.json defaults (real server processes, the tiny model on the CPU)."""
import json
import re
import signal
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from qwen3_reference import tiny_model_dir  # noqa: E402,F401
from server_process import ServerProcess, http, skip_unless_installed  # noqa: E402

skip_unless_installed("fastapi", "uvicorn")

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):  # noqa: F811
    s = ServerProcess(tiny_model_dir, "--max-num-seqs", "2", "--max-waiting", "0", "--max-request-bytes", "4000",
                      "--max-model-len", "512", env={"XSERV_API_KEY": KEY}).start()
    yield s
    s.stop()


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    return err


def test_api_key_on_every_route_but_health(guarded):
    assert http().get(guarded.url + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/no/such/route")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            err = _error(http().request(method, guarded.url + path, headers=headers, json={}), 401)
            assert KEY not in err["message"]
    assert http().get(guarded.url + "/v1/models", headers=AUTH).status_code == 200
    r = http().post(guarded.url + "/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    assert KEY not in guarded.output()  # never logged


def test_oversized_bodies_get_413_unread(guarded):
    big = json.dumps({"prompt": "x" * 10_000, "max_tokens": 1})
    _error(http().post(guarded.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                      content=big), 413)

    def chunks():  # no Content-Length: the limit trips while reading
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"y" * 100
        yield b'"}'

    _error(http().post(guarded.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                      content=chunks()), 413)
    r = http().post(guarded.url + "/v1/completions", headers=AUTH, json={"prompt": "x" * 500, "max_tokens": 1})
    assert r.status_code == 200


def test_oversized_headers_get_431(guarded):
    # the limit is on the header fields' names and values together (64 KiB by default); uvicorn itself takes a
    # head of any size with httptools (an 8 MB header got 200), so the 431 is the server's own
    def get(headers):
        return http().get(guarded.url + "/v1/models", headers={**AUTH, **headers})

    assert get({"x-pad": "a" * 60_000}).status_code == 200
    for headers in ({"x-pad": "a" * 70_000}, {"x-pad": "a" * (8 << 20)}, {f"x-pad-{i}": "a" * 1000 for i in range(70)}):
        err = _error(get(headers), 431)
        assert err["code"] == "request_headers_too_large" and "65536" in err["message"], err
    # the head is judged before the body: a large body with a large head is 431, with a small head still 413
    r = http().post(guarded.url + "/v1/completions", headers={**AUTH, "x-pad": "a" * 70_000},
                    json={"prompt": "x" * 10_000})
    _error(r, 431)
    _error(http().post(guarded.url + "/v1/completions", headers=AUTH, json={"prompt": "x" * 10_000}), 413)


def test_the_431_limit_counts_header_names_too(guarded):
    """Red when the Guard sums only the header values: 70 headers with 1,000-byte names and one-byte values
    (70,070 bytes of fields) would pass as 70 bytes."""
    names = {f"x-{i:02d}-" + "n" * 995: "v" for i in range(70)}
    assert all(len(name) == 1000 for name in names)
    err = _error(http().get(guarded.url + "/v1/models", headers={**AUTH, **names}), 431)
    assert err["code"] == "request_headers_too_large" and "65536" in err["message"], err
    # the count is names + values: 65 such headers (65,065 bytes with the rest of the head) still pass
    few = dict(list(names.items())[:65])
    assert http().get(guarded.url + "/v1/models", headers={**AUTH, **few}).status_code == 200


def test_overload_is_refused_at_once(guarded):
    # --max-num-seqs 2 --max-waiting 0: two long streams fill the server; a third request is refused at once
    opened, release = threading.Barrier(3), threading.Event()
    finish = []

    def long_stream():
        body = {"prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http().stream("POST", guarded.url + "/v1/completions", headers=AUTH, json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            opened.wait()
            release.wait(30)
        finish.append(True)

    threads = [threading.Thread(target=long_stream) for _ in range(2)]
    for t in threads:
        t.start()
    opened.wait(30)
    try:
        start = time.perf_counter()
        err = _error(http().post(guarded.url + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 2}),
                     503)
        assert err["code"] == "overloaded" and time.perf_counter() - start < 2
        assert http().get(guarded.url + "/health").status_code == 200  # overloaded is not unhealthy
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert finish == [True, True]
    deadline = time.monotonic() + 10
    while guarded.metrics(AUTH)["xserv_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    r = http().post(guarded.url + "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200  # the dropped streams were aborted, room again


def _stream_in_thread(url, body, out: list):
    def go():
        chunks, finish = [], None
        with http().stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    chunks.append(chunk)
                    if chunk.get("choices"):
                        finish = chunk["choices"][0]["finish_reason"] or finish
        out.append((finish, chunks))

    t = threading.Thread(target=go)
    t.start()
    return t


def test_sigterm_drains_then_aborts_and_exits_0(tiny_model_dir):  # noqa: F811
    # 4 sequence slots (the default 256 would zero 190 MB of sampling-penalty state at start-up for 2 streams)
    s = ServerProcess(tiny_model_dir, "--drain-timeout", "2", "--max-model-len", "4096", "--max-num-seqs", "4",
                      "--log-level", "info").start()
    try:
        short, long = [], []
        threads = [_stream_in_thread(s.url, {"prompt": "a", "max_tokens": 12, "ignore_eos": True}, short),
                   _stream_in_thread(s.url, {"prompt": "b", "max_tokens": 4000, "ignore_eos": True}, long)]
        deadline = time.monotonic() + 20
        while s.metrics()["xserv_num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        s.signal(signal.SIGTERM)
        time.sleep(0.3)
        # said at once, in uvicorn's log format, while the two requests still run
        assert re.search(r"^INFO: +draining 2 requests \(up to 2 s\)", s.output(tail=None), re.M), s.output()
        assert http().get(s.url + "/health").status_code == 503
        _error(http().post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
        for t in threads:
            t.join(30)
        assert s.wait(30) == 0, s.output()
        assert short[0][0] == "length"  # finished within the drain timeout
        assert long[0][0] == "abort"  # cut off at the drain timeout, with a proper finish
    finally:
        s.stop()


FAILING_ENGINE = """
import sys
from xserv.engine.llm_engine import LLMEngine
real_step = LLMEngine.step
calls = [0]
def failing_step(self):
    calls[0] += 1
    if calls[0] > 3:
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS (simulated)")
    return real_step(self)
LLMEngine.step = failing_step
from xserv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_failure_ends_streams_with_an_error_and_exits_nonzero(tiny_model_dir):  # noqa: F811
    s = ServerProcess(tiny_model_dir, "--max-num-seqs", "4", code=FAILING_ENGINE).start()
    try:
        out = []
        _stream_in_thread(s.url, {"prompt": "a", "max_tokens": 50, "ignore_eos": True}, out).join(30)
        finish, chunks = out[0]
        assert "error" in chunks[-1] and "ILLEGAL_ADDRESS" in chunks[-1]["error"]["message"]
        assert s.wait(30) == 1, s.output()
    finally:
        s.stop()


def test_sampling_defaults_from_generation_config(tmp_path, tiny_model_dir):  # noqa: F811
    from xserv.generation_config import sampling_defaults

    assert sampling_defaults(tiny_model_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "max_new_tokens": 64, "do_sample": true}')
    assert sampling_defaults(tmp_path) == {"temperature": 0.3, "max_tokens": 64}
    (tmp_path / "generation_config.json").write_text('{"top_k": "many"}')
    with pytest.raises(ValueError, match="top_k"):
        sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="generation_config.json"):
        sampling_defaults(tmp_path)


def test_request_values_override_the_defaults():
    from xserv.server.openai_api import ServerContext, sampling_params
    from xserv.server.protocol import CompletionRequest

    ctx = ServerContext(engine=None, tokenizer=None, model_name="m", max_model_len=100, vocab_size=1000,
                        max_in_flight=4, sampling_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    [p] = sampling_params(ctx, CompletionRequest(prompt="x"), 10, max_tokens=None, max_tokens_param="max_tokens",
                          logprobs=None)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 90)  # defaults; the rest of context
    ps = sampling_params(ctx, CompletionRequest(prompt="x", temperature=0, top_k=-1, n=2, seed=5), 10,
                         max_tokens=7, max_tokens_param="max_tokens", logprobs=None)
    assert [(p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) for p in ps] == [(0, 0.95, -1, 7, 5),
                                                                                      (0, 0.95, -1, 7, 6)]


class _Seq:
    def __init__(self, n):
        self.num_prompt_tokens = n


class _FailingEngine:
    """Accepts requests; its first step fails like a CUDA error would."""

    def __init__(self):
        self.live = []

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0, "kv_blocks_total": 8, "kv_blocks_free": 8}

    def add_request(self, prompt_ids, params, prompt=None, stream=False):
        self.live.append(_Seq(len(prompt_ids)))
        return self.live[-1]

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (simulated)")

    def abort(self, seq):
        self.live.remove(seq)


def test_health_is_503_after_an_engine_failure():
    import asyncio

    from xserv.engine.engine_thread import EngineThread
    from xserv.server.app import create_app
    from xserv.server.async_engine import AsyncEngine
    from xserv.server.openai_api import ServerContext

    async def scenario():
        failed = asyncio.Event()
        ctx = ServerContext(engine=AsyncEngine(EngineThread(_FailingEngine()), on_broken=lambda e: failed.set()),
                            tokenizer=None,
                            model_name="m", max_model_len=64, vocab_size=1000, max_in_flight=8)
        app = create_app(ctx)
        ctx.engine.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://xserv") as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            assert _error(r, 503)["code"] == "engine_failed" and "LAUNCH_FAILED" in r.json()["error"]["message"]
            await asyncio.wait_for(failed.wait(), 5)
            assert (await c.get("/health")).status_code == 503
            assert _error(await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}), 503)["code"] == \
                "engine_failed"
        await ctx.engine.stop()

    asyncio.run(scenario())


def test_thread_setup_runs_on_the_engine_thread_and_its_failure_breaks_the_engine():
    import asyncio
    import threading

    from xserv.engine.engine_thread import EngineThread
    from xserv.server.async_engine import AsyncEngine, EngineBroken

    async def scenario():
        where = []
        engine = AsyncEngine(EngineThread(_FailingEngine(),
                                          thread_setup=lambda: where.append(threading.current_thread().name)))
        engine.start()
        await engine.stop()
        assert where == ["xserv-engine"]  # CUDA contexts are per thread: the binding must happen there

        def cannot_bind():
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT (simulated)")

        failed = asyncio.Event()
        engine = AsyncEngine(EngineThread(_FailingEngine(), thread_setup=cannot_bind), on_broken=lambda e: failed.set())
        engine.start()
        await asyncio.wait_for(failed.wait(), 5)
        with pytest.raises(EngineBroken, match="INVALID_CONTEXT"):
            async for _ in engine.generate([1, 2], [None]):
                pass
        await engine.stop()

    asyncio.run(scenario())
