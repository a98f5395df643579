"""`xserv bench throughput` and `xserv bench latency` as a user runs them (the tiny model on the CPU), through
xserv.cli.main in this process: what `python -m xserv` adds (the process, its exit status) is tested once in
test_cli.py, and a subprocess per benchmark cost ~1.3 s of CPU apiece in start-up alone."""
import json

import numpy as np
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


def test_throughput_prints_progress_lines_when_stderr_is_not_a_terminal(bench, monkeypatch):
    """`xserv bench throughput` printed nothing while it ran when stderr was redirected (its tqdm bar is drawn only on
    a terminal): a run in a log looked hung. Off a terminal it prints plain progress lines (count, rate, time left;
    here one per step: the intervals are set to 0) and no carriage returns."""
    import re

    import xserv.bench.common

    monkeypatch.setattr(xserv.bench.common, "PROGRESS_FIRST_S", 0.0, raising=False)
    monkeypatch.setattr(xserv.bench.common, "PROGRESS_EVERY_S", 0.0, raising=False)
    code, stdout, err = bench("throughput", "--num-seqs", "3", "--input-len", "5:9", "--output-len", "2:4")
    assert code == 0, err
    total = sum(make_workload(3, (5, 9), (2, 4), seed=0, vocab=151936)[1])
    done = [int(m.group(1)) for m in re.finditer(rf"(\d+)/{total} output tokens .*tok/s", err)]
    assert len(done) >= 2 and done == sorted(done) and done[-1] == total, err
    assert "\r" not in err and "%|" not in err, err  # no tqdm bar off a terminal


def test_throughput_default_workload_is_scaled_to_the_cpu(bench, monkeypatch, tmp_path):
    """`xserv bench throughput` with the defaults ran the GPU's standard workload (256 requests of 100-1024 + 100-1024
    tokens) on the CPU too: half an hour and more. On the CPU the defaults are a small workload, said up front with a
    hint of the time it takes and of how to run the standard one; the GPU keeps the standard one. The workload is
    recorded, then a two-request one runs in its place (the test measures the choice, not the CPU)."""
    import xserv.bench.throughput as throughput

    asked = []

    def small_workload(num_seqs, input_len, output_len, seed, vocab):
        asked.append((num_seqs, input_len, output_len))
        return make_workload(2, (4, 4), (2, 2), seed, vocab)

    monkeypatch.setattr(throughput, "make_workload", small_workload)
    out = tmp_path / "tp.json"
    code, stdout, err = bench("throughput", "--json", str(out))
    assert code == 0, err
    assert len(asked) == 1
    num_seqs, input_len, output_len = asked[0]
    assert num_seqs * output_len[1] <= 2048, asked  # seconds for the tiny model, not half an hour
    assert asked[0] == throughput.CPU_WORKLOAD
    res = json.loads(out.read_text())
    assert (res["num_seqs"], tuple(res["input_len"]), tuple(res["output_len"])) == throughput.CPU_WORKLOAD
    lines = err.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("xserv bench throughput:"))
    assert said < next(i for i, line in enumerate(lines) if line.startswith("generating:")), err  # said up front
    assert f" {num_seqs} requests" in lines[said] and "expect" in lines[said] and "--num-seqs 256" in lines[said], err
    # an option given is kept; the others still take the CPU's defaults
    asked.clear()
    assert bench("throughput", "--num-seqs", "5")[0] == 0
    assert asked == [(5, input_len, output_len)]
    assert throughput.default_workload("cuda") == (256, (100, 1024), (100, 1024))  # nano-vllm's recipe


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


