"""The rule the CPU tests hold runs of different batch shapes to (tests/batch_shape.py), checked on its own: a draw
it calls clear is the draw of every row whose logits lie within ROUNDING_ATOL (else a test could fail on a BLAS that
rounds within the bound), and it calls most draws clear (else the tests comparing sampled runs would compare
nothing). Planted bugs that turn it red: a slack of ROUNDING_ATOL / T instead of twice that (a pair of z's moves
by the sum of two moves); the top-k edge taken as the k-th z without its slack."""
from types import SimpleNamespace

import numpy as np
import pytest

from batch_shape import GREEDY, ROUNDING_ATOL, assert_same_run, choice, draw_may_flip
from xserv.sampling import SamplingParams

VOCAB = 4096
PARAMS = [GREEDY,
          SamplingParams(temperature=1.0, seed=3),
          SamplingParams(temperature=0.7, top_k=50, seed=4),
          SamplingParams(temperature=1.0, top_p=0.9, seed=7),
          SamplingParams(temperature=0.8, min_p=0.05, seed=2),
          SamplingParams(temperature=0.6, top_k=20, top_p=0.8, seed=1),
          SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=5)]


def _moves(rng, row, winner):
    """Rows within ROUNDING_ATOL of `row`: random signs; the winner down and the rest up, and the reverse; the
    tokens above the winner up and the others down (more mass above it: the top-p edge), and the reverse."""
    a = np.float32(ROUNDING_ATOL * 0.999)
    yield row + rng.choice([-a, a], row.shape[0]).astype(np.float32)
    for sign in (a, -a):
        moved = row + sign
        moved[winner] -= 2 * sign
        yield moved
        yield row + np.where(row > row[winner], sign, -sign).astype(np.float32)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
                                                       f"-r{p.repetition_penalty}")
def test_a_clear_draw_stands_for_every_row_within_the_bound(params, rng):
    prompt, clear = [5, 6, 7], 0
    for step in range(40):
        # logits like the tiny models': a spread of about 1, a few tokens well above the rest now and then
        row = (rng.standard_normal(VOCAB) * rng.uniform(0.3, 1.5)).astype(np.float32)
        row[rng.integers(0, VOCAB, 3)] += rng.uniform(0, 4, 3).astype(np.float32)
        output = rng.integers(0, VOCAB, step % 5).tolist()
        if draw_may_flip(row, params, prompt, output):
            continue
        clear += 1
        winner = choice(row, params, prompt, output)
        for moved in _moves(rng, row, winner):
            assert choice(moved, params, prompt, output) == winner, step
    assert clear >= 20, clear  # most draws are clear: the comparisons compare something


def _out(tokens, logprobs=None):
    return SimpleNamespace(prompt_token_ids=[1, 2], token_ids=tokens, text=" ".join(map(str, tokens)),
                           logprobs=logprobs)


def test_a_first_difference_must_be_a_near_tie():
    step = lambda token, second: {"token_id": token, "logprob": -1.0, "top": [(token, -1.0), (9, second)]}  # noqa: E731
    want = _out([3, 4, 5], [step(3, -3.0), step(4, -1.01), step(5, -3.0)])
    assert assert_same_run(_out([3, 4, 5]), want) == 3
    assert assert_same_run(_out([3, 9, 7]), want) == 1  # token 1: the two best 0.01 apart
    with pytest.raises(AssertionError, match="no rounding could flip"):
        assert_same_run(_out([3, 4, 9]), want)  # token 2: 2.0 apart
    with pytest.raises(AssertionError):
        assert_same_run(_out([3, 4, 5], [step(3, -3.0), step(4, -1.01), {**step(5, -3.0), "logprob": -1.5}]), want)
