"""The generation engine on the NumPy backend: stop strings, batching, chunked prefill, preemption, finish
reasons, prefix caching, decode graphs (their replay logic, on the CPU).

Two runs of a request in different batch shapes (alone or batched, chunked, preempted, a prefix served from the
cache, padded to a graph bucket) are compared up to the rounding a BLAS may move between them (tests/batch_shape.py:
the same tokens up to a first difference at a near tie, the same logprobs to ROUNDING_ATOL, and each token after a
difference its own context's choice); two runs of the same shapes are compared exactly."""
import numpy as np
import pytest

from batch_shape import (ROUNDING_ATOL, assert_follows_logits, assert_same_run, assert_same_runs,
                         draw_may_flip)
from qwen3_reference import perturbed_model_dir, rel_err_rows, tiny_model_dir  # noqa: F401
from xserv.engine.sequence import StopStringMatcher
from xserv.sampling import SamplingParams

GREEDY = dict(temperature=0.0)
LOGPROBS = dict(GREEDY, logprobs=2)  # the two best logprobs say where a greedy run may take the other token


def test_stop_string_matcher_holds_back_possible_starts():
    m = StopStringMatcher(["</end>", "STOP"])
    out = []
    for delta in ["Hello </", "en", "d is not </e", "x S", "TO", "P and more"]:
        m.push(delta)
        out.append(m.take())
    assert out == ["Hello ", "", "</end is not ", "</ex ", "", ""]
    assert m.stopped and m.text == "Hello </end is not </ex "
    m2 = StopStringMatcher(["ab"])
    m2.push("xxa")
    assert m2.take() == "xx" and m2.take(final=True) == "a"


@pytest.fixture(scope="module")
def llm(perturbed_model_dir):  # noqa: F811
    from xserv import LLM

    return LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, progress=False)


PROMPTS = [[791, 6722, 315, 9625, 374], [9707], list(range(1000, 1037)), [151644, 872, 198, 13048, 151645, 198]]


def test_batched_equals_one_at_a_time(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True, **LOGPROBS)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert_same_runs(alone, batched, params, llm)
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in batched)
    assert len({tuple(o.token_ids) for o in batched}) > 1  # the prompts matter
    again = llm.generate(PROMPTS, params)  # PROMPTS[2]'s first blocks now come from the prefix cache
    assert_same_runs(again, batched, params, llm)


def test_chunked_prefill_and_preemption_match(perturbed_model_dir, llm):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=10, ignore_eos=True, **LOGPROBS)
    want = llm.generate(PROMPTS, params)
    # prompts prefilled 8 tokens per step; a pool of 16 blocks of 4 tokens cannot hold all four sequences at once
    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=64, kv_cache_tokens=64, block_size=4,
                max_num_batched_tokens=8, max_num_seqs=4, progress=False)
    assert_same_runs(small.generate(PROMPTS, params), want, params, llm)
    assert small.engine.num_preemptions > 0
    assert small.engine.blocks.num_free == small.kv_cache.num_blocks  # every block came back


def test_max_tokens_stop_token_ids_and_stop_strings(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16

    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]

    text = base.text
    assert len(text) > 6
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert stop not in out.text


def test_context_limit_finishes_with_length(llm):
    prompt = list(range(2000, 2000 + 250))
    out = llm.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 256


def test_prompt_too_long_raises(llm):
    with pytest.raises(ValueError, match="300 tokens.*256"):
        llm.generate([list(range(300))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


def test_greedy_tokens_are_argmax_of_logits(llm):
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY))[0]
    logits = llm.logits(PROMPTS[2] + out.token_ids[:-1])
    assert logits.shape == (len(PROMPTS[2]) + 7, llm.config.vocab_size) and logits.dtype == np.float32
    # one prefill of the whole text against the generation's steps: a batch shape apart, argmax up to a near tie
    assert_follows_logits(out, None, llm)