# ---- the limits of a mixture-of-experts model (CPU arithmetic; the GPU run: `bash tools/gpu.sh moe`) ----------
def _fake_model(num_experts=0, top_k=0, *, layers=4, hidden=64, inter=96, moe_inter=32, vocab=1000, heads=4,
                kv_heads=2, head_dim=16, tied=False, mlp_only=(), sparse_step=1):
    """A stand-in with what the benchmarks read: config sizes, weight_tensors() (only nbytes), and for a MoE config
    step_weight_bytes(x): every non-expert weight + x experts per sparse layer (HF's rule for which layers are)."""
    from types import SimpleNamespace

    moe = num_experts > 0
    config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                             tie_word_embeddings=tied)
    if moe:
        config.__dict__.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
                               mlp_only_layers=list(mlp_only), decoder_sparse_step=sparse_step, norm_topk_prob=True)
    sparse = [moe and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(layers)]
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 2 * head_dim + 2 * hidden
    expert = 3 * hidden * moe_inter  # gate, up, down
    nbytes = [2 * vocab * hidden] * (1 if tied else 2) + [2 * hidden]
    for s in sparse:
        mlp = [2 * hidden * num_experts] + [2 * expert] * num_experts if s else [2 * 3 * hidden * inter]
        nbytes += [2 * attn] + mlp
    fixed = sum(nbytes) - 2 * expert * num_experts * sum(sparse)
    model = SimpleNamespace(config=config, weight_tensors=lambda: [SimpleNamespace(nbytes=n) for n in nbytes])
    if moe:
        model.step_weight_bytes = lambda x: fixed + 2 * expert * x * sum(sparse)
    return model


def test_expected_touched_experts_is_uniform_routing():
    from xserv.bench.common import expected_touched_experts

    assert expected_touched_experts(128, 8, 1) == 8 and expected_touched_experts(128, 8, 0) == 0
    assert expected_touched_experts(16, 4, 3) == pytest.approx(16 * (1 - (3 / 4) ** 3))  # 9.25
    assert expected_touched_experts(128, 8, 4096) == pytest.approx(128)
    touched = [expected_touched_experts(128, 8, b) for b in (1, 2, 8, 64, 256)]
    assert touched == sorted(touched) and len(set(touched)) == len(touched) and touched[-1] < 128
    rng = np.random.default_rng(0)  # Monte Carlo: B tokens, each k distinct experts of E uniformly
    for e, k, b in ((16, 4, 3), (128, 8, 16), (128, 8, 64)):
        draws = [len(set(np.concatenate([rng.choice(e, k, replace=False) for _ in range(b)]))) for _ in range(2000)]
        assert np.mean(draws) == pytest.approx(expected_touched_experts(e, k, b), rel=0.02)


def test_moe_workload_limit_counts_the_experts_a_step_touches():
    from xserv.bench.common import expected_touched_experts, kv_bytes_per_token, workload_limit

    ceilings = {"copy_bytes_per_s": 1e12, "gemm_flops_per_s": 1e14}
    moe = _fake_model(16, 4)
    prompts, outs = [10, 20, 30], [3, 5, 5]
    got = workload_limit(moe, prompts, outs, ceilings)
    kv = kv_bytes_per_token(moe.config)
    embed = 2 * moe.config.vocab_size * moe.config.hidden_size  # a step reads one row of the untied input table
    want = 0.0  # steps 1..4: three live sequences at step 1 and 2, two at 3 and 4
    for s in range(1, 5):
        live = [(p, o) for p, o in zip(prompts, outs) if o > s]
        want += (moe.step_weight_bytes(expected_touched_experts(16, 4, len(live))) - embed
                 + kv * sum(p + s for p, _ in live))
    assert got["decode_s"] == pytest.approx(want / 1e12)
    assert got["moe"]["touched_experts"][1] == 4 and got["moe"]["routing"].startswith("uniform")
    # fewer bytes than a model that reads every expert every step, more than one reading only k
    dense_like = workload_limit(_fake_model(16, 16), prompts, outs, ceilings)
    assert got["decode_s"] < dense_like["decode_s"]
    # a MoE model whose every token takes every expert is limited as a dense model of those bytes (less the input
    # embedding table per step; with a tied one, exactly)
    for tied in (False, True):
        everything = _fake_model(16, 16, tied=tied)
        plain = _fake_model(16, 16, tied=tied)
        del plain.step_weight_bytes  # no step_weight_bytes: read as dense (all weights per step, all active)
        a, b = workload_limit(everything, prompts, outs, ceilings), workload_limit(plain, prompts, outs, ceilings)
        assert a["decode_s"] == pytest.approx(b["decode_s"] - (0 if tied else 4 * embed / 1e12))
        assert a["prefill_s"] == pytest.approx(b["prefill_s"]) and "moe" not in b


