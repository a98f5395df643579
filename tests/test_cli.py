"""`xserv generate` and `xserv chat` as a user runs them, on the CPU.

Every flag is checked on tests/scripted_model.py's model, whose next-token logits are written down (test_options.py
checks the same options through the `LLM` API): what a flag must change in the output follows from those logits,
so a flag that were ignored or inverted fails its test. Prompts pick the script's branch by their last token:
"Count:" counts " one two three four" then <|im_end|>; "... green" cycles " red green" (44 > 40) unless a
repetition penalty lets " blue" in; "... peach" draws words from DRAW; "... eight" says " nine" then
<|endoftext|>; a chat prompt gets " yes" (thinking on) or " no" (off); "Paris" anywhere makes every token " flag".

Subprocesses (started together: most of each run is start-up, imports and the 11 MB tokenizer) cover the whole
path once per kind of use; the other flags run `xserv.cli.main` in this process on one loaded model (a subprocess
each would add ~1.3 s of CPU apiece for the same code path).
"""
import argparse
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from qwen3_reference import tiny_model_dir  # noqa: F401
from scripted_model import DRAW, scripted_model  # noqa: F401

from xserv.cli import build_parser, main


def xserv(*args, stdin=None, timeout=120, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "xserv", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


# ---- subprocesses ------------------------------------------------------------------------------------------------
# A chat session (--no-enable-thinking: plain replies are " no") and what each turn prints to stdout after ">>> ".
CHAT_TURNS = [
    ("hi", " flag flag flag\n"),  # --system Paris reached the model
    ("/system", "(system prompt cleared; conversation reset)\n"),
    ("hi", " no\n"),
    ("I like Paris", " flag flag flag\n"),
    ("hi", " flag flag flag\n"),  # the conversation so far is part of the prompt
    ("/reset", "(conversation reset)\n"),
    ("hi", " no\n"),
    ("/system Paris", "(system prompt set; conversation reset)\n"),
    ("hi", " flag flag flag\n"),
    ("/bogus", "unknown command /bogus; /help lists the commands\n"),
    ("/exit", ""),
]


@pytest.fixture(scope="module")
def runs(scripted_model):  # noqa: F811
    """The CompletedProcess of a `generate` and of a `chat` session, and a `generate` piped into `head`, run side by
    side."""
    model = ["--model", str(scripted_model.path), "--device", "cpu"]
    commands = {
        # the prompt from stdin (" red green red green ..." follows it); --stop is repeatable, the text not printed
        "generate": (["generate", *model, "--prompt-file", "-", "-t", "0", "--max-tokens", "8", "--stop", "zzz",
                      "--stop", "n re"], "Colors: green"),
        "chat": (["chat", *model, "-t", "0", "--max-tokens", "3", "--system", "Paris", "--no-enable-thinking"],
                 "".join(turn + "\n" for turn, _ in CHAT_TURNS)),
    }
    with ThreadPoolExecutor(len(commands) + 1) as pool:
        futures = {name: pool.submit(xserv, *args, stdin=stdin) for name, (args, stdin) in commands.items()}
        futures["broken_pipe"] = pool.submit(head_of_generate, model, 10)
        return {name: f.result() for name, f in futures.items()}


def head_of_generate(model_args, num_bytes):
    """`xserv generate ... | head -c NUM_BYTES`: (the bytes read, the exit status, stderr). The output would be
    3000 tokens: xserv must notice the closed pipe and stop."""
    proc = subprocess.Popen([sys.executable, "-m", "xserv", "generate", *model_args, "-p", "Count:", "-t", "0",
                             "--ignore-eos", "--max-tokens", "3000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        head = proc.stdout.read(num_bytes)
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return head, proc.returncode, err.decode()


def test_generate(runs):
    r = runs["generate"]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == " red gree\n"


@pytest.mark.parametrize("name", ["generate", "chat"])
def test_no_progress_bars_on_piped_stderr(runs, name):
    """stderr is a pipe here: a progress bar (loading weights) would leave carriage-return junk in it (read as
    text, each carriage return arrives as a newline: the bar's own "N%|" is what shows)."""
    err = runs[name].stderr
    assert "\r" not in err and "%|" not in err and "loading weights" not in err, err


def test_broken_pipe_exits_quietly(runs):
    head, code, err = runs["broken_pipe"]
    assert head == b" one two t"
    assert code == 141 and "Traceback" not in err and "BrokenPipe" not in err, (code, err)  # 141: ended by SIGPIPE


def test_chat_session(runs):
    r = runs["chat"]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.split(">>> ") == [""] + [want for _, want in CHAT_TURNS]
    assert r.stderr.count("tok/s") == sum(not turn.startswith("/") for turn, _ in CHAT_TURNS)
    # " flag flag flag" is cut by --max-tokens 3, " no" ends on its own
    assert r.stderr.count("[stopped: --max-tokens 3 reached]") == sum(want == " flag flag flag\n" for _, want in
                                                                      CHAT_TURNS), r.stderr
    assert "context" not in r.stderr, r.stderr


def test_piped_chat_ends_each_answer_with_a_newline(runs):
    """Piped `xserv chat` (stdin and stdout not a terminal) wrote each answer to stdout without a newline (the one a
    terminal shows went to stderr, before the token count): a reader of stdout got the next ">>> " prompt, or the
    end, glued to the answer. Each answer ends with a newline before what follows."""
    r = runs["chat"]
    parts = r.stdout.split(">>> ")[1:]
    answers = [part for (turn, _), part in zip(CHAT_TURNS, parts) if not turn.startswith("/")]
    assert len(answers) == sum(not turn.startswith("/") for turn, _ in CHAT_TURNS), r.stdout
    assert all(a.endswith("\n") and a.strip() for a in answers), r.stdout
    assert all(a.count("\n") == 1 for a in answers), r.stdout  # one newline: no blank line after an answer


# ---- in this process ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(scripted_model):  # noqa: F811
    from xserv import LLM

    return LLM(str(scripted_model.path), device="cpu", max_num_seqs=8, progress=False)


@pytest.fixture
def generate(loaded, scripted_model, monkeypatch, capsys):  # noqa: F811
    """`xserv generate --model M --device cpu ARGS` through xserv.cli.main, on the already loaded model: its
    stdout (the exit status must be 0)."""
    import xserv.llm

    def same_model(model, device=None, config=None):
        assert model == str(scripted_model.path) and device == "cpu"
        return loaded

    monkeypatch.setattr(xserv.llm, "LLM", same_model)

    def run(*args, stdin=""):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        code = main(["generate", "--model", str(scripted_model.path), "--device", "cpu", *args])
        out, err = capsys.readouterr()
        assert code == 0, err
        run.err = err
        return out
    return run


def test_generate_stopping_flags(generate):
    assert generate("-p", "Count:", "-t", "0") == " one two three four\n"  # <|im_end|> (default --max-tokens 256)
    assert generate("-p", "Count:", "-t", "0", "--max-tokens", "2") == " one two\n"
    assert generate("-p", "Count:", "-t", "0", "--ignore-eos", "--max-tokens", "7") == " one two three four five six\n"
    assert generate("-p", "Count:", "-t", "0", "--stop", " three") == " one two\n"


def test_generate_says_what_cut_the_reply(generate):
    """A reply cut short says so on stderr, after the answer: by --max-tokens here (the context's end: below)."""
    assert generate("-p", "Count:", "-t", "0", "--max-tokens", "2") == " one two\n"
    assert "[stopped: --max-tokens 2 reached]" in generate.err and "context" not in generate.err, generate.err
    assert generate("-p", "Count:", "-t", "0") == " one two three four\n"  # ended by <|im_end|>: no note
    assert "stopped" not in generate.err, generate.err


def test_generate_repetition_penalty(generate):
    assert generate("-p", "Colors: green", "-t", "0", "--max-tokens", "4") == " red green red green\n"
    # 44 / 1.5 < 40: blue instead of a second red, then <|im_end|>
    assert generate("-p", "Colors: green", "-t", "0", "--max-tokens", "8", "--repetition-penalty", "1.5") == \
        " red green blue\n"


def test_generate_chat_flags(generate):
    assert generate("-p", "hi", "-t", "0") == " one two three four\n"  # plain text: no template
    assert generate("-p", "hi", "-t", "0", "--chat") == " yes\n"  # thinking on by default: "assistant\n" last
    assert generate("-p", "hi", "-t", "0", "--chat", "--no-enable-thinking") == " no\n"  # "</think>\n\n" last
    assert generate("-p", "hi", "-t", "0", "--chat", "--enable-thinking") == " yes\n"
    assert generate("-p", "Paris", "-t", "0", "--chat", "--max-tokens", "2") == " flag flag\n"


def test_generate_prompt_file(generate, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("A long prompt,\nover lines.\nColors: green", encoding="utf-8")
    assert generate("--prompt-file", str(path), "-t", "0", "--max-tokens", "4") == " red green red green\n"
    assert generate("--prompt-file", "-", "-t", "0", stdin="Numbers: eight") == " nine\n"


def test_generate_engine_flags_reach_the_engine(scripted_model, capsys):  # noqa: F811
    """Loads the model itself (no shared model): --max-model-len 4 leaves room for two tokens after "Count:", and
    the note on stderr says that the context's end cut the reply (not --max-tokens, 256 by default)."""
    code = main(["generate", "--model", str(scripted_model.path), "--device", "cpu", "-p", "Count:", "-t", "0",
                 "--max-model-len", "4", "--kv-cache-tokens", "64", "--max-num-seqs", "1", "--no-prefix-caching"])
    out, err = capsys.readouterr()
    assert code == 0 and out == " one two\n", err
    assert err.rstrip().endswith("[stopped: the context of 4 tokens is full]"), err


@pytest.mark.parametrize("args, needle", [
    (["-p", "hi", "--prompt-file", "-"], "not allowed with argument"),
    (["-t", "0"], "one of the arguments --prompt/-p --prompt-file is required"),
    (["--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
])
def test_generate_prompt_source_errors(scripted_model, capsys, args, needle):  # noqa: F811
    try:
        code = main(["generate", "--model", str(scripted_model.path), "--device", "cpu", *args])
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err


def drawn(generate, *flags) -> list[str]:
    """8 words drawn after "I like peach" (all from DRAW)."""
    words = [" " + w for w in generate("-p", "I like peach", "--max-tokens", "8", *flags).split()]
    assert len(words) == 8 and set(words) <= set(DRAW), words
    return words


def test_generate_sampling_flags(generate):
    seed1 = drawn(generate, "--seed", "1")
    assert drawn(generate, "--seed", "1") == seed1
    assert drawn(generate, "--seed", "2") != seed1
    assert len(set(seed1)) > 1  # the default temperature 1 samples
    # each keeps apple only (apple's probability is .185; test_options.py has the numbers and the kept sets)
    for flags in (["--top-k", "1"], ["--top-p", "0.1"], ["--min-p", "0.9"], ["--temperature", "0.01"]):
        assert drawn(generate, "--seed", "0", *flags) == [" apple"] * 8, flags


def test_generate_takes_generation_config_defaults(generate, loaded, monkeypatch):
    """A flag left out takes the model folder's generation_config.json value (as `xserv serve` does); a flag given
    wins over it."""
    import xserv.generation_config

    folders = []
    monkeypatch.setattr(xserv.generation_config, "sampling_defaults",
                        lambda folder: (folders.append(str(folder)), {"top_k": 1})[1])
    assert drawn(generate, "--seed", "3") == [" apple"] * 8  # top_k 1 from the folder's defaults
    assert folders == [str(loaded.folder)]
    assert len(set(drawn(generate, "--seed", "3", "--top-k", "0"))) > 1  # the flag wins: top-k off again


def test_bad_model_path_is_reported_before_the_device(tmp_path):
    r = xserv("generate", "--model", str(tmp_path / "missing"), "-p", "hi")  # no --device: xserv picks one
    assert r.returncode == 2 and "not found" in r.stderr, r.stderr
    assert "CUDA" not in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def cli(capsys, monkeypatch):
    """`xserv ARGS` through xserv.cli.main in this process (what the process adds is tested by the subprocesses
    above): (exit status, stdout, stderr)."""
    def run(*args, stdin=""):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_generate_without_a_model_uses_the_bundled_tiny_one(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))
    code, out, err = cli("generate", "--device", "cpu", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0")
    assert code == 0, err
    assert "RANDOM" in err and out.strip()
    assert (tmp_path / "models" / "tiny-random" / "config.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (["--model", "/no/such/model"], "not found"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    # not a range message for inf / nan
    (["--temperature", "inf"], "--temperature must be finite, got inf"),
    (["-t", "nan"], "--temperature must be finite, got nan"),
    (["--top-p", "nan"], "--top-p must be finite, got nan"),
    (["--min-p=-inf"], "--min-p must be finite, got -inf"),
    (["--repetition-penalty", "inf"], "--repetition-penalty must be finite, got inf"),
    # the library's Python names come out as the flags
    (["--max-model-len", "10000000"], "--max-model-len 10000000 is longer than the model's context"),
    (["--prompt", "one two three four five six"], "tokens (--max-model-len)"),  # with --max-model-len 4: below
])
def test_errors_are_one_line(cli, tiny_model_dir, args, needle):  # noqa: F811
    if "--prompt" in args:
        args = [*args, "--max-model-len", "4"]
    code, _, err = cli("generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "Hi", *args)
    assert code == 2
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if "error" in line]
    assert len(error_lines) == 1 and needle in error_lines[0], err
    assert "_" not in error_lines[0].replace("max_position_embeddings", ""), err  # no Python name left


def test_device_errors_name_the_flag(cli, tiny_model_dir, monkeypatch):  # noqa: F811
    """`--device cuda` without a GPU: the CLI's words (`--device cpu`), not the library's (`device='cpu'`)."""
    import xserv.runtime

    monkeypatch.setattr(xserv.runtime, "cuda_available", lambda: False)
    code, _, err = cli("generate", "--model", str(tiny_model_dir), "--device", "cuda", "--prompt", "Hi")
    assert code == 2 and "use --device cpu" in err and "device=" not in err, err


def test_chat_says_the_context_is_full(cli, scripted_model):  # noqa: F811
    """A chat answer cut by the context's end says so (and how to go on); a turn that no longer fits names the flag
    that sets the context."""
    from xserv.tokenizer import Tokenizer

    prompt = Tokenizer.from_folder(scripted_model.path).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=False)
    context = len(Tokenizer.from_folder(scripted_model.path).encode(prompt)) + 2
    code, out, err = cli("chat", "--model", str(scripted_model.path), "--device", "cpu", "-t", "0", "--ignore-eos",
                         "--no-enable-thinking", "--max-model-len", str(context), stdin="hi\nhi again\n/exit\n")
    assert code == 0, err
    assert f"[stopped: the context of {context} tokens is full; /reset starts over]" in err, err
    assert "(--max-model-len) and at least one must be left to generate (/reset starts over)" in out, out


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("option, value", [
    ("--max-num-seqs", "0"), ("--max-num-seqs", "-3"), ("--max-model-len", "0"), ("--kv-cache-tokens", "-1"),
    ("--max-num-batched-tokens", "0"), ("--prefill-graph-tokens", "-1"), ("--gpu-memory-fraction", "0"),
    ("--gpu-memory-fraction", "1.5"), ("--gpu-memory-fraction", "nan"),
])
def test_engine_sizes_out_of_range_are_usage_errors(cli, tiny_model_dir, command, option, value):  # noqa: F811
    """Not silently the default (`--max-num-seqs 0` once meant 256): argparse's usage error naming the option, before
    the model loads."""
    prompt = ["--prompt", "Hi"] if command == "generate" else []
    code, _, err = cli(command, "--model", str(tiny_model_dir), "--device", "cpu", *prompt, option, value,
                       stdin="/exit\n")
    assert code == 2 and f"argument {option}: must be" in err, err
    assert "loading" not in err and "Traceback" not in err, err


def test_unsupported_architecture(cli, tiny_model_dir, tmp_path):  # noqa: F811
    import json
    import shutil

    folder = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Qwen2MoeForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("generate", "--model", str(folder), "--device", "cpu", "--prompt", "Hi")
    assert code == 2 and "Qwen2MoeForCausalLM" in err and "Traceback" not in err


def test_chat_without_model_says_weights_are_random(cli, tiny_model_dir):  # noqa: F811
    code, _, err = cli("chat", "--device", "cpu", "--max-tokens", "4", stdin="/exit\n")
    assert code == 0, err
    assert "RANDOM" in err


def test_help_lists_commands_and_options(capsys):
    parser = build_parser()
    help_text = parser.format_help()
    assert "generate" in help_text and "chat" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                 "--seed", "--stop", "--ignore-eos", "--device", "--chat", "--enable-thinking", "--prompt-file"):
        assert flag in out


def test_version(cli, monkeypatch):
    import importlib.metadata
    import re

    import xserv

    code, out, err = cli("--version")
    assert code == 0 and out == f"xserv {importlib.metadata.version('xserv')}\n", (out, err)
    assert re.fullmatch(r"xserv \d+\.\d+\.\d+\S*\n", out), out

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # a source tree run without an install
    assert cli("--version")[:2] == (0, f"xserv {xserv.__version__}\n")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_help_names_the_real_defaults(command):
    """An option left out takes the model's generation_config.json value (Qwen3: temperature 0.6, top-p 0.95,
    top-k 20), else SamplingParams' default: the help says both."""
    from xserv.sampling import SamplingParams

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    helps = {a.dest: a.help for a in sub._actions}
    d = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert f"default: the model's generation_config.json, else {getattr(d, name)}" in helps[name], helps[name]
    assert "fresh" in helps["seed"]  # unseeded sampling differs from run to run


def test_chat_ctrl_c_stops_the_answer_not_the_session(tiny_model_dir):  # noqa: F811
    import signal
    import threading
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # SIGINT back to its default in the child: a test run started in the background of a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler (Ctrl-C would do nothing)
    proc = subprocess.Popen([sys.executable, "-m", "xserv", "chat", "--model", str(tiny_model_dir), "--device", "cpu",
                             "--max-tokens", "3000", "--ignore-eos", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(what, done, timeout=60):
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done(), f"{what}: {''.join(chunks)[-300:]!r}"

    def answer_then_interrupt(message):
        """Send a message, wait until its answer streams, Ctrl-C it, wait for the next prompt."""
        start = len(chunks)
        proc.stdin.write(message + "\n")
        proc.stdin.flush()
        wait_for("no streamed answer", lambda: len(chunks) >= start + 20)  # 3000 tokens: still streaming
        interrupted_at = len(chunks)
        proc.send_signal(signal.SIGINT)
        wait_for("no prompt after Ctrl-C", lambda: ">>> " in "".join(chunks[interrupted_at:]))

    try:
        wait_for("no first prompt", lambda: ">>> " in "".join(chunks))
        answer_then_interrupt("Tell me a long story")
        answer_then_interrupt("Another one")
        proc.stdin.write("/exit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.count("interrupted") == 2 and "Traceback" not in err, err


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "eighty"])
def test_serve_port_out_of_range_is_a_usage_error(cli, monkeypatch, port):
    """`xserv serve --port 99999` listened on 34463 (99999 modulo 65536) without a word, and port 0
    means any free one: a port outside 1-65535 is argparse's usage error naming --port, before anything loads.
    The server itself is stubbed out: with the fault, the stub runs and the command succeeds."""
    import xserv.server.cli

    monkeypatch.setattr(xserv.server.cli, "cmd_serve", lambda args: 0)
    code, _, err = cli("serve", "--device", "cpu", "--port", port)
    assert code == 2 and "argument --port:" in err and port in err, err
    assert "loading" not in err and "Traceback" not in err, err


def test_serve_port_range_ends_are_accepted():
    parser = build_parser()
    assert [parser.parse_args(["serve", "--port", p]).port for p in ("1", "65535")] == [1, 65535]
    assert parser.parse_args(["serve"]).port == 8000


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:port",
                                 "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://"])
def test_bench_serve_url_with_a_bad_port_is_a_usage_error(cli, monkeypatch, url):
    """`xserv bench serve --url http://127.0.0.1:99999` got as far as the HTTP client's own error: a URL that is not
    http(s)://HOST[:PORT] with a port in 1-65535 is argparse's usage error naming --url. The benchmark itself is
    stubbed out: with the fault, the stub runs and the command succeeds."""
    import xserv.bench.serve

    monkeypatch.setattr(xserv.bench.serve, "run", lambda args: 0)
    code, _, err = cli("bench", "serve", "--url", url, "--num-prompts", "1")
    assert code == 2 and "argument --url:" in err, err
    assert "Traceback" not in err, err


def test_chat_with_a_hybrid_shows_the_reasoning_the_template_opened(cli, tmp_path):
    """Qwen3.5's template opens `<think>` in the prompt: the answer starts inside the reasoning, and the chat shows
    the opening tag before it (as a Qwen3 answer shows its own); without thinking the template closes the block
    itself and nothing is added."""
    from xserv.models.random_checkpoint import make_test_model

    folder = str(make_test_model("qwen3.5-tiny", tmp_path / "hybrid"))
    code, out, err = cli("chat", "--model", folder, "--device", "cpu", "--max-tokens", "2", stdin="hi\n/exit\n")
    assert code == 0 and "Traceback" not in err, err
    assert out.split(">>> ")[1].startswith("<think>\n"), out
    code, out, err = cli("chat", "--model", folder, "--device", "cpu", "--max-tokens", "2", "--no-enable-thinking",
                         stdin="hi\n/exit\n")
    assert code == 0 and not out.split(">>> ")[1].startswith("<think>"), out