def test_seeded_sampling_reproducible(llm):
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate([PROMPTS[0], PROMPTS[1]], p)
    b = llm.generate([PROMPTS[0], PROMPTS[1]], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_decode_graph_replay_logic_on_cpu(perturbed_model_dir, llm):  # noqa: F811
    """The CUDA-graph decode path (static buffers, padding to a bucket, per-bucket block tables, steps launched
    ahead with their input tokens gathered from the previous step's output) run eagerly on the NumPy backend:
    same tokens as plain decode, greedy and seeded sampling."""
    from types import SimpleNamespace

    from xserv import LLM

    params = [SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3),
              SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, top_k=50, seed=4)]
    want = llm.generate(PROMPTS[:3], params)
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_seqs=4, progress=False)
    replays = []

    def fake_graph(step):
        return SimpleNamespace(replay=lambda: (replays.append(1), step()))

    assert graphed.runner.capture_decode_graphs(graph_factory=fake_graph) == [1, 2, 4]
    got = graphed.generate(PROMPTS[:3], params)  # 3 rows padded to the 4-row bucket
    assert_same_runs(got, want, params, llm)
    assert len(replays) == 5  # 5 decode steps (the third request stops after 3 of them)
    assert graphed.engine.num_steps_ahead >= 3  # all but the first decode step went ahead of the booking


def test_decode_graph_replay_with_preemption(perturbed_model_dir, llm):  # noqa: F811
    """Preempted sequences come back with new blocks (often in the same slot, with as many blocks as before): the
    graph path's block-table mirror must follow, or decode reads and writes someone else's K/V."""
    from types import SimpleNamespace

    from xserv import LLM

    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)  # no logprobs: decode steps go ahead
    want = llm.generate(PROMPTS, params)
    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=64, kv_cache_tokens=64, block_size=4,
                max_num_batched_tokens=8, max_num_seqs=4, progress=False)
    small.runner.capture_decode_graphs(graph_factory=lambda step: SimpleNamespace(replay=step))
    assert_same_runs(small.generate(PROMPTS, params), want, params, llm)
    assert small.engine.num_preemptions > 0 and small.engine.num_steps_ahead > 0

    # the mirror itself: the same sequence back in the same slot with as many, but other, blocks
    seq = SimpleNamespace(slot=1, block_table=[3, 4])
    small.runner._sync_tables([seq])
    seq.block_table = [5, 6]
    small.runner._sync_tables([seq])
    assert small.runner._tables[1, :2].tolist() == [5, 6]


def test_decode_graphs_are_bucketed_by_context_length(perturbed_model_dir):  # noqa: F811
    """A decode step replays the graph captured for the smallest context bucket that holds its longest sequence
    (the attention's split-KV grid is sized from that bucket): same tokens as plain decode."""
    from types import SimpleNamespace

    from xserv import LLM
    from xserv.engine.model_runner import kv_len_buckets

    assert kv_len_buckets(40960) == [2048, 8192, 32768, 40960] and kv_len_buckets(256) == [256]
    # few sequences: also the short contexts' buckets (below the first coarse one)
    assert kv_len_buckets(40960, 1) == [512, 1024, 2048, 8192, 32768, 40960] == kv_len_buckets(40960, 16)
    assert kv_len_buckets(40960, 17) == [2048, 8192, 32768, 40960]
    assert kv_len_buckets(700, 1) == [512, 700] and kv_len_buckets(512, 1) == [512]
    prompt = list(range(100, 2100))  # 2000 tokens: decode crosses from the 2048 bucket into the next
    params = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)
    plain = LLM(str(perturbed_model_dir), device="cpu", max_model_len=4096, max_num_seqs=2, progress=False)
    want = plain.generate([prompt], params)[0].token_ids
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=4096, max_num_seqs=2, progress=False)
    used = []

    def fake_graph(step):
        key = step.__defaults__[0].max_kv_len
        return SimpleNamespace(replay=lambda: (used.append(key), step()))

    graphed.runner.capture_decode_graphs(graph_factory=fake_graph)
    assert sorted(graphed.runner.graphs) == [(bs, L) for bs in (1, 2) for L in (512, 1024, 2048, 4096)]
    assert graphed.generate([prompt], params)[0].token_ids == want
    assert used[0] == 2048 and used[-1] == 4096 and used.count(2048) == 2048 - 2000
    short = list(range(7, 507))  # 500 tokens: decode crosses from the 512 bucket into the 1024 one
    used.clear()
    assert graphed.generate([short], params)[0].token_ids == plain.generate([short], params)[0].token_ids
    assert used[0] == 512 and used[-1] == 1024 and used.count(512) == 512 - 500


