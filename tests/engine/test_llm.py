"""The library API on the tiny model (NumPy backend), and CUDA against NumPy on the GPU."""
import logging

import numpy as np
import pytest

from batch_shape import assert_same_run
from qwen3_reference import rel_err_rows, tiny_model_dir  # noqa: F401
from xserv import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):  # noqa: F811
    return LLM(str(tiny_model_dir), device="cpu", max_model_len=512, progress=False)


def test_generate_prompt_forms(llm):
    one = llm.generate("Hello", GREEDY)
    assert len(one) == 1 and one[0].prompt == "Hello" and one[0].text and len(one[0].token_ids) == 16
    assert one[0].prompt_token_ids == llm.tokenizer.encode("Hello")
    many = llm.generate(["Hello", "The sky is"], GREEDY)
    assert_same_run(many[0], one[0], GREEDY, model=llm)  # beside another prompt: a batch shape apart
    ids = llm.generate([llm.tokenizer.encode("Hello")], GREEDY)
    assert ids[0].token_ids == one[0].token_ids and ids[0].prompt is None  # the same shapes: the same bits
    per_prompt = llm.generate(["Hello", "Hi"], [GREEDY, SamplingParams(temperature=0.0, max_tokens=3)])
    assert [len(o.token_ids) for o in per_prompt] == [16, 3]


def test_stream_equals_generate(llm):
    full = llm.generate("Hello there", GREEDY)[0]
    deltas = list(llm.stream("Hello there", GREEDY))
    assert "".join(deltas) == full.text and len(deltas) > 1
    stop = full.text[len(full.text) // 2:][:2]
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])
    stopped = llm.generate("Hello there", params)[0]
    assert "".join(llm.stream("Hello there", params)) == stopped.text
    assert stop not in stopped.text


def test_stream_closed_early_frees_the_request(llm):
    stream = llm.stream("Hello", SamplingParams(temperature=0.0, max_tokens=50))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free == llm.kv_cache.num_blocks


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, GREEDY, enable_thinking=False)[0]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert out.prompt == prompt and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "Hello"},
                                          {"role": "user", "content": "Bye"}]], GREEDY)
    assert len(two) == 2


def test_logits_shape_and_invalid_input(llm):
    logits = llm.logits([9707, 11, 1879])
    assert logits.shape == (3, llm.config.vocab_size) and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    with pytest.raises(ValueError, match="513 tokens"):
        llm.logits(list(range(513)))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[llm.config.vocab_size]], GREEDY)


def test_bad_arguments(tiny_model_dir, tmp_path):  # noqa: F811
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nothing"), device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dir), device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


