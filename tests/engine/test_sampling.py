"""SamplingParams, and the engine's sampling semantics (the NumPy reference of xserv/ops/sampling.py, which the CPU
backend runs and the CUDA kernel is tested against) checked against a plain, sort-everything implementation of the
documented semantics."""
import math

import numpy as np
import pytest

from xserv.ops import sampling as op
from xserv.sampling import SamplingParams


def _row(params: SamplingParams, seed: int = 0, step: int = 0, penalties: bool = False):
    """The row parameters the engine's sampler hands the op, as the op sees them (float32-rounded)."""
    row = op.RowParams(params.temperature, max(params.top_k, 0), params.top_p, params.min_p,
                       params.repetition_penalty, params.presence_penalty, params.frequency_penalty, seed, step,
                       0 if penalties else -1)
    return op.unpack_row(*(a[0] for a in op.pack_sampling_params([row])))


def _state(vocab: int, prev):
    """Penalty state of a sequence whose prompt + output so far is `prev` (ids outside the vocabulary ignored)."""
    seen = np.zeros(vocab, np.uint8)
    ids = [int(t) for t in prev if 0 <= int(t) < vocab]
    seen[ids] = 1
    counts = np.zeros(vocab, np.int32)
    return counts, seen


def probs(logits, params: SamplingParams, prev=()) -> np.ndarray:
    """The distribution the sampler draws from."""
    counts, seen = _state(len(logits), prev)
    return op.sampling_distribution_reference(logits, _row(params, penalties=True), counts, seen)


def sample(logits, params: SamplingParams, prev=(), seed: int = 0, step: int = 0) -> int:
    counts, seen = _state(len(logits), prev)
    return op.sample_row_reference(logits, _row(params, seed, step, penalties=True), counts, seen)


# ---- brute-force reference: one plain, sort-everything implementation of the documented semantics --------------
def reference_probs(logits, p: SamplingParams, prev=()):
    x = np.asarray(logits, np.float64).copy()
    if p.repetition_penalty != 1.0:
        for t in set(int(i) for i in prev):
            if 0 <= t < len(x):
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = np.zeros(len(x))
    if p.temperature == 0:
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / p.temperature
    keep = np.ones(len(x), bool)
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        keep &= x >= kth
    prob = np.where(keep, np.exp(x - x.max()), 0.0)
    prob /= prob.sum()
    if p.top_p < 1.0:
        order = sorted(np.flatnonzero(keep), key=lambda i: -prob[i])
        acc, last = 0.0, None
        for i in order:
            last = prob[i]
            acc += prob[i]
            if acc >= p.top_p:
                break
        keep &= prob >= last
    if p.min_p > 0:
        keep &= prob >= p.min_p * prob.max()
    prob = np.where(keep, prob, 0.0)
    return prob / prob.sum()


def assert_probs_close(got, want):
    assert np.array_equal(got > 0, want > 0), (np.flatnonzero(got > 0), np.flatnonzero(want > 0))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_k=40, temperature=0.5),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=0.8),
    SamplingParams(top_p=0.01),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.9, temperature=2.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, top_k=10),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.1),
]


@pytest.mark.parametrize("params", PARAMS, ids=repr)
@pytest.mark.parametrize("vocab", [7, 100, 3000])
def test_filters_match_brute_force(params, vocab, rng):
    for scale in (0.5, 3.0):
        logits = (rng.standard_normal(vocab) * scale + 0.3).astype(np.float32)
        prev = rng.integers(0, vocab, size=min(vocab, 12)).tolist()
        assert_probs_close(probs(logits, params, prev), reference_probs(logits, params, prev))


def test_top_p_large_vocab_probe_and_fallback(rng):
    v = 151936
    for scale, top_p in ((8.0, 0.9), (0.5, 0.95), (3.0, 0.5)):  # peaked (nucleus found in the probe) and flat
        logits = (rng.standard_normal(v) * scale).astype(np.float32)
        p = SamplingParams(top_p=top_p)
        assert_probs_close(probs(logits, p), reference_probs(logits, p))


def test_top_k_ties_kept():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 0.0], np.float32)
    assert set(np.flatnonzero(probs(logits, SamplingParams(top_k=2)))) == {1, 2, 3}


def test_top_p_always_keeps_one():
    logits = np.array([10.0, 0.0, 0.0], np.float32)
    assert probs(logits, SamplingParams(top_p=1e-9)).tolist() == [1.0, 0.0, 0.0]