# ---- prefix cache, mixed steps, n samples, block accounting ------------------------------------------------------
LONG = list(range(3000, 3000 + 70))  # 70 tokens: 4 full blocks of 16 and a partial one


def test_prefix_cache_serves_full_blocks_and_changes_nothing(llm, perturbed_model_dir):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=8, ignore_eos=True, **LOGPROBS)
    first = llm.generate([LONG], params)[0]
    again = llm.generate([LONG], params)[0]
    other_tail = llm.generate([LONG[:40] + [5, 6, 7]], params)[0]
    assert_same_run(again, first, params, model=llm)  # 6 of 70 prompt tokens computed: a batch shape apart
    assert again.num_cached_tokens == 64  # 4 full blocks; the partial one is recomputed
    assert other_tail.num_cached_tokens == 32  # shares the first two blocks only
    plain = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, enable_prefix_caching=False,
                progress=False)
    want = plain.generate([LONG, LONG[:40] + [5, 6, 7]], params)
    assert_same_runs([first, other_tail], want, params, plain)
    assert all(o.num_cached_tokens == 0 for o in want)


def test_decodes_keep_going_while_a_long_prompt_prefills(perturbed_model_dir, llm):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=12, ignore_eos=True, **LOGPROBS)
    want = llm.generate([PROMPTS[0], LONG], params)
    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_batched_tokens=16,
                max_num_seqs=4, progress=False)
    steps = []
    run = small.runner.run
    small.runner.run = lambda scheduled, **kw: (steps.append([(s.seq_id, n) for s, n in scheduled]),
                                                run(scheduled, **kw))[1]
    eng = small.engine
    a = eng.add_request(PROMPTS[0], params)
    eng.step()  # a's prompt
    b = eng.add_request(LONG, params)
    while not (a.is_finished and b.is_finished):
        eng.step()
    mixed = [s for s in steps if (a.seq_id, 1) in s and any(i == b.seq_id and n > 1 for i, n in s)]
    assert len(mixed) >= 4  # b's 70-token prompt went in 15-token chunks next to a's decodes
    assert all(sum(n for _, n in s) <= 16 for s in steps)
    assert_same_runs([a.output(), b.output()], want, params, llm)


def test_n_samples_share_the_prompt_and_follow_their_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate([LONG], p)
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3
    assert sum(o.num_cached_tokens for o in outs) >= 128  # the later samples found the prompt's blocks cached
    alone = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True) for i in range(3)]
    seeds = [llm.generate([LONG], p)[0] for p in alone]
    assert_same_runs(seeds, outs, alone, llm)  # the prompt computed, or some of it served: a batch shape apart


def test_every_block_comes_back_after_finished_aborted_and_preempted(perturbed_model_dir):  # noqa: F811
    from xserv import LLM

    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=64, kv_cache_tokens=96, block_size=4,
                max_num_batched_tokens=16, max_num_seqs=4, progress=False)
    eng = small.engine
    start = eng.blocks.num_free
    seqs = [eng.add_request(list(range(100 * i, 100 * i + 10 + 3 * i)), SamplingParams(
        max_tokens=30, ignore_eos=True, temperature=0.8, seed=i)) for i in range(6)]
    seqs.append(eng.add_request(list(range(100, 110)), SamplingParams(max_tokens=5, stop_token_ids=[],
                                                                      temperature=0.0, ignore_eos=True)))
    for step in range(200):
        eng.step()
        if step == 6:
            eng.abort(seqs[1])
            eng.abort(seqs[5])  # possibly still waiting
        if not eng.has_unfinished():
            break
    while eng._inflight:
        eng.step()
    assert eng.num_preemptions > 0
    assert {s.finish_reason for s in seqs} == {"length", "abort"}
    assert eng.blocks.num_free == start and all(r == 0 for r in eng.blocks.ref_count)
    assert eng.stats()["num_running"] == 0 and eng.stats()["num_waiting"] == 0


