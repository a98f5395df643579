"""`xserv bench throughput` and `xserv bench latency` as a user runs them (the tiny model on the CPU), through
xserv.cli.main in this process: what `python -m xserv` adds (the process, its exit status) is tested once in
test_cli.py, and a subprocess per benchmark cost ~1.3 s of CPU apiece in start-up alone."""
import json

import pytest

from qwen3_reference import tiny_model_dir  # noqa: F401

from xserv.bench.throughput import make_workload
from xserv.cli import main


@pytest.fixture
def bench(tiny_model_dir, capsys):  # noqa: F811
    """Run `xserv bench KIND --model TINY --device cpu ARGS` in this process: (exit status, stdout, stderr)."""
    def run(kind, *args):
        capsys.readouterr()
        try:
            code = main(["bench", kind, "--model", str(tiny_model_dir), "--device", "cpu", *args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_workload_matches_nano_vllm_bench_recipe():
    import random

    prompts, outs = make_workload(3, (5, 9), (2, 4), seed=0, vocab=151936)
    rng = random.Random(0)  # nano-vllm's bench.py: seed(0), prompts first, then the output lengths
    want = [[rng.randint(0, 10000) for _ in range(rng.randint(5, 9))] for _ in range(3)]
    assert prompts == want and outs == [rng.randint(2, 4) for _ in range(3)]


def test_throughput_on_cpu_writes_json(bench, tmp_path):
    out = tmp_path / "tp.json"
    code, stdout, err = bench("throughput", "--num-seqs", "3", "--input-len", "5:9", "--output-len", "2:4",
                              "--temperature", "0.6", "--top-k", "20", "--json", str(out))
    assert code == 0, err
    res = json.loads(out.read_text())
    _, outs = make_workload(3, (5, 9), (2, 4), seed=0, vocab=151936)
    assert res["output_tokens"] == sum(outs) and res["num_seqs"] == 3
    assert res["output_tokens_per_s"] > 0 and res["total_tokens_per_s"] > res["output_tokens_per_s"]
    assert abs(res["output_tokens_per_s"] * res["elapsed_s"] - res["output_tokens"]) < 1e-6 * res["output_tokens"] + 1e-9
    assert res["device"].startswith("cpu") and "output" in stdout and "tok/s" in stdout


def test_latency_on_cpu(bench, tmp_path):
    out = tmp_path / "lat.json"
    code, stdout, err = bench("latency", "--input-len", "16", "--output-len", "4", "--iters", "2", "--json", str(out))
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["ttft_ms"] > 0 and res["decode_tokens_per_s"] > 0 and res["input_len"] == 16


def test_bad_range_is_a_usage_error(bench):
    code, stdout, err = bench("throughput", "--input-len", "9:5")
    assert code == 2 and "MIN <= MAX" in err and "Traceback" not in err


def test_latency_with_a_shared_prefix_hits_the_cache(bench, tmp_path):
    out = tmp_path / "lat.json"
    code, stdout, err = bench("latency", "--input-len", "5", "--output-len", "2", "--iters", "3", "--shared-prefix",
                              "40", "--json", str(out))
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["cached_tokens_each"] == [0, 32, 32]  # two full blocks of 16 of the 40 shared tokens
    assert "shared prefix" in stdout


def test_throughput_plot(bench, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    code, stdout, err = bench("throughput", "--num-seqs", "2", "--input-len", "5", "--output-len", "3", "--plot",
                              str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("setting", ["NO_SUCH=1", "MMA_PREFERRED=1", "ROW_SHORT_K_FILL=a,b"])
def test_bench_decode_rejects_a_bad_gemv_setting(capsys, setting):
    """tools/bench_decode --gemv-set NAME=v1,v2 takes numeric plan attributes of xserv.ops.gemv only, and says so
    before it loads a model."""
    from tools.bench_decode import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "/nowhere", "--gemv-set", setting])
    assert exc.value.code == 2 and "--gemv-set" in capsys.readouterr().err


def test_bench_serve_json_schema_sends_the_field(tmp_path, capsys):
    """--json-schema FILE: every request carries it as response_format json_schema; the answers are counted (a fake
    server: three answers parse and validate, one is not JSON). The real server's run is in test_server_structured."""
    import argparse
    import asyncio

    httpx = pytest.importorskip("httpx")
    from xserv.bench import serve

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        text = '{"a": 1}' if body["seed"] % 4 else "nope"
        chunks = [{"choices": [{"index": 0, "text": text[:3], "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": text[3:], "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"completion_tokens": 2}}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--num-prompts", "4", "--input-len", "3", "--output-len", "5", "--json-schema", str(path)])
    prompts, lens = make_workload(4, (3, 3), (5, 5), seed=0, vocab=151936)
    results, elapsed = asyncio.run(serve.run_clients(args, prompts, lens, "m", transport=httpx.MockTransport(handler)))
    assert len(bodies) == 4
    for b in bodies:
        assert b["response_format"] == {"type": "json_schema",
                                        "json_schema": {"name": "bench", "schema": schema, "strict": True}}
        assert b["ignore_eos"] is False and b["stream"] is True
    counts = serve.count_answers(results, schema)
    assert counts["answers_parsed"] == 3
    assert counts["answers_valid"] == (3 if counts["answers_valid"] is not None else None)
    # without the option: no response_format, EOS ignored as before
    bodies.clear()
    args = p.parse_args(["--num-prompts", "2", "--input-len", "3", "--output-len", "5"])
    asyncio.run(serve.run_clients(args, prompts[:2], lens[:2], "m", transport=httpx.MockTransport(handler)))
    assert all("response_format" not in b and b["ignore_eos"] is True for b in bodies)
    with pytest.raises(ValueError, match="--json-schema"):
        serve.load_schema(str(tmp_path / "missing.json"))
