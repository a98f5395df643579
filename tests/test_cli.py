"""`xserv generate` and `xserv chat` as a user runs them (subprocesses, tiny model, CPU)."""
import os
import subprocess
import sys

import pytest

from qwen3_reference import tiny_model_dir  # noqa: F401

from xserv.cli import build_parser


def xserv(*args, stdin=None, timeout=120, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "xserv", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_prints_text(tiny_model_dir):  # noqa: F811
    r = xserv("generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "Hello",
              "--max-tokens", "16", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    again = xserv("generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "Hello",
                  "--max-tokens", "16", "--temperature", "0")
    assert again.stdout == r.stdout


def test_generate_without_a_model_uses_the_bundled_tiny_one(tmp_path):
    r = xserv("generate", "--device", "cpu", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
              env={"XSERV_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "RANDOM" in r.stderr and r.stdout.strip()
    assert (tmp_path / "models" / "tiny-random" / "config.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (["--model", "/no/such/model"], "not found"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
])
def test_errors_are_one_line(tiny_model_dir, args, needle):  # noqa: F811
    base = ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "Hi"]
    r = xserv(*base, *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    error_lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and needle in error_lines[0], r.stderr


def test_unsupported_architecture(tiny_model_dir, tmp_path):  # noqa: F811
    import json
    import shutil

    folder = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    r = xserv("generate", "--model", str(folder), "--device", "cpu", "--prompt", "Hi")
    assert r.returncode == 2 and "Qwen3MoeForCausalLM" in r.stderr and "Traceback" not in r.stderr


def test_chat_session(tiny_model_dir):  # noqa: F811
    script = "Hello\n/system You are terse.\nHow are you?\n/reset\n/bogus\nAgain\n/exit\n"
    r = xserv("chat", "--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "8", "--temperature", "0",
              stdin=script)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tok/s") == 3
    assert "system prompt set" in r.stdout and "conversation reset" in r.stdout and "unknown command" in r.stdout


def test_chat_without_model_says_weights_are_random(tiny_model_dir):  # noqa: F811
    r = xserv("chat", "--device", "cpu", "--max-tokens", "4", stdin="/exit\n")
    assert r.returncode == 0, r.stderr
    assert "RANDOM" in r.stderr


def test_help_lists_commands_and_options(capsys):
    parser = build_parser()
    help_text = parser.format_help()
    assert "generate" in help_text and "chat" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                 "--seed", "--device", "--chat", "--enable-thinking"):
        assert flag in out


def test_chat_ctrl_c_stops_the_answer_not_the_session(tiny_model_dir):  # noqa: F811
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "xserv", "chat", "--model", str(tiny_model_dir), "--device", "cpu",
                             "--max-tokens", "3000", "--ignore-eos", "--temperature", "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    import threading

    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        proc.stdin.write("Tell me a long story\n")
        proc.stdin.flush()
        deadline = time.time() + 60
        while len(chunks) < 20 and time.time() < deadline:  # the answer is streaming
            time.sleep(0.05)
        assert len(chunks) >= 20, "no streamed output"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write("Another one\n")
        proc.stdin.flush()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write("/exit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.count("interrupted") == 2 and "Traceback" not in err, err