def test_streamed_text_equals_the_whole_text(llm):
    params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    whole = llm.generate([PROMPTS[3]], params)[0]
    streamed = "".join(llm.stream(PROMPTS[3], params))
    assert streamed == whole.text and whole.text


# ---- prefill graphs: a step that is one short prompt chunk replays a captured forward ---------------------------
def test_prefill_token_buckets():
    from xserv.engine.model_runner import prefill_token_buckets

    assert prefill_token_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_token_buckets(100) == [16, 32, 64, 100]
    assert prefill_token_buckets(8) == [8] and prefill_token_buckets(16) == [16] and prefill_token_buckets(0) == []


def test_prefill_graph_tokens_option():
    import argparse

    from xserv.engine.config import EngineConfig

    assert EngineConfig().prefill_graph_tokens == 512 and EngineConfig(prefill_graph_tokens=0).prefill_graph_tokens == 0
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="prefill_graph_tokens"):
            EngineConfig(prefill_graph_tokens=bad)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(p)
    assert EngineConfig.from_cli_args(p.parse_args([])).prefill_graph_tokens == 512
    assert EngineConfig.from_cli_args(p.parse_args(["--prefill-graph-tokens", "0"])).prefill_graph_tokens == 0


SIZE_OPTIONS = ("kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")


@pytest.mark.parametrize("value", [0, -1, -4096])
@pytest.mark.parametrize("option", SIZE_OPTIONS)
def test_a_size_of_zero_or_less_is_refused_by_name(option, value, tiny_model_dir):  # noqa: F811
    """Every size option, zero or negative, is refused with a ValueError naming it, from EngineConfig and from LLM's
    keyword arguments (before anything is loaded). Red when the check accepts 0 (`value < 0`), or lets a falsy
    value through as "not set" (`if not value: continue`, the way None is let through): a zero KV cache, batch
    or block size would otherwise fail later, far from the option, or divide by zero."""
    from xserv import LLM
    from xserv.engine.config import EngineConfig

    message = rf"^{option} must be a positive integer, got {value}$"
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{option: value})
    with pytest.raises(ValueError, match=message):
        EngineConfig().replace(**{option: value})
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir), device="cpu", progress=False, **{option: value})


def _spy_steps(runner):
    """Wrap runner.run: record (tokens of the step, replayed a prefill graph, logits copy) per step."""
    steps = []
    run = runner.run

    def spy(scheduled, **kw):
        out = run(scheduled, **kw)
        steps.append(([n for _, n in scheduled], runner.last_run_prefill_graph, out.numpy().copy()))
        return out

    runner.run = spy
    return steps


