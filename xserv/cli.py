"""The `xserv` command: `xserv generate` (one shot to stdout), `xserv chat` (interactive, streaming),
`xserv serve` (OpenAI-compatible HTTP server), `xserv bench throughput|latency|serve` and `xserv make-test-model`
(a model folder with random weights).

Errors a user can fix (a bad model path, an unsupported architecture, an invalid sampling value) print one line
and exit with status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from .model_options import add_model_args, load_llm

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE

CHAT_HELP = """\
commands:  /reset         forget the conversation
           /system TEXT   set the system prompt (and forget the conversation)
           /exit          quit (also Ctrl-D)
           Ctrl-C         stop the current answer (the session goes on)"""


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    from .sampling import SamplingParams

    d = SamplingParams()

    def model_default(value, meaning=""):  # what _sampling_params does with an option left out
        return f"default: the model's generation_config.json, else {value}{meaning}"

    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", "-t", type=float, default=None, metavar="T",
                   help=f"0 = greedy ({model_default(d.temperature)})")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help=f"nucleus sampling, in (0, 1] ({model_default(d.top_p, ' = off')})")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"keep the K most likely tokens ({model_default(d.top_k, ' = off')})")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help=f"drop tokens below P x the top probability ({model_default(d.min_p, ' = off')})")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help=f"> 1 discourages repeats ({model_default(d.repetition_penalty, ' = off')})")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for reproducible output (default: a fresh one each run)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable); the text is not printed")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="let the chat template open a <think> block (Qwen3's thinking mode; default on)")


def version() -> str:
    """The installed distribution's version (package metadata), else the source tree's xserv.__version__."""
    from importlib import metadata

    try:
        return metadata.version("xserv")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from . import __version__

        return __version__


class _VersionAction(argparse.Action):
    """`--version`: reads the package metadata only when asked (argparse's own action wants the text up front)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"xserv {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xserv", description="xserv: a Qwen3 inference engine with its own CUDA kernels.",
        epilog="Run `xserv COMMAND --help` for a command's options.")
    parser.add_argument("--version", action=_VersionAction, help="print xserv's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it",
                         description="Generate a completion for one prompt and print it to stdout.",
                         epilog="examples:\n"
                                "  xserv generate -m ./Qwen3-8B --prompt 'The capital of France is' --temperature 0\n"
                                "  xserv generate -m Qwen/Qwen3-0.6B --chat --no-enable-thinking -p 'Write a haiku'\n"
                                "  xserv generate -m ./Qwen3-8B --prompt-file article.txt --max-tokens 200 | less",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(gen, max_num_seqs=8)
    source = gen.add_argument_group("prompt (one of)").add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", help="the prompt text")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="read the prompt from a UTF-8 file, used as is (a final newline is part of it); "
                             "'-' reads standard input")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                     help="wrap the prompt as a user message in the model's chat template (default: plain text)")
    _add_sampling_args(gen, max_tokens=256)

    chat = sub.add_parser("chat", help="chat with a model in the terminal (streams answers)",
                          description="Chat with a model in the terminal: answers stream as they are generated, "
                                      "the conversation is kept through the chat template.\n\n" + CHAT_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(chat, max_num_seqs=8)
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    _add_sampling_args(chat, max_tokens=1024)

    from .server import options as server_options

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                           description="An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                       "/v1/models, /health, /metrics) with streaming.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(serve)
    server_options.add_serve_arguments(serve)

    from .bench import options as bench_options

    bench = sub.add_parser("bench", help="measure throughput, latency or a running server",
                           description="Benchmarks: `throughput` (offline batch), `latency` (batch-1 decode and "
                                       "time to first token), `serve` (HTTP streaming clients against a server).")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for name, help_text, wants_model in bench_options.BENCHMARKS:
        b = bench_sub.add_parser(name, help=help_text, description=help_text)
        if wants_model:
            add_model_args(b)
        bench_options.add_arguments(name, b)

    from .models import make_test_model

    info = sub.add_parser("info", help="print the GPU, kernel path, library versions and kernel cache (for bug reports)",
                          description="Print what a bug report needs: the GPU and its compute capability, the kernel "
                                      "target and path xserv picks (XSERV_ARCH), driver / NVRTC / nvJitLink / cuBLAS "
                                      "versions, free memory, the kernel cache and whether the start-up kernels are "
                                      "in it. Works without a GPU.")
    info.add_argument("--json", action="store_true", help="print it as JSON")

    maker = sub.add_parser("make-test-model", help="write a model folder with random weights at a preset's shapes",
                           description=make_test_model.DESCRIPTION,
                           epilog=make_test_model.EPILOG.format(prog="xserv make-test-model"),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    make_test_model.add_arguments(maker)
    return parser


def _sampling_params(args, folder=None):
    """The flags' sampling parameters; a flag left out takes the model folder's generation_config.json value
    (`folder`, once the model is resolved), else SamplingParams' default."""
    from .generation_config import sampling_defaults
    from .sampling import SamplingParams

    kw = {"max_tokens": args.max_tokens}
    defaults = sampling_defaults(folder) if folder is not None else {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop"):
        value = getattr(args, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kw[name] = value
    if args.ignore_eos:
        kw["ignore_eos"] = True
    return SamplingParams(**kw)


def read_prompt(args) -> str:
    """--prompt's text, or --prompt-file's content as is ('-': standard input)."""
    if args.prompt_file is None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    path = Path(args.prompt_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found (or not a file): {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def length_note(output, max_tokens: int, max_model_len: int) -> str | None:
    """What cut a reply whose finish_reason is "length": --max-tokens, or the context (--max-model-len, or the
    model's own context) being full; None for any other ending."""
    if output.finish_reason != "length":
        return None
    num_output = len(output.token_ids)
    if num_output < max_tokens and len(output.prompt_token_ids) + num_output >= max_model_len:
        return f"stopped: the context of {max_model_len} tokens is full"
    return f"stopped: --max-tokens {max_tokens} reached"


def cmd_generate(args) -> int:
    _sampling_params(args)  # bad values are reported before the model loads
    prompt = read_prompt(args)
    llm = load_llm(args)
    params = _sampling_params(args, llm.folder)
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}], enable_thinking=args.enable_thinking)
    stream = llm.stream(prompt, params)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    note = length_note(stream.output, params.max_tokens, llm.max_model_len)
    if note:
        print(f"[{note}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    _sampling_params(args)  # bad values are reported before the model loads
    llm = load_llm(args)
    params = _sampling_params(args, llm.folder)
    model = llm.folder
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    system = args.system
    history: list[dict] = []
    print(f"xserv chat: {model} on {llm.device}. Type a message; /exit to quit, Ctrl-C stops an answer.\n"
          f"{CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            print("(conversation reset)")
            continue
        if text == "/system" or text.startswith("/system "):
            system = text[len("/system"):].strip() or None
            history.clear()
            print(f"(system prompt {'set' if system else 'cleared'}; conversation reset)")
            continue
        if text in ("/help", "/?"):
            print(CHAT_HELP)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; /help lists the commands")
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        try:
            prompt = llm.chat_prompt(messages, enable_thinking=args.enable_thinking)
            stream = llm.stream(prompt, params)
        except ValueError as e:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"xserv: {cli_words(str(e), getattr(args, 'option_flags', {}))} (/reset starts over)")
            continue
        answer, interrupted, start = [], False, time.perf_counter()
        if prompt.rstrip().endswith("<think>"):  # the template opened the reasoning (Qwen3.5's thinking mode): show it
            answer.append("<think>\n")
            sys.stdout.write(answer[0])
        try:
            for delta in stream:
                answer.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            interrupted = True
            stream.close()
        elapsed = time.perf_counter() - start
        # the answer's line ends on stdout, not on stderr: a reader of piped stdout gets one answer per line
        sys.stdout.write("\n")
        sys.stdout.flush()
        n = stream.num_tokens
        history.append({"role": "assistant", "content": "".join(answer)})
        note = "interrupted, " if interrupted else ""
        rate = n / elapsed if elapsed > 0 else 0.0
        print(f"[{note}{n} tokens, {rate:.1f} tok/s]", file=sys.stderr, flush=True)
        stopped = None if interrupted else length_note(stream.output, params.max_tokens, llm.max_model_len)
        if stopped:
            hint = "; /reset starts over" if "context" in stopped else ""
            print(f"[{stopped}{hint}]", file=sys.stderr, flush=True)


def cmd_make_test_model(args) -> int:
    from .models.make_test_model import run

    try:
        return run(args)
    except (FileExistsError, IsADirectoryError) as e:  # the others of OSError's kind that a user fixes: main's
        print(f"xserv: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush of the dead pipe raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout file descriptor (e.g. replaced in a test): nothing to silence
        pass


def option_flags(parser: argparse.ArgumentParser, args) -> dict[str, str]:
    """{Python name: long flag} of the options of the command `args` ran (`bench X` included), e.g.
    {"max_model_len": "--max-model-len", "device": "--device"}."""
    flags: dict[str, str] = {}
    for name in (getattr(args, "command", None), getattr(args, "bench_command", None)):
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or name not in sub.choices:
            break
        parser = sub.choices[name]
        for action in parser._actions:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long and action.dest != "help":
                flags.setdefault(action.dest, long[0])
    return flags


def cli_words(message: str, flags: dict[str, str]) -> str:
    """A library message in the command line's words, for the options in `flags`: `device='cpu'` -> `--device
    cpu`; a Python name with an underscore (`max_model_len`) -> its flag; a message that starts with an option's
    name ("temperature must be ...") starts with its flag."""
    import re

    if not flags:
        return message
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    message = re.sub(rf"(?<![\w.-])({names})=(['\"]?)([\w.+-]*)\2",
                     lambda m: f"{flags[m.group(1)]} {m.group(3)}", message)
    message = re.sub(rf"(?<![\w.-])({names})(?![\w=-])",
                     lambda m: flags[m.group(1)] if "_" in m.group(1) else m.group(1), message)
    return re.sub(rf"^({names}) must ", lambda m: f"{flags[m.group(1)]} must ", message)


class _NoticeHandler(logging.Handler):
    """Prints the library's notices (logger "xserv": no GPU found, the bundled model, FP8 weights dequantized at
    load, loading ...) to stderr as `xserv: MESSAGE`. It looks up sys.stderr at each notice, not once: a caller
    may have replaced it since (a test capturing it, say)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"xserv: {self.format(record)}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's rule: a failing handler reports, never raises
            self.handleError(record)


def _print_library_notices() -> None:
    """The command line shows what the library says at INFO and above; once per process (main may run again)."""
    logger = logging.getLogger("xserv")
    if not any(isinstance(h, _NoticeHandler) for h in logger.handlers):
        logger.addHandler(_NoticeHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    args.option_flags = option_flags(parser, args)
    _print_library_notices()
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            from .server.cli import cmd_serve

            return cmd_serve(args)
        if args.command == "make-test-model":
            return cmd_make_test_model(args)
        if args.command == "info":
            from .info import main as info_main

            return info_main(as_json=args.json)
        if args.command == "bench":
            from .bench import options as bench_options

            if args.bench_command is None:
                parser.parse_args(["bench", "--help"])
            return bench_options.run(args)
        parser.error(f"unknown command {args.command}")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`xserv generate ... | head`): stop quietly, like other tools
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"xserv: error: {cli_words(str(e), args.option_flags)}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:
        print(f"xserv: error: {cli_words(str(e), args.option_flags)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
