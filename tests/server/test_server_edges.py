"""`xserv serve` at its edges, seen from both sides: a real server process (the tiny model on the CPU) whose engine
writes down what it is given and what it runs (`RECORDING_ENGINE`), so that a test can check the engine itself,
not only what the HTTP side says: a dropped stream stops the engine's work on it, a chat's system turn reaches
the engine as the template renders it, streams carry no empty chunks; and a second server on the port the
first one holds fails before its model loads."""
import json
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")

from qwen3_reference import tiny_model_dir  # noqa: E402,F401
from server_process import ROOT, ServerProcess, http, skip_unless_installed  # noqa: E402

skip_unless_installed("fastapi", "uvicorn")

# Runs `xserv serve` with LLMEngine's add_request / step / abort wrapped: each call appends one JSON line to the
# file named by $XSERV_TEST_RECORD (all three run on the engine thread only, so the lines never interleave).
RECORDING_ENGINE = """
import json, os, sys
from xserv.engine.llm_engine import LLMEngine
record = open(os.environ["XSERV_TEST_RECORD"], "a", buffering=1)
real_add, real_step, real_abort = LLMEngine.add_request, LLMEngine.step, LLMEngine.abort
def add_request(self, prompt_ids, *args, **kwargs):
    seq = real_add(self, prompt_ids, *args, **kwargs)
    record.write(json.dumps({"add": seq.seq_id, "prompt_ids": list(prompt_ids)}) + "\\n")
    return seq
def step(self):
    results = real_step(self)
    record.write(json.dumps({"step": [seq.seq_id for seq, _ in results],
                             "running": self.stats()["num_running"]}) + "\\n")
    return results
def abort(self, seq):
    record.write(json.dumps({"abort": seq.seq_id}) + "\\n")
    real_abort(self, seq)
LLMEngine.add_request, LLMEngine.step, LLMEngine.abort = add_request, step, abort
from xserv.cli import main
sys.exit(main(sys.argv[1:]))
"""

GREEDY = {"temperature": 0.0, "ignore_eos": True}
LONG = 500  # output tokens of a request that would run for seconds (~20 ms a token) if nothing stopped it


class Recording:
    def __init__(self, path):
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int) -> list[dict]:
        with open(self.path) as f:
            f.seek(mark)
            return [json.loads(line) for line in f.read().splitlines()]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("record") / "engine.jsonl"
    path.touch()
    # 4 sequence slots: the default 256 would zero 190 MB of sampling-penalty state at start-up
    s = ServerProcess(tiny_model_dir, "--max-model-len", "512", "--max-num-seqs", "4", code=RECORDING_ENGINE,
                      env={"XSERV_TEST_RECORD": str(path)}).start()
    s.record = Recording(path)
    yield s
    s.stop()


def _added(events: list[dict]) -> list[dict]:
    return [e for e in events if "add" in e]


def test_a_dropped_stream_stops_the_engines_work_on_it(server):
    idle = server.metrics()
    mark = server.record.mark()
    body = {"prompt": [7, 8, 9, 10], "max_tokens": LONG, "stream": True, **GREEDY}
    with http().stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(chunks)
    closed = time.monotonic()  # leaving the block closed the connection (no keep-alive)
    while server.metrics()["xserv_num_requests_running"] and time.monotonic() - closed < 5:
        time.sleep(0.02)
    stopped_after = time.monotonic() - closed
    m = server.metrics()
    assert m["xserv_num_requests_running"] == 0 and m["xserv_num_requests_waiting"] == 0
    assert stopped_after < 2.0, stopped_after  # the request alone would have run LONG steps
    assert m["xserv_kv_blocks_free"] == idle["xserv_kv_blocks_free"]

    events = server.record.since(mark)
    [seq] = [e["add"] for e in _added(events)]
    aborted = [i for i, e in enumerate(events) if e.get("abort") == seq]
    assert aborted, "the engine was never told to abort the dropped request"
    after = events[aborted[0] + 1:]
    assert not any(seq in e["step"] for e in after if "step" in e), "the engine ran the aborted sequence on"
    assert all(e["running"] == 0 for e in after if "step" in e)  # nothing else ran: the engine went idle
    generated = sum(seq in e["step"] for e in events if "step" in e)
    assert 3 <= generated < LONG // 10, generated


