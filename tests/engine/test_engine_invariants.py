"""Engine behaviours that nothing else pins down, on the NumPy backend through the `LLMEngine` API:

- the prefix cache's key names the whole prefix: a block holding the same tokens as a cached one, but after other
  tokens (or at another position), is never served from the cache;
- a streaming request preempted under KV pressure streams its own text whole (no piece lost or repeated), and its
  tokens and text are those it gets alone with room to spare, up to the rounding a batch shape may move.

Each test was checked against a planted bug (see the test's docstring)."""
from types import SimpleNamespace

import numpy as np
import pytest

from batch_shape import assert_same_run
from engine_driver import generate, stream
from qwen3_reference import perturbed_model_dir  # noqa: F401
from xserv.engine.block_manager import NO_PARENT, BlockManager
from xserv.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

MAX_LEN = 256


@pytest.fixture(scope="module")
def loaded(perturbed_model_dir):  # noqa: F811
    """(model, tokenizer, eos ids) of the tiny checkpoint, loaded once; each test makes the engines it needs."""
    from xserv.models.checkpoint import CheckpointReader
    from xserv.models.registry import config_from_pretrained, model_class
    from xserv.tokenizer import Tokenizer

    config = config_from_pretrained(perturbed_model_dir)
    model = model_class(config).from_checkpoint(config, CheckpointReader(perturbed_model_dir), "cpu", progress=False,
                                                max_positions=MAX_LEN)
    tokenizer = Tokenizer.from_folder(perturbed_model_dir)
    return model, tokenizer, set(config.eos_token_id) | set(tokenizer.eos_token_ids)


def make_engine(loaded, **config):
    from xserv.engine.config import EngineConfig
    from xserv.engine.llm_engine import LLMEngine

    model, tokenizer, eos = loaded
    return LLMEngine.from_model(model, tokenizer, EngineConfig(**config), context_len=MAX_LEN, eos_token_ids=eos)


# ---- the prefix cache's key is the whole prefix ------------------------------------------------------------------
def test_block_key_chains_the_whole_prefix():
    """Planted bug that turns this red: `block_key` hashing the block's own tokens only (the parent ignored)."""
    bm = BlockManager(8, 2)
    x, y, z = (1, 2), (3, 4), (5, 6)
    a = bm.allocate(2)  # a prompt X Y
    kx = bm.register(a[0], NO_PARENT, x)
    kxy = bm.register(a[1], kx, y)
    c = bm.allocate(1)  # a prompt Z ...
    kz = bm.register(c[0], NO_PARENT, z)
    assert len({kx, kxy, kz, bm.register(c[0], NO_PARENT, y)}) == 4  # Y alone is not X Y

    # Y as the first block, or after Z, or after X X: never X Y's second block
    matched = [bm.match_prefix(p, 5)[0] for p in ([*y, *y, 9], [*z, *y, 9], [*x, *x, 9], [*x, *y, 9])]
    assert matched[:3] == [[], [c[0]], [a[0]]]  # X at position 2 is not X at position 0 either
    assert matched[3] == a  # the real prefix still matches
    for blocks in matched:
        bm.free(blocks)

    # a block with X Y's second block's tokens after Z is a prefix of its own: it gets registered (not deduplicated
    # away as "already cached") and is what Z Y finds
    d = bm.allocate(1)
    assert bm.register(d[0], kz, y) != kxy and bm.num_cached == 4
    blocks, keys = bm.match_prefix([*z, *y, 9], 5)
    assert blocks == [c[0], d[0]] and keys == [kz, bm.register(d[0], kz, y)]
    bm.free(blocks), bm.free(a), bm.free(c), bm.free(d)
    assert all(r == 0 for r in bm.ref_count)


BS = 16
X, Y, Z, W = (list(range(start, start + BS)) for start in (1000, 2000, 3000, 4000))
TAIL = [77, 78, 79, 80, 81]


