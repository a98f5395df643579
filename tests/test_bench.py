"""`xserv bench throughput` and `xserv bench latency` as a user runs them (subprocess, tiny model, CPU)."""
import json
import os
import subprocess
import sys

from qwen3_reference import tiny_model_dir  # noqa: F401

from xserv.bench.throughput import make_workload


def xserv(*args):
    return subprocess.run([sys.executable, "-m", "xserv", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_workload_matches_nano_vllm_bench_recipe():
    import random

    prompts, outs = make_workload(3, (5, 9), (2, 4), seed=0, vocab=151936)
    rng = random.Random(0)  # nano-vllm's bench.py: seed(0), prompts first, then the output lengths
    want = [[rng.randint(0, 10000) for _ in range(rng.randint(5, 9))] for _ in range(3)]
    assert prompts == want and outs == [rng.randint(2, 4) for _ in range(3)]


def test_throughput_on_cpu_writes_json(tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "tp.json"
    r = xserv("bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--num-seqs", "3",
              "--input-len", "5:9", "--output-len", "2:4", "--temperature", "0.6", "--top-k", "20", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    _, outs = make_workload(3, (5, 9), (2, 4), seed=0, vocab=151936)
    assert res["output_tokens"] == sum(outs) and res["num_seqs"] == 3
    assert res["output_tokens_per_s"] > 0 and res["total_tokens_per_s"] > res["output_tokens_per_s"]
    assert abs(res["output_tokens_per_s"] * res["elapsed_s"] - res["output_tokens"]) < 1e-6 * res["output_tokens"] + 1e-9
    assert res["device"].startswith("cpu") and "output" in r.stdout and "tok/s" in r.stdout


def test_latency_on_cpu(tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "lat.json"
    r = xserv("bench", "latency", "--model", str(tiny_model_dir), "--device", "cpu", "--input-len", "16",
              "--output-len", "4", "--iters", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["ttft_ms"] > 0 and res["decode_tokens_per_s"] > 0 and res["input_len"] == 16


def test_bad_range_is_a_usage_error(tiny_model_dir):  # noqa: F811
    r = xserv("bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--input-len", "9:5")
    assert r.returncode == 2 and "MIN <= MAX" in r.stderr and "Traceback" not in r.stderr


def test_latency_with_a_shared_prefix_hits_the_cache(tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "lat.json"
    r = xserv("bench", "latency", "--model", str(tiny_model_dir), "--device", "cpu", "--input-len", "5",
              "--output-len", "2", "--iters", "3", "--shared-prefix", "40", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["cached_tokens_each"] == [0, 32, 32]  # two full blocks of 16 of the 40 shared tokens
    assert "shared prefix" in r.stdout


def test_throughput_plot(tiny_model_dir, tmp_path):  # noqa: F811
    import pytest

    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    r = xserv("bench", "throughput", "--model", str(tiny_model_dir), "--device", "cpu", "--num-seqs", "2",
              "--input-len", "5", "--output-len", "3", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
