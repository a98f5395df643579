"""The generation engine on the NumPy backend: stop strings, batching, chunked prefill, preemption, finish
reasons, prefix caching, decode graphs (their replay logic, on the CPU)."""
import numpy as np
import pytest

from qwen3_reference import perturbed_model_dir  # noqa: F401
from xserv.engine.sequence import StopStringMatcher
from xserv.sampling import SamplingParams

GREEDY = dict(temperature=0.0)


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
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in batched)
    assert len({tuple(o.token_ids) for o in batched}) > 1  # the prompts matter
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in batched]  # deterministic


def test_chunked_prefill_and_preemption_match(perturbed_model_dir, llm):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    # prompts prefilled 8 tokens per step; a pool of 16 blocks of 4 tokens cannot hold all four sequences at once
    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=64, kv_cache_tokens=64, block_size=4,
                max_num_batched_tokens=8, max_num_seqs=4, progress=False)
    got = [o.token_ids for o in small.generate(PROMPTS, params)]
    assert got == want
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
    assert np.argmax(logits[len(PROMPTS[2]) - 1:], -1).tolist() == out.token_ids


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
    want = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    graphed = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, max_num_seqs=4, progress=False)
    replays = []

    def fake_graph(step):
        return SimpleNamespace(replay=lambda: (replays.append(1), step()))

    assert graphed.runner.capture_decode_graphs(graph_factory=fake_graph) == [1, 2, 4]
    got = [o.token_ids for o in graphed.generate(PROMPTS[:3], params)]
    assert got == want and len(replays) == 5  # 5 decode steps (the third request stops after 3 of them)
    assert graphed.engine.num_steps_ahead >= 3  # all but the first decode step went ahead of the booking


def test_decode_graph_replay_with_preemption(perturbed_model_dir, llm):  # noqa: F811
    """Preempted sequences come back with new blocks (often in the same slot, with as many blocks as before): the
    graph path's block-table mirror must follow, or decode reads and writes someone else's K/V."""
    from types import SimpleNamespace

    from xserv import LLM

    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    small = LLM(str(perturbed_model_dir), device="cpu", max_model_len=64, kv_cache_tokens=64, block_size=4,
                max_num_batched_tokens=8, max_num_seqs=4, progress=False)
    small.runner.capture_decode_graphs(graph_factory=lambda step: SimpleNamespace(replay=step))
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == want
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
    assert sorted(graphed.runner.graphs) == [(1, 2048), (1, 4096), (2, 2048), (2, 4096)]
    assert graphed.generate([prompt], params)[0].token_ids == want
    assert used[0] == 2048 and used[-1] == 4096 and used.count(2048) == 2048 - 2000


# ---- prefix cache, mixed steps, n samples, block accounting ------------------------------------------------------
LONG = list(range(3000, 3000 + 70))  # 70 tokens: 4 full blocks of 16 and a partial one


def test_prefix_cache_serves_full_blocks_and_changes_nothing(llm, perturbed_model_dir):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    first = llm.generate([LONG], params)[0]
    again = llm.generate([LONG], params)[0]
    other_tail = llm.generate([LONG[:40] + [5, 6, 7]], params)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == 64  # 4 full blocks; the partial one is recomputed
    assert other_tail.num_cached_tokens == 32  # shares the first two blocks only
    plain = LLM(str(perturbed_model_dir), device="cpu", max_model_len=256, enable_prefix_caching=False,
                progress=False)
    want = plain.generate([LONG, LONG[:40] + [5, 6, 7]], params)
    assert [o.token_ids for o in want] == [first.token_ids, other_tail.token_ids]
    assert all(o.num_cached_tokens == 0 for o in want)


def test_decodes_keep_going_while_a_long_prompt_prefills(perturbed_model_dir, llm):  # noqa: F811
    from xserv import LLM

    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    want = [o.token_ids for o in llm.generate([PROMPTS[0], LONG], params)]
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
    assert [a.output().token_ids, b.output().token_ids] == want


def test_n_samples_share_the_prompt_and_follow_their_seeds(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = llm.generate([LONG], p)
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3
    assert sum(o.num_cached_tokens for o in outs) >= 128  # the later samples found the prompt's blocks cached
    seeds = [llm.generate([LONG], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0]
             for i in range(3)]
    assert [o.token_ids for o in seeds] == [o.token_ids for o in outs]


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
    streamed = "".join(llm.engine.stream(PROMPTS[3], params))
    assert streamed == whole.text and whole.text