def test_same_block_tokens_after_another_prefix_are_computed_not_served(loaded):
    """Two prompts whose second blocks hold the same tokens (Y) after different first blocks (X, Z): the second
    prompt gets Z from the cache (an earlier Z W prompt put it there) and computes its Y itself; a prompt starting
    with Y gets nothing. Their tokens and logprobs equal those of a fresh engine without a cache, up to the rounding
    that a different batch shape may move (tests/batch_shape.py).
    Planted bug that turns this red: `block_key` hashing the block's own tokens only (the parent ignored)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=5)
    eng = make_engine(loaded, max_model_len=MAX_LEN, block_size=BS)
    warm = generate(eng, [Z + W + TAIL, X + Y + TAIL], [params] * 2)
    assert [o.num_cached_tokens for o in warm] == [0, 0]
    zy, yy = (generate(eng, [p], [params])[0] for p in (Z + Y + TAIL, Y + Y + TAIL))
    assert zy.num_cached_tokens == BS  # Z only: its Y follows Z, X Y's follows X
    assert yy.num_cached_tokens == 0  # Y at position 0 is not Y at position 16
    again = generate(eng, [Z + Y + TAIL], [params])[0]
    assert again.num_cached_tokens == 2 * BS  # Z Y's own blocks do serve it
    assert_same_run(again, zy, params)

    fresh = make_engine(loaded, max_model_len=MAX_LEN, block_size=BS, enable_prefix_caching=False)
    for got in (zy, yy, again):
        prompt = got.prompt_token_ids
        want = generate(fresh, [prompt], [params])[0]  # alone, every token computed
        assert want.num_cached_tokens == 0
        assert_same_run(got, want, params, context=prompt[:BS + 1])  # a batch shape apart: equal up to rounding


# ---- preemption while streaming ----------------------------------------------------------------------------------
STREAM_PROMPTS = [[791, 6722, 315, 9625, 374], [9707, 11, 1879], list(range(1000, 1017)),
                  [151644, 872, 198, 13048, 151645, 198], [40, 1075, 264, 1293, 315, 3070, 13]]
STREAM_PARAMS = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0),
                 SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0),
                 SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0),
                 SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=40, seed=5),
                 SamplingParams(max_tokens=22, ignore_eos=True, temperature=0.0)]


def _run_streams(eng, prompts, params_list):
    """Stream every request at once (engine_driver.stream, round robin); per request: (deltas, final output)."""
    streams = [stream(eng, p, sp) for p, sp in zip(prompts, params_list)]
    deltas = [[] for _ in streams]
    active = list(range(len(streams)))
    while active:
        for i in list(active):
            try:
                deltas[i].append(next(streams[i]))
            except StopIteration:
                active.remove(i)
    return [(d, s.output) for d, s in zip(deltas, streams)]


@pytest.fixture(scope="module")
def streamed_alone(loaded):
    """Each of STREAM_PROMPTS streamed alone on an engine with room to spare: (deltas, output) per request."""
    roomy = make_engine(loaded, max_model_len=MAX_LEN)
    alone = [_run_streams(roomy, [p], [sp])[0] for p, sp in zip(STREAM_PROMPTS, STREAM_PARAMS)]
    assert roomy.num_preemptions == 0
    assert len({o.text for _, o in alone}) == len(alone) and all(o.text for _, o in alone)
    assert all("".join(deltas) == o.text for deltas, o in alone)
    return alone


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-logic"])
def test_preempted_streaming_requests_stream_what_they_stream_alone(loaded, streamed_alone, graphs):
    """Five streaming requests (four greedy, one seeded and sampled) in a KV pool of 16 blocks of 4 tokens, which
    cannot hold them all: the scheduler preempts some of them part-way through their output and recomputes them.
    Each one streams exactly its final text, which is its tokens' text; its tokens and text equal its run alone on
    an engine with room to spare up to the rounding a batch shape may move (tests/batch_shape.py: for the greedy
    requests, to a first difference at a near tie; for the sampled one, at a draw that close).
    `graph-logic`: the CUDA-graph path's logic run eagerly (decode steps launched ahead of the booking, short
    prompt chunks through the prefill-graph buffers), as on the GPU.
    Planted bugs that turn this red (each alone, in `Scheduler._preempt`): restarting the sequence's output
    (token_ids cut back to the prompt, to be regenerated) while the detokenizer keeps its state: the tokens come out
    equal, but the streamed and final text hold the pre-preemption text twice; and starting the recomputed sequence
    on a fresh detokenizer and stop-string matcher: the final text loses what was streamed before the preemption."""
    small = make_engine(loaded, max_model_len=64, kv_cache_tokens=64, block_size=4, max_num_batched_tokens=16,
                        max_num_seqs=8)
    if graphs:
        replay = lambda step: SimpleNamespace(replay=step)  # noqa: E731
        small.runner.capture_decode_graphs(graph_factory=replay)
        small.runner.capture_prefill_graphs(16, graph_factory=replay)
    preempted = []  # (sampled, output tokens, text streamed) of each sequence at its preemption
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (
        preempted.append((seq.params.temperature > 0, seq.num_output_tokens, seq.matcher.emitted)), preempt(seq))
    got = _run_streams(small, STREAM_PROMPTS, STREAM_PARAMS)
    # the test exercises preemption part-way through a stream, a greedy and the sampled request's (should a change
    # of the scheduling policy move the preemptions, retune the pool or the lengths until both hold again)
    assert small.num_preemptions > 0
    assert {sampled for sampled, n_out, emitted in preempted if n_out > 0 and emitted > 0} == {False, True}, preempted
    assert not graphs or small.num_steps_ahead > 0
    while small._inflight:
        small.step()
    assert small.blocks.num_free == small.blocks.num_blocks  # every block came back
    tokenizer = loaded[1]
    for i, ((deltas, out), (_, want)) in enumerate(zip(got, streamed_alone)):
        assert out.finish_reason == "length" and len(out.token_ids) == STREAM_PARAMS[i].max_tokens, i
        # one run's own text, exactly: what it streamed is its final text, and that is its tokens' text
        assert "".join(deltas) == out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True), i
        # against the run alone, a batch shape apart: the same tokens and text up to a near tie, and each token the
        # choice of its context's logits to the end, past the preemption (tests/batch_shape.py)
        assert_same_run(out, want, STREAM_PARAMS[i], model=small, context=i)
