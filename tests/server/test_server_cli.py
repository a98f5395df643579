"""`xserv serve`'s start-up, in process: the options vLLM's users know (--dtype, --revision, --chat-template), the
default served model name, and the structured-output check that stops a start whose llguidance cannot serve a
constrained request. `xserv.cli.main` runs for real up to the point where uvicorn would start serving (the tiny
model loads on the CPU); `DrainingServer.run` is replaced by a stand-in that keeps the server for the test."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")

from qwen3_reference import tiny_model_dir  # noqa: E402,F401
from server_process import free_port, skip_unless_installed  # noqa: E402

skip_unless_installed("fastapi", "uvicorn", "llguidance")

SMALL = ["--device", "cpu", "--max-num-seqs", "2", "--max-model-len", "256"]


@pytest.fixture
def serve(monkeypatch):
    """serve(*argv, during=None) -> (exit status, the DrainingServer that would have run, or None): `xserv serve
    argv` through main(), stopped where uvicorn would take over (the stand-in marks the server started so that main
    returns 0). during(server) runs in the stand-in, while the model is still loaded; its result is the server's
    `seen`."""
    from xserv.cli import main
    from xserv.server import uvicorn_server

    ran, hooks = [], []

    def run(self, sockets=None):
        assert sockets and sockets[0].getsockname()[1]  # bound before the model loaded
        self.seen = hooks[0](self) if hooks[0] else None
        self.started = True
        ran.append(self)

    monkeypatch.setattr(uvicorn_server.DrainingServer, "run", run)

    def go(*argv, during=None):
        hooks[:] = [during]
        status = main(["serve", *argv, "--port", str(free_port())])
        return status, (ran.pop() if ran else None)

    return go


def _chat_prompt_tokens(server, body: dict) -> int:
    """usage.prompt_tokens of one chat request through the server's app (its engine started for the call)."""
    ctx = server.ctx

    async def scenario():
        ctx.engine.start()
        try:
            transport = httpx.ASGITransport(app=server.config.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://xserv") as client:
                r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens"]
        finally:
            await ctx.engine.stop()

    return asyncio.run(scenario())


# ---- the served model name --------------------------------------------------------------------------------------
def test_the_default_served_model_name_is_the_folders_name(serve, tiny_model_dir, monkeypatch, capsys):  # noqa: F811
    """Red when the default name is the --model argument or the resolved folder (a cache path such as
    /root/.cache/xserv/models/tiny-random) instead of the folder's own name."""
    monkeypatch.chdir(tiny_model_dir.parent)
    for model in (str(tiny_model_dir), f"./{tiny_model_dir.name}/", None):
        status, server = serve(*(["--model", model] if model else []), *SMALL)
        assert status == 0 and server.ctx.model_name == "tiny-random", (model, server.ctx.model_name)
    assert "serving 'tiny-random'" in capsys.readouterr().err
    status, server = serve("--model", str(tiny_model_dir), "--served-model-name", "qwen", *SMALL)
    assert status == 0 and server.ctx.model_name == "qwen"


def test_a_hub_id_is_its_own_name_and_revision_reaches_the_download(serve, tiny_model_dir, monkeypatch,  # noqa: F811
                                                                     tmp_path):
    """Red when --revision is not passed to huggingface_hub's snapshot_download (every call must carry it), or
    when a hub id is served under its cache folder's name instead of the id clients send."""
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("revision")))
        return str(tiny_model_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)  # no folder named Qwen/ here: the argument is a hub id
    status, server = serve("--model", "Qwen/Qwen3-0.6B", "--revision", "v1.2", *SMALL)
    assert status == 0 and server.ctx.model_name == "Qwen/Qwen3-0.6B"
    assert calls and all(call == ("Qwen/Qwen3-0.6B", "v1.2") for call in calls), calls
    calls.clear()
    assert serve("--model", "Qwen/Qwen3-0.6B", *SMALL)[0] == 0
    assert calls and all(revision is None for _, revision in calls), calls


def test_revision_with_a_local_folder_is_a_usage_error(serve, tiny_model_dir, capsys):  # noqa: F811
    """Red when --revision is silently ignored for a local folder (or the bundled model): the user asked for a
    version that xserv would not load."""
    for model in (["--model", str(tiny_model_dir)], []):
        assert serve(*model, "--revision", "v1.2", *SMALL) == (2, None)
        err = capsys.readouterr().err
        assert err.startswith("xserv: error: --revision v1.2 picks a version of a Hugging Face hub model") and \
            "loading" not in err, err