def _bucket_recorder(used):
    """A graph_factory for the CPU: replay runs the captured step eagerly and records the bucket's token count,
    after poisoning the activation rows and logits a replay must overwrite."""
    from types import SimpleNamespace

    def factory(step):
        batch = step.__defaults__[0]

        def replay():
            used.append(batch.num_tokens if batch.max_q_len > 1 else ("decode", batch.num_tokens))
            step()

        return SimpleNamespace(replay=replay)

    return factory


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 128, 129])
def test_prefill_graph_replay_logic_on_cpu(perturbed_model_dir, llm, length):  # noqa: F811
    """A prompt of `length` tokens prefilled through the prefill-graph path (static buffer, padding to the bucket,
    slot -1 for the padding rows, logits from the real last row) on the NumPy backend: same logits as the eager
    prefill and the same greedy tokens after it; a prompt longer than the largest bucket stays eager."""
    from xserv import LLM

    prompt = [int(t) for t in np.random.default_rng(length).integers(0, 5000, length)]
    params = SamplingParams(max_tokens=5, ignore_eos=True, **GREEDY)
    eager_steps = _spy_steps(llm.runner)
    try:
        want = llm.generate([prompt], params)[0]
    finally:
        del llm.runner.run  # the instance attribute set by _spy_steps
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_seqs=2, progress=False)
    used = []
    assert graphed.runner.capture_decode_graphs(graph_factory=_bucket_recorder(used)) == [1, 2]
    assert graphed.runner.capture_prefill_graphs(128, graph_factory=_bucket_recorder(used)) == [16, 32, 64, 128]
    ws = graphed.runner.workspace
    for buf in (ws.logits, ws.gathered, ws.hidden, ws.attn):  # poison: stale rows must not reach the result
        buf.array[...] = np.nan
    steps = _spy_steps(graphed.runner)
    used.clear()
    assert_same_run(graphed.generate([prompt], params)[0], want, params, model=llm)  # padded: a batch shape apart
    if length == 1:
        assert used[0] == ("decode", 1)  # a one-token prompt is a decode-shaped step
    elif length <= 128:
        assert used[0] == min(b for b in (16, 32, 64, 128) if b >= length) and steps[0][1]
        # the graph pads the chunk to its bucket: a batch shape apart, equal up to rounding (tests/batch_shape.py)
        np.testing.assert_allclose(steps[0][2], eager_steps[0][2], rtol=0, atol=ROUNDING_ATOL)
        assert steps[0][2].shape == (1, graphed.config.vocab_size) and np.all(np.isfinite(steps[0][2]))
    else:
        assert not steps[0][1] and all(u[0] == "decode" for u in used)
    assert all(u == ("decode", 1) for u in used[1:])  # decoding continued from the decode graphs
    # every decode step went ahead of the booking, the first one too when the prompt ran from a graph
    assert graphed.engine.num_steps_ahead == (3 if length > 128 else 4)