@pytest.mark.gpu
def test_cuda_logits_match_numpy(tiny_model_dir):  # noqa: F811
    prompt = list(np.random.default_rng(0).integers(0, 151936, 70))
    cpu = LLM(str(tiny_model_dir), device="cpu", max_model_len=512, progress=False)
    gpu = LLM(str(tiny_model_dir), device="cuda", max_model_len=512, kv_cache_tokens=4096, progress=False)
    ref = cpu.logits(prompt)
    out = gpu.logits(prompt)
    assert rel_err_rows(out, ref).max() <= 1e-2

    # decode steps (CUDA graphs) against the NumPy logits of the same tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = gpu.generate([prompt], params)[0]
    ref_full = cpu.logits(prompt + got.token_ids[:-1])
    picked = ref_full[len(prompt) - 1:]
    top2 = np.sort(picked, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(top2[:, 1]).max()
    assert all(t == r for t, r, c in zip(got.token_ids, np.argmax(picked, -1), clear) if c)


@pytest.mark.gpu
def test_cuda_greedy_generation_and_graph_decode(tiny_model_dir):  # noqa: F811
    from xserv.engine.batch import SeqChunk, make_batch

    gpu = LLM(str(tiny_model_dir), device="cuda", max_model_len=512, kv_cache_tokens=8192, progress=False)
    assert gpu.runner.graphs  # decode steps replay CUDA graphs
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello", "The capital of France is", "1 2 3 4"]
    outs = gpu.generate(prompts, params)
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" and o.text for o in outs)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [o.token_ids for o in outs]  # deterministic

    # a 3-sequence decode step from its graph (padded to the bucket of 4) against the same step run eagerly
    from xserv.engine.sequence import Sequence

    kv, runner, blocks = gpu.kv_cache, gpu.runner, gpu.engine.blocks
    seqs = []
    for i, o in enumerate(outs):
        s = Sequence(1000 + i, o.prompt_token_ids + o.token_ids, params, seed=0, stop_ids=frozenset())
        s.block_table, s.slot, s.num_computed = blocks.allocate(blocks.blocks_for(s.num_tokens)), i, s.num_tokens - 1
        seqs.append(s)
    runner.forward([SeqChunk(s.token_ids[:-1], 0, s.block_table, "none") for s in seqs])
    graphed = runner.run([(s, 1) for s in seqs]).numpy().copy()
    step = [SeqChunk(s.token_ids[-1:], s.num_tokens - 1, s.block_table, "last") for s in seqs]
    eager = gpu.model.forward(make_batch(step, kv.block_size, "cuda"), kv).numpy()
    for s in seqs:
        blocks.free(s.block_table)
    assert rel_err_rows(graphed, eager).max() <= 1e-2


def test_two_streams_interleaved(llm):
    a_ref = llm.generate("Hello", GREEDY)[0].text
    b_ref = llm.generate("The sky is", GREEDY)[0].text
    a, b = llm.stream("Hello", GREEDY), llm.stream("The sky is", GREEDY)
    got_a, got_b = [], []
    for x, y in zip(a, b):
        got_a.append(x)
        got_b.append(y)
    got_a += list(a)
    got_b += list(b)
    assert "".join(got_a) == a_ref and "".join(got_b) == b_ref


def _broken_model_folders(tiny_model_dir, root):  # noqa: F811
    """The tiny model's config and tokenizer beside a truncated, a garbage and no safetensors file, and its whole
    checkpoint under a config with one layer more (a load that fails inside the model, once the LLM's finalizer
    exists)."""
    import json

    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    folders = {}
    for kind in ("truncated", "garbage", "missing", "mismatched"):
        folder = root / kind
        folder.mkdir()
        for f in tiny_model_dir.glob("*.json"):
            (folder / f.name).write_bytes(f.read_bytes())
        if kind == "truncated":  # a valid header whose tensors run past the end of the file
            (folder / "model.safetensors").write_bytes(weights[:100_000])
        elif kind == "garbage":
            (folder / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(5000))
        elif kind == "mismatched":
            (folder / "model.safetensors").write_bytes(weights)
            config = json.loads((folder / "config.json").read_text())
            config["num_hidden_layers"] += 1
            (folder / "config.json").write_text(json.dumps(config))
        folders[kind] = folder
    return folders


def test_a_failed_load_leaves_no_finalizer_error(tiny_model_dir, tmp_path):  # noqa: F811
    """A load that fails on its checkpoint (truncated, garbage, missing, not the config's) raises one error naming
    the file (or folder), and the half-built LLM goes quietly, in the library (the caller catches the error) and
    in the CLI. Red when the LLM's finalizer exists before the checkpoint is opened and assumes an engine thread:
    Python prints "Exception ignored in: <finalize ...> AttributeError: 'NoneType' object has no attribute 'stop'"
    at garbage collection, after the error."""
    import os
    import subprocess
    import sys

    folders = _broken_model_folders(tiny_model_dir, tmp_path)
    script = """if True:
        import gc, sys
        from xserv import LLM
        for folder in sys.argv[1:]:
            try:
                LLM(folder, device="cpu", progress=False)
            except (ValueError, FileNotFoundError) as e:
                print(f"{type(e).__name__}: {e}")
            else:
                print("loaded", folder)
            gc.collect()
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with subprocess.Popen([sys.executable, "-c", script, *map(str, folders.values())], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as library, \
         subprocess.Popen([sys.executable, "-m", "xserv", "generate", "--model", str(folders["truncated"]),
                           "--device", "cpu", "-p", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env) as cli:
        lib_out, lib_err = library.communicate(timeout=120)
        _, cli_err = cli.communicate(timeout=120)
    assert library.returncode == 0, lib_err
    assert "Exception ignored" not in lib_err and "Traceback" not in lib_err, lib_err
    lines = [line for line in lib_out.splitlines() if line.startswith(("ValueError", "FileNotFoundError", "loaded"))]
    assert len(lines) == len(folders), lib_out
    for kind, line in zip(folders, lines):
        file = folders[kind] / "model.safetensors" if kind in ("truncated", "garbage") else folders[kind]
        assert not line.startswith("loaded") and str(file) in line, (kind, line)
    assert cli.returncode != 0
    assert "Exception ignored" not in cli_err and "Traceback" not in cli_err, cli_err
    errors = [line for line in cli_err.splitlines() if "error" in line]
    assert len(errors) == 1 and str(folders["truncated"] / "model.safetensors") in errors[0], cli_err


def test_notices_go_to_the_xserv_logger(monkeypatch, caplog, capsys):
    """A library user hears xserv's notices through `logging` (logger "xserv") and silences them there; the command
    line prints them (test_cli.py). Red when a notice is printed to stderr directly."""
    import xserv.runtime
    from xserv.engine_builder import pick_device

    monkeypatch.setattr(xserv.runtime, "cuda_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="xserv"):
        assert pick_device(None) == "cpu"
    assert [(r.name, r.levelno) for r in caplog.records] == [("xserv", logging.WARNING)]
    assert "no CUDA GPU found; running on the CPU" in caplog.records[0].getMessage()
    capsys.readouterr()
    logger = logging.getLogger("xserv")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        assert pick_device(None) == "cpu"
    finally:
        logger.setLevel(level)
    assert capsys.readouterr().err == ""