@pytest.mark.parametrize("role", ["system", "developer"])
def test_the_system_turn_reaches_the_engine_as_the_chat_template_renders_it(server, tiny_model_dir, role):  # noqa: F811
    from xserv.tokenizer import Tokenizer

    messages = [{"role": role, "content": "You are a terse pirate."}, {"role": "user", "content": "Hi"}]
    mark = server.record.mark()
    r = http().post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    [added] = _added(server.record.since(mark))
    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    rendered = ("<|im_start|>system\nYou are a terse pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\n")  # Qwen3's template, thinking on (the default)
    assert tokenizer.apply_chat_template([{**messages[0], "role": "system"}, messages[1]]) == rendered
    assert tokenizer.decode(added["prompt_ids"]) == rendered
    assert added["prompt_ids"] == tokenizer.encode(rendered)
    assert r.json()["usage"]["prompt_tokens"] == len(added["prompt_ids"])


def _events(route: str, body: dict) -> list[dict]:
    with http().stream("POST", route, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streams_carry_no_empty_chunks(server, route):
    """A token whose text is held back (part of a stop string, or of a multi-byte character) sends nothing until
    its text is decided; its logprobs go out with that text. Chat opens with one role chunk per choice (content null:
    thinking is on, and an answer may end before its think block does)."""
    chat = route == "chat"
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    n, tokens = 2, 8
    body = {"max_tokens": tokens, "n": n, **GREEDY,
            **({"messages": [{"role": "user", "content": "Count to ten."}], "logprobs": True} if chat else
               {"prompt": "Once upon a time", "logprobs": 0})}
    whole = http().post(url, json=body, timeout=60).json()["choices"][0]
    text = whole["message"]["content"] if chat else whole["text"]
    assert len(text) > 4
    # a stop string that the output keeps starting but never completes: every token's text is held back
    for extra in ({}, {"stop": [text + "\x00"]}):
        events = _events(url, {**body, **extra})
        if chat:
            opening = [e["choices"] for e in events[:n]]
            assert opening == [[{"index": i, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                 "finish_reason": None}] for i in range(n)]
            events = events[n:]
        texts, logprobs = [""] * n, [0] * n
        for e in events:
            for c in e["choices"]:
                new = c["delta"].get("content", "") if chat else c["text"]
                assert new or c["finish_reason"] is not None, e  # no empty chunk
                texts[c["index"]] += new
                if c["logprobs"] is not None:
                    logprobs[c["index"]] += len(c["logprobs"]["content"] if chat else c["logprobs"]["tokens"])
        assert texts == [text] * n and logprobs == [tokens] * n, extra
        if extra:  # held back to the end: each choice's text comes in its last chunk
            assert sum(len(e["choices"]) for e in events) == n


def test_a_port_that_a_running_xserv_holds_fails_at_once_before_the_model_loads(server, tmp_path):
    """Red when xserv binds with SO_REUSEPORT: the running server (the module's, bound by the same code) would then
    share its port with the second one, which would go on to the model (here a missing folder, so that the order
    shows: the port error comes first, before the model is even looked at)."""
    r = subprocess.run([sys.executable, "-m", "xserv", "serve", "--model", str(tmp_path / "no-such-model"),
                        "--device", "cpu", "--port", str(server.port)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"xserv: error: port {server.port} is already in use on 127.0.0.1 (another "
                                     f"server?); choose another with --port"]
    assert http().get(server.url + "/health").status_code == 200  # the running server kept its port


def test_the_listening_socket_does_not_share_its_port():
    """Red when xserv's listening socket sets SO_REUSEPORT (another process could then bind the same port and take
    part of its connections); SO_REUSEADDR, which only lets a restart rebind past TIME_WAIT, stays."""
    from xserv.server.uvicorn_server import listening_sockets

    sockets = listening_sockets("127.0.0.1", 0)
    try:
        for sock in sockets:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            if hasattr(socket, "SO_REUSEPORT"):
                assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    finally:
        for sock in sockets:
            sock.close()