def test_prefill_graph_then_seeded_sampling_ahead_on_cpu(perturbed_model_dir, llm):  # noqa: F811
    """Seeded sampling with penalties after a prefill graph: the first decode step, launched before the prefill is
    booked (its token gathered on the device, its position and the sampler's step one ahead of the host state),
    draws the same tokens as the eager path; so does a request whose first token ends it (stop token)."""
    from xserv import LLM

    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=5, repetition_penalty=1.3),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=40, seed=12)]
    prompts = [PROMPTS[0], list(range(1000, 1020))]
    want = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_seqs=2, progress=False)
    used = []
    graphed.runner.capture_decode_graphs(graph_factory=_bucket_recorder(used))
    graphed.runner.capture_prefill_graphs(32, graph_factory=_bucket_recorder(used))
    for prompt, p, w in zip(prompts, params, want):
        ahead, used[:] = graphed.engine.num_steps_ahead, []
        assert_same_run(graphed.generate([prompt], p)[0], w, p, model=llm)  # padded: a batch shape apart
        assert used == [16 if len(prompt) <= 16 else 32] + [("decode", 1)] * 5
        assert graphed.engine.num_steps_ahead - ahead == 5
    # the padded prefill draws want's first token again only where no rounding can flip that draw (tests/
    # batch_shape.py): this prompt and seed give a clear one (should a change of the model move it, pick another seed)
    assert not draw_may_flip(llm.logits(prompts[1])[-1], params[1], prompts[1], [])
    first = want[1].token_ids[0]
    stop = SamplingParams(max_tokens=6, stop_token_ids=[first], temperature=0.8, top_k=40, seed=12)
    out = graphed.generate([prompts[1]], stop)[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    eng = graphed.engine
    assert len(eng._inflight) == 1  # the row launched ahead, whose token is dropped when booked
    eng.step()
    assert not eng.has_unfinished() and not eng._inflight and eng.blocks.num_free == eng.blocks.num_blocks


def test_prefill_graph_with_cached_prefix_and_kv_untouched_by_padding(perturbed_model_dir, llm):  # noqa: F811
    """A prompt whose first blocks come from the prefix cache prefills its tail through a prefill graph (the KV
    length, given on the device, is longer than the chunk); the padding rows write no K/V anywhere; same tokens as
    the eager path, and decoding continues from there."""
    from xserv import LLM

    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    tail = LONG + list(range(20, 35))  # 85 tokens: 64 from the cache, a 21-token chunk padded to 32
    want = llm.generate([LONG, tail], params)
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_seqs=2, progress=False)
    used = []
    graphed.runner.capture_decode_graphs(graph_factory=_bucket_recorder(used))
    assert graphed.runner.capture_prefill_graphs(64, graph_factory=_bucket_recorder(used)) == [16, 32, 64]
    steps = _spy_steps(graphed.runner)
    used.clear()
    assert_same_run(graphed.generate([LONG], params)[0], want[0], params, model=llm)  # alone, not batched
    assert steps[0][0] == [70] and not steps[0][1]  # longer than the largest bucket: eager
    assert used == [("decode", 1)] * 5
    used.clear()

    eng, kv = graphed.engine, graphed.kv_cache
    before = [(k.array.copy(), v.array.copy()) for k, v in zip(kv.k, kv.v)]
    seq = eng.add_request(tail, params)
    eng.step()  # launches (on the CPU: runs) the prefill step
    assert seq.num_cached_tokens == 64 and steps[-1][0] == [21] and steps[-1][1] and used == [32]
    prefill_logits = steps[-1][2]
    pos = np.arange(64, 85)
    written = np.asarray(seq.block_table)[pos // kv.block_size] * kv.block_size + pos % kv.block_size
    for (k0, v0), k, v in zip(before, kv.k, kv.v):
        for old, new in ((k0, k.array), (v0, v.array)):
            old, new = old.reshape(-1, old.shape[2] * old.shape[3]), new.reshape(-1, new.shape[2] * new.shape[3])
            changed = np.flatnonzero(np.any(old.view(np.uint16) != new.view(np.uint16), axis=1))
            assert set(changed.tolist()) <= set(written.tolist()) and len(changed) > 0
    while not seq.is_finished:
        eng.step()
    assert_same_run(seq.output(), want[1], params, model=llm)  # 64 cached, 21 padded to 32: a batch shape apart
    # 21 rows padded to the 32-row bucket against 85 rows at once: equal up to rounding (tests/batch_shape.py)
    np.testing.assert_allclose(prefill_logits, graphed.logits(tail)[-1:], rtol=0, atol=ROUNDING_ATOL)


def check_prefill_graphs_cuda(folder, lengths=(1, 15, 16, 17, 100, 128, 129), max_tokens=128) -> dict:
    """On the GPU: a prompt chunk of each length, with no prefix and after a cached 32-token prefix, run through
    runner.run (a prefill graph up to `max_tokens`, padded to its bucket; activations and logits poisoned with NaN
    first) against the eager forward of the same chunk: logits within 1e-2, K/V written only at the chunk's own
    slots. Then whole requests through the engine: greedy tokens equal the argmax of the eager logits of the same
    tokens wherever the top two are clearly apart, and a prompt whose head is in the prefix cache prefills its tail
    through a graph. Returns the worst logits error per (length, prefix). Also run on 0.6B-shaped checkpoints."""
    from xserv import LLM
    from xserv.engine.batch import SeqChunk
    from xserv.engine.model_runner import prefill_token_buckets
    from xserv.engine.sequence import Sequence

    llm = LLM(str(folder), device="cuda", max_model_len=512, kv_cache_tokens=4096, max_num_seqs=4,
              prefill_graph_tokens=max_tokens, progress=False)
    runner, kv, blocks = llm.runner, llm.kv_cache, llm.engine.blocks
    assert sorted(runner.prefill_graphs) == prefill_token_buckets(max_tokens) and runner.graphs
    ws, vocab = runner.workspace, llm.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    errors = {}

    def poison():
        for buf in (ws.hidden, ws.attn, ws.qkv, ws.gathered, ws.logits):
            rows = buf[:min(buf.shape[0], max_tokens)]
            rows.copy_(np.full(rows.shape, np.nan, rows.dtype))

    layers = (0, len(kv.k) - 1)
    for length in lengths:
        for prefix in (0, 32):
            prompt = rng.integers(0, vocab, prefix + length).tolist()
            seq = Sequence(10_000 + length, prompt, params, seed=0, stop_ids=frozenset())
            seq.block_table, seq.slot = blocks.allocate(blocks.blocks_for(len(prompt))), 0
            if prefix:
                runner.forward([SeqChunk(prompt[:prefix], 0, seq.block_table, "none")])
                seq.num_computed = prefix
            before = [(kv.k[i].numpy(), kv.v[i].numpy()) for i in layers]
            poison()
            graphed = runner.run([(seq, length)]).numpy().copy()
            assert runner.last_run_prefill_graph == (1 < length <= max_tokens)
            pos = np.arange(prefix, prefix + length)
            own = set((np.asarray(seq.block_table)[pos // kv.block_size] * kv.block_size
                       + pos % kv.block_size).tolist())
            for (k0, v0), i in zip(before, layers):
                for old, new in ((k0, kv.k[i].numpy()), (v0, kv.v[i].numpy())):
                    rows = old.shape[0] * old.shape[1]
                    old, new = old.reshape(rows, -1), new.reshape(rows, -1)
                    changed = set(np.flatnonzero(np.any(old.view(np.uint16) != new.view(np.uint16), axis=1)).tolist())
                    assert changed <= own and changed, (length, prefix)
            eager = runner.forward([SeqChunk(prompt[prefix:], prefix, seq.block_table, "last")]).numpy()
            blocks.free(seq.block_table)
            assert graphed.shape == (1, vocab) and np.all(np.isfinite(graphed))
            errors[(length, prefix)] = float(rel_err_rows(graphed, eager).max())
            assert errors[(length, prefix)] <= 1e-2, (length, prefix, errors[(length, prefix)])

    steps = _spy_steps(runner)
    graphs = runner.prefill_graphs

    def generate(prompt, graphed):
        runner.prefill_graphs = graphs if graphed else {}
        first = len(steps)
        out = llm.generate([prompt], params)[0]
        n = len(prompt) - out.num_cached_tokens
        assert steps[first][0] == [n] and steps[first][1] == (graphed and 1 < n <= max_tokens)
        return out

    head = rng.integers(0, vocab, 48).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in lengths] + [head, head + rng.integers(0, vocab, 20).tolist()]
    for prompt in prompts:
        out = generate(prompt, True)
        eager = generate(prompt, False).token_ids
        ref = llm.logits(prompt + out.token_ids[:-1])[len(prompt) - 1:]
        top2 = np.sort(ref, -1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-2 * np.abs(top2[:, 1]).max()
        picked = np.argmax(ref, -1)
        assert all(t == r for t, r, c in zip(out.token_ids, picked, clear) if c), (len(prompt), out.token_ids)
        # graphed and eager prefill: the same tokens, up to a near tie of the eager logits
        same = next((i for i, (a, b) in enumerate(zip(out.token_ids, eager)) if a != b), len(eager))
        assert same == len(eager) or not clear[same], (len(prompt), out.token_ids, eager)
        errors[("tokens", len(prompt))] = (same, int(clear.sum()))
    runner.prefill_graphs = graphs
    assert out.num_cached_tokens == 48
    return errors


@pytest.mark.gpu
def test_cuda_prefill_graphs_match_eager(tiny_model_dir):  # noqa: F811
    check_prefill_graphs_cuda(tiny_model_dir)
