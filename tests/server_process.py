"""A real `xserv serve` process on a free port, for the server tests (tests/test_server*.py)."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def skip_unless_installed(*modules: str) -> None:
    """Skip the calling test module unless `modules` are installed, without importing them (the server runs in its
    own process: importing fastapi and openai in the test process would only slow down collection, ~1 s)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}", allow_module_level=True)


@functools.lru_cache(maxsize=None)
def http() -> httpx.Client:
    """The client of the tests' plain requests (http().get(...) where one would write httpx.get(...)). httpx.get
    builds a client, and with it an SSL context from the CA bundle, per call: ~60 ms of CPU each for tests that
    speak plain HTTP. No keep-alive, so that every request opens its own connection as httpx.get's do."""
    return httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


def openai_client(server, **options):
    """The official client against a test server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m xserv serve ...` (or `python -c CODE ...` when `code` is given, to patch the engine first)."""

    def __init__(self, model_dir, *args: str, device: str = "cpu", code: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = ["-c", code] if code else ["-m", "xserv"]
        self.cmd = [sys.executable, *launcher, "serve", "--model", str(model_dir), "--device", device,
                    "--port", str(self.port), "--log-level", "warning", *args]
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = str(ROOT) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="xserv-serve-")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if http().get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.output()}")

    def output(self, tail: int | None = 4000) -> str:
        """The server's stdout and stderr: the last `tail` characters (None: all of it)."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        from xserv.server.metrics import parse_metrics

        r = http().get(self.url + "/metrics", headers=headers, timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)


async def stream_text(client: httpx.AsyncClient, url: str, body: dict, drop_after: int | None = None):
    """(joined text, finish_reason, its chunks' choices) of one streamed completion; stop reading after `drop_after`
    chunks (then the text and finish_reason are None)."""
    parts, finish, choices = [], None, []
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            parts.append(choice["text"])
            finish = choice["finish_reason"] or finish
            choices.append(choice)
            if drop_after is not None and len(choices) >= drop_after:
                return None, None, choices
    return "".join(parts), finish, choices


def stream_message(chunks) -> dict:
    """The message a client builds from a stream as OpenAI's SDK does (ChatCompletionStreamState): each field is the
    first delta's value, strings joined to it; a field stays null until a delta gives it a string."""
    msg = {}
    for c in chunks:
        for ch in c["choices"]:
            for key, value in ch["delta"].items():
                if isinstance(value, str) and isinstance(msg.get(key), str):
                    msg[key] += value
                elif msg.get(key) is None:
                    msg[key] = value
    return msg