def test_limits_count_the_kv_caches_element_size():
    """An FP8 KV cache (1 byte an element) halves the K/V bytes the limits count; the weights' share is unchanged."""
    from xserv.bench.common import batch1_limits, kv_bytes_per_token, workload_limit

    ceilings = {"copy_bytes_per_s": 1e12, "gemm_flops_per_s": 1e14}
    m = _fake_model(16, 4)
    c = m.config
    per_layer_bf16 = 4 * c.num_key_value_heads * c.head_dim  # K and V, 2 bytes an element
    assert kv_bytes_per_token(c) == 2 * kv_bytes_per_token(c, 1) == c.num_hidden_layers * per_layer_bf16
    prompts, outs = [10, 20, 30], [3, 5, 5]
    bf16, fp8 = workload_limit(m, prompts, outs, ceilings), workload_limit(m, prompts, outs, ceilings, 1)
    kv_bf16 = sum(kv_bytes_per_token(c) * sum(p + s for p, o in zip(prompts, outs) if o > s) for s in range(1, 5))
    assert bf16["decode_s"] - fp8["decode_s"] == pytest.approx(kv_bf16 / 2 / 1e12)
    assert bf16["prefill_s"] == fp8["prefill_s"]
    a, b = batch1_limits(m, 512, 128, ceilings), batch1_limits(m, 512, 128, ceilings, 1)
    saved = kv_bytes_per_token(c, 1) * a["decode_mean_context"]
    assert a["decode_step_bytes"] - b["decode_step_bytes"] == pytest.approx(saved)


def test_moe_prefill_flops_count_active_parameters():
    from xserv.bench.common import active_weight_bytes, all_weight_bytes, prefill_flops

    m = _fake_model(16, 4, mlp_only=(1,))  # layers 0, 2, 3 sparse; layer 1 a dense MLP
    c = m.config
    expert_bytes = 2 * 3 * c.hidden_size * c.moe_intermediate_size
    assert active_weight_bytes(m) == all_weight_bytes(m) - 3 * (16 - 4) * expert_bytes
    embed = c.vocab_size * c.hidden_size
    layer_params = active_weight_bytes(m) // 2 - 2 * embed
    t = 100
    attn = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * t * t / 2
    assert prefill_flops(m, [t]) == pytest.approx(2 * layer_params * t + 2 * embed + attn)
    dense = _fake_model()  # a dense model's active parameters are all of them
    assert active_weight_bytes(dense) == all_weight_bytes(dense)


def test_moe_batch1_limits():
    from xserv.bench.common import batch1_limits, kv_bytes_per_token

    ceilings = {"copy_bytes_per_s": 1e12, "gemm_flops_per_s": 1e14}
    m = _fake_model(16, 4, sparse_step=2)
    lim = batch1_limits(m, 512, 129, ceilings)
    kv = kv_bytes_per_token(m.config)
    embed = 2 * m.config.vocab_size * m.config.hidden_size  # a step reads one row of the input embedding table
    assert lim["decode_mean_context"] == 512 + 64.5
    assert lim["decode_step_bytes"] == pytest.approx(m.step_weight_bytes(4) - embed + kv * (512 + 64.5))
    assert lim["decode_limit_tokens_per_s"] == pytest.approx(1e12 / lim["decode_step_bytes"])
    assert lim["decode_limit_tokens_per_s_with_embedding"] == pytest.approx(1e12 / (lim["decode_step_bytes"] + embed))
    assert lim["ttft_weight_read_s"] == pytest.approx((m.step_weight_bytes(16) - embed) / 1e12, rel=1e-6)  # all
    tied = batch1_limits(_fake_model(16, 4, tied=True), 512, 129, ceilings)  # the table is the lm_head: it stays
    assert tied["decode_step_bytes"] == pytest.approx(_fake_model(16, 4, tied=True).step_weight_bytes(4)
                                                      + kv * (512 + 64.5))
    assert "decode_limit_tokens_per_s_with_embedding" not in tied
    dense = _fake_model()  # a dense model: every weight, the table included (the standing figures' convention)
    assert batch1_limits(dense, 512, 129, ceilings)["decode_step_bytes"] == pytest.approx(
        sum(t.nbytes for t in dense.weight_tensors()) + kv_bytes_per_token(dense.config) * (512 + 64.5))