# ---- --dtype ---------------------------------------------------------------------------------------------------
def test_dtype_takes_what_the_engine_computes_in_and_refuses_the_rest(serve, capsys):
    """Red when --dtype is missing or takes any value (float16 or float32 would be accepted and silently run in
    bfloat16)."""
    from xserv.cli import build_parser

    parser = build_parser()
    for given, value in (([], "auto"), (["--dtype", "auto"], "auto"), (["--dtype", "bfloat16"], "bfloat16"),
                         (["--dtype", "bf16"], "bfloat16")):
        assert parser.parse_args(["serve", *given]).dtype == value
    for bad in ("float16", "half", "float32", "fp8"):
        with pytest.raises(SystemExit) as e:
            serve("--dtype", bad, *SMALL)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (f"xserv serve: error: argument --dtype: {bad!r} is not supported: xserv runs the model in "
                       f"bfloat16 (float16 and float32 checkpoints are converted at load); choose auto or bfloat16"), err


# ---- --chat-template ---------------------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_chat_template_from_a_file_or_as_text_replaces_the_tokenizers(serve, tiny_model_dir, tmp_path):  # noqa: F811
    """Red when --chat-template is missing or does not reach the tokenizer that the chat endpoint renders with
    (the request's prompt would then be the model's own template, Qwen3's, with a different token count)."""
    from xserv.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tiny_model_dir)
    messages = [{"role": "user", "content": "Name three primes."}]
    rendered = "[user] Name three primes.\n[assistant] "
    assert tokenizer.apply_chat_template(messages) != rendered  # the folder's own template differs
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    for value in (str(path), TEMPLATE):
        body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        status, server = serve("--model", str(tiny_model_dir), "--chat-template", value, *SMALL,
                               during=lambda server: _chat_prompt_tokens(server, body))
        assert status == 0 and server.ctx.tokenizer.chat_template == TEMPLATE
        assert server.seen == len(tokenizer.encode(rendered))


def test_a_bad_chat_template_is_refused_before_the_model_loads(serve, tiny_model_dir, tmp_path, capsys):  # noqa: F811
    """Red when a chat template that cannot work is accepted: a path that names no file (taken as template text,
    every chat would then answer to the path's words), a template Jinja cannot parse (a 400 at every chat
    request), or a folder."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    cases = [(str(tmp_path / "missing.jinja"), "no such file"),
             (str(broken), "is not a valid Jinja template"),
             ("{{ messages[0].content ", "is not a valid Jinja template"),
             (str(tmp_path), "is not a file")]
    for value, needle in cases:
        assert serve("--model", str(tiny_model_dir), "--chat-template", value, *SMALL) == (2, None)
        err = capsys.readouterr().err
        assert err.startswith("xserv: error: --chat-template") and needle in err and "loading" not in err, err


# ---- the structured-output check ----------------------------------------------------------------------------------
def test_a_broken_llguidance_stops_the_start_with_the_fix(serve, tiny_model_dir, monkeypatch, capsys):  # noqa: F811
    """Red when the server starts without checking that structured output works: with an llguidance whose
    LLTokenizer refuses xserv's arguments (1.6's TypeError on the list of eos tokens), every constrained request
    would be a 500. The start must stop before serving, with one line naming llguidance, its version and the fix."""
    from importlib import metadata

    import llguidance

    from xserv import structured
    from xserv.server.cli import _requirement

    def old_tokenizer(*args, **kwargs):
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    monkeypatch.setattr(llguidance, "LLTokenizer", old_tokenizer)
    monkeypatch.setattr(structured, "_TOKENIZERS", {})  # nothing built by an earlier test in this process
    status, server = serve("--model", str(tiny_model_dir), *SMALL)
    err = capsys.readouterr().err.strip().splitlines()
    assert (status, server) == (1, None), err
    version, wanted = metadata.version("llguidance"), _requirement("llguidance")
    assert wanted.startswith(">=")  # the range pyproject.toml declares, read from xserv's metadata
    assert err[-1] == (f"xserv: error: structured output (response_format, guided_*, tool_choice) does not work "
                       f"with the installed llguidance {version} (TypeError: argument 'eos_token': 'list' object "
                       f"cannot be interpreted as an integer); every constrained request would fail. Fix: "
                       f'pip install -U "llguidance{wanted}"'), err
    assert not any("serving" in line for line in err)


def test_the_check_names_a_missing_llguidance(monkeypatch):
    """Red when the message for an llguidance that is not installed names a version or omits the fix."""
    from xserv.server import cli

    monkeypatch.setattr(cli, "_installed_version", lambda package: None)
    message = cli.structured_output_error(ModuleNotFoundError("No module named 'llguidance'"))
    assert "llguidance, which is not installed (ModuleNotFoundError: No module named 'llguidance')" in message
    assert message.endswith(f'Fix: pip install -U "llguidance{cli._requirement("llguidance")}"')