def test_repetition_penalty_semantics():
    logits = np.array([2.0, -2.0, 1.0, 0.0], np.float32)
    got = probs(logits, SamplingParams(repetition_penalty=2.0), [0, 1, 1, 99, -1])
    want = np.exp([1.0, -4.0, 1.0, 0.0])  # positive logits divided, negative ones multiplied; 99 and -1 ignored
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-6)
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.0]  # input untouched


def test_greedy_argmax_lowest_index_on_ties(rng):
    logits = np.array([0.0, 5.0, 5.0, 1.0], np.float32)
    p = SamplingParams(temperature=0.0)
    assert sample(logits, p) == 1
    big = rng.standard_normal(151936).astype(np.float32)
    assert sample(big, p) == int(np.argmax(big))
    # greedy sees the repetition penalty
    assert sample(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), [1]) == 2


def test_seed_reproducible(rng):
    """A draw is keyed by (seed, position): the same pair gives the same token, other seeds other sequences."""
    logits = rng.standard_normal(1000).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.95)
    a = [sample(logits, p, seed=123, step=i) for i in range(50)]
    assert [sample(logits, p, seed=123, step=i) for i in range(50)] == a
    assert len(set(a)) > 5
    assert [sample(logits, p, seed=124, step=i) for i in range(50)] != a


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_k=4, temperature=1.5),
                                    SamplingParams(top_p=0.8), SamplingParams(min_p=0.2, repetition_penalty=1.5)],
                         ids=repr)
def test_draws_follow_the_distribution(params):
    logits = np.array([1.0, 2.0, 0.5, -1.0, 1.5, 0.0, 2.2, -0.3], np.float32)
    prev = [1, 3]
    want = reference_probs(logits, params, prev)
    # Each draw runs the reference sampler over Philox noise (~0.5 ms). 1000 draws: halved noise (w2 0.06-0.21, see
    # tests/ops/test_sampling_op.py's chi-square notes) or a repetition penalty the draw ignores (0.10) fail the
    # 6-sd bound below with probability > 0.9999; a shift of w2 >= 0.1 with probability > 0.999 (at most 7 dof).
    n = 1000
    counts = np.bincount([sample(logits, params, prev, seed=2024, step=i) for i in range(n)], minlength=len(logits))
    assert np.all(counts[want == 0] == 0)
    nz = want > 0
    expected = want[nz] * n
    chi2 = float((((counts[nz] - expected) ** 2) / expected).sum())
    dof = int(nz.sum()) - 1
    # mean dof, sd sqrt(2 dof): 6 sd is a clear failure, never a flaky one (fixed seed anyway)
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 1, (chi2, dof, counts, expected)


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float32("nan")])
def test_non_finite_params_say_finite(name, value):
    """Not a range message ("must be in (0, 1], got nan" reads as if nan were a number out of range)."""
    with pytest.raises(ValueError, match=f"^{name} must be finite, got (nan|inf|-inf)$"):
        SamplingParams(**{name: value})


def test_params_normalised():
    p = SamplingParams(stop="END", stop_token_ids=(5, 7), top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.stop_token_ids == [5, 7] and p.greedy
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=None).stop == []
    hash(p)
    with pytest.raises(Exception):
        p.temperature = 1.0
    # top_k -1 and 0 both mean off
    logits = np.arange(10, dtype=np.float32)
    assert np.allclose(probs(logits, SamplingParams(top_k=-1)), probs(logits, SamplingParams(top_k=0)))
    assert np.count_nonzero(probs(logits, SamplingParams(top_k=-1))) == 10


def test_full_vocab_draws_land_where_the_reference_puts_mass(rng):
    """Qwen3's full vocabulary with a long history: the partial-partition paths (top-k, the nucleus probe) and the
    penalty agree with the brute-force reference, and every draw is a token it gives probability. (How fast the
    sampler is belongs to benchmarks, not to a unit test.)"""
    logits = (rng.standard_normal(151936) * 3).astype(np.float32)
    prev = list(range(0, 3000, 3))
    for p in (SamplingParams(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.1),
              SamplingParams(top_p=0.95, min_p=0.05)):
        want = reference_probs(logits, p, prev)
        assert_probs_close(probs(logits, p, prev), want)
        assert all(want[sample(logits, p, prev, seed=0, step=i)] > 0 for i in range(10)), p