def test_moe_limits_at_qwen3_30b_a3b_shapes():
    """The published sizes of Qwen3-30B-A3B (30.5B parameters, 3.3B active) from its config's shapes."""
    from xserv.bench.common import active_weight_bytes, all_weight_bytes, decode_weight_bytes, step_weight_bytes

    m = _fake_model(128, 8, layers=48, hidden=2048, inter=6144, moe_inter=768, vocab=151936, heads=32, kv_heads=4,
                    head_dim=128)
    assert all_weight_bytes(m) / 2 == pytest.approx(30.5e9, rel=0.01)
    assert 3.3e9 <= active_weight_bytes(m) / 2 < 3.4e9  # published as 3.3B
    assert step_weight_bytes(m, 1) == active_weight_bytes(m)  # one token computes with what it reads
    assert step_weight_bytes(m, 256) == pytest.approx(all_weight_bytes(m), rel=1e-3)
    embed = 2 * 151936 * 2048
    assert decode_weight_bytes(m, 1) == active_weight_bytes(m) - embed  # a batch-1 step reads one embedding row


def test_moe_limits_of_the_real_model_class(tmp_path):
    """The same arithmetic through xserv's Qwen3-MoE model (skipped until xserv/models/qwen3_moe.py exists): the
    active bytes are all weights less (E - k) experts per sparse layer, and the limit of a workload is below the
    one that would read every expert every step."""
    pytest.importorskip("xserv.models.qwen3_moe")
    from xserv.bench.common import active_weight_bytes, all_weight_bytes, moe_experts, workload_limit
    from xserv.models.random_checkpoint import make_test_model
    from xserv.models.registry import load_model

    folder = make_test_model("moe-tiny", tmp_path / "moe", overrides={"mlp_only_layers": [0]}, progress=False)
    model = load_model(folder, "cpu", progress=False)
    c = model.config
    num, k = moe_experts(model)
    sparse = [i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0 for i in range(c.num_hidden_layers)]
    expert_bytes = 3 * c.hidden_size * c.moe_intermediate_size * 2
    assert active_weight_bytes(model) == all_weight_bytes(model) - sum(sparse) * (num - k) * expert_bytes
    ceilings = {"copy_bytes_per_s": 1e12, "gemm_flops_per_s": 1e14}
    lim = workload_limit(model, [20, 30], [4, 6], ceilings)  # 5 decode steps, each below all the weights
    assert lim["decode_s"] < 5 * all_weight_bytes(model) / 1e12 and "moe" in lim


def test_latency_roofline_is_cuda_only_and_load_times_are_in_the_json(bench, tmp_path):
    out = tmp_path / "lat.json"
    code, stdout, err = bench("latency", "--input-len", "8", "--output-len", "2", "--iters", "1", "--roofline",
                              "--json", str(out))
    assert code == 0, err
    assert "CUDA only" in stdout
    res = json.loads(out.read_text())
    assert res["load_s"]["weights_s"] > 0 and "roofline" not in res


def test_with_setting_sets_a_module_attribute_then_runs_the_module(monkeypatch, capsys):
    """tools/dev/with_setting.py: the A/B switch is set (converted to the attribute's type) before the module runs, and
    a missing attribute or a malformed setting is an error that names it."""
    import runpy

    from tools.dev import with_setting
    from xserv.engine import model_runner

    seen = {}
    monkeypatch.setattr(model_runner, "FINE_KV_MAX_BATCH", model_runner.FINE_KV_MAX_BATCH)
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: seen.update(
        name=name, value=model_runner.FINE_KV_MAX_BATCH, argv=list(__import__("sys").argv)))
    with_setting.main(["xserv.engine.model_runner.FINE_KV_MAX_BATCH=0", "--", "xserv", "bench", "latency"])
    assert seen == {"name": "xserv", "value": 0, "argv": ["xserv", "bench", "latency"]}
    assert isinstance(model_runner.FINE_KV_MAX_BATCH, int)
    for bad, message in (("xserv.engine.model_runner.NO_SUCH=1", "no attribute 'NO_SUCH'"),
                         ("xserv.engine.model_runner.FINE_KV_MAX_BATCH", "MODULE.ATTRIBUTE=VALUE"),
                         ("xserv.engine.model_runner.FINE_KV_MAX_BATCH=many", "does not convert to int")):
        with pytest.raises(SystemExit, match=message):
            with_setting.main([bad, "--", "xserv"])
