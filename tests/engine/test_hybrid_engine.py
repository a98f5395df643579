"""The engine with a hybrid Gated DeltaNet model on the NumPy backend: per-sequence state slots taken at admission and
returned at finish, abort and preemption; a request alone and inside a batch of mixed lengths agree; preempted and
recomputed = uninterrupted; the head's padding rows are never sampled; prefix caching is off with a notice."""
import logging

import numpy as np
import pytest

from batch_shape import assert_same_run
from engine_driver import generate
from xserv.sampling import SamplingParams

# slow: each test generates a few hundred tokens through a 248k-row head on the NumPy backend (~1 min apiece)
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MAX_LEN = 256
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(model, tokenizer, eos ids) of the tiny hybrid checkpoint (Qwen3.5's release layout and tokenizer)."""
    from xserv.models.checkpoint import CheckpointReader
    from xserv.models.random_checkpoint import make_test_model
    from xserv.models.registry import config_from_pretrained, model_class
    from xserv.tokenizer import Tokenizer

    folder = make_test_model("qwen3.5-tiny", tmp_path_factory.mktemp("hybrid") / "tiny")
    config = config_from_pretrained(folder)
    with CheckpointReader(folder) as reader:
        model = model_class(config).from_checkpoint(config, reader, "cpu", progress=False, max_positions=MAX_LEN)
    tokenizer = Tokenizer.from_folder(folder)
    return model, tokenizer, set(config.eos_token_id) | set(tokenizer.eos_token_ids)


def make_engine(loaded, **config):
    from xserv.engine.config import EngineConfig
    from xserv.engine.llm_engine import LLMEngine

    model, tokenizer, eos = loaded
    return LLMEngine.from_model(model, tokenizer, EngineConfig(**config), context_len=MAX_LEN, eos_token_ids=eos)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 248000, int(rng.integers(3, 60)))) for _ in range(n)]


def test_batch_equals_alone_and_slots_come_back(loaded, caplog):
    with caplog.at_level(logging.INFO, logger="xserv"):
        eng = make_engine(loaded, max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=64)
    assert "prefix caching is off" in caplog.text and not eng.config.enable_prefix_caching
    assert eng.kv_cache.state is not None and eng.kv_cache.state.num_slots == 8
    assert eng.vocab_size == loaded[1].vocab_size < loaded[0].config.vocab_size  # padding rows cut off the head
    ps = prompts(12)
    together = generate(eng, ps, [GREEDY] * len(ps))  # 12 requests over 8 slots, prefills in 64-token chunks
    assert sorted(eng.scheduler._free_slots) == list(range(8))
    for i, p in enumerate(ps):
        alone = generate(make_engine(loaded, max_model_len=MAX_LEN, max_num_seqs=1), [p], [GREEDY])[0]
        assert len(together[i].token_ids) == GREEDY.max_tokens
        assert_same_run(together[i], alone, GREEDY, context=i)


def test_preempted_equals_uninterrupted(loaded):
    """A KV pool too small for every sequence at once: the newest ones are preempted (slot freed) and recomputed
    from their tokens, whose state then starts from zeros again."""
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)
    ps = prompts(6, seed=1)
    small = make_engine(loaded, max_model_len=128, kv_cache_tokens=160, block_size=4, max_num_seqs=6)
    got = generate(small, ps, [params] * len(ps))
    assert small.num_preemptions > 0
    assert sorted(small.scheduler._free_slots) == list(range(6))
    big = make_engine(loaded, max_model_len=128, max_num_seqs=6)
    want = generate(big, ps, [params] * len(ps))
    for i in range(len(ps)):
        assert_same_run(got[i], want[i], params, context=i)


def test_sampling_never_returns_a_padding_row(loaded):
    eng = make_engine(loaded, max_model_len=MAX_LEN, max_num_seqs=4, seed=3)
    hot = SamplingParams(temperature=5.0, max_tokens=64, ignore_eos=True)
    outs = generate(eng, prompts(4, seed=2), [hot] * 4)
    assert all(0 <= t < loaded[1].vocab_size for o in outs for t in o.token_ids)
