"""engine/sampler.py on the CPU: each row of a step sampled with its own request's parameters (temperature, top-k/p,
min-p, penalties over its own prompt and output, logit bias, seed and position), checked against a NumPy reference
built here from the requests alone. The sampling op's own kernel-vs-reference checks are tests/ops' business."""
from types import SimpleNamespace

import numpy as np
import pytest

from xserv.engine.sampler import Sampler
from xserv.ops import sampling as op
from xserv.sampling import SamplingParams
from xserv.tensor import Tensor, float32

VOCAB = 64


def make_seq(seq_id, params, prompt, outputs=(), slot=0, seed=None):
    prompt, outputs = list(prompt), list(outputs)
    return SimpleNamespace(seq_id=seq_id, params=params, seed=seq_id * 7 + 1 if seed is None else seed,
                           token_ids=prompt + outputs, output_ids=outputs, slot=slot, packed_params=None,
                           constraint=None)


def reference_token(logits_row, seq, ahead=0) -> int:
    """The token a row must get: bias, then (for requests with penalties) repetition over prompt and output and
    presence/frequency over the output, then greedy argmax or the op's seeded draw at the row's position."""
    p = seq.params
    z = np.asarray(logits_row, np.float32).copy()
    if p.logit_bias:
        for t, b in p.logit_bias.items():
            z[t] += np.float32(b)
    seen = np.zeros(VOCAB, bool)
    seen[seq.token_ids] = True
    counts = np.bincount(np.asarray(seq.output_ids, np.int64), minlength=VOCAB)
    if p.repetition_penalty != 1.0:
        r = np.float32(p.repetition_penalty)
        z[seen] = np.where(z[seen] > 0, z[seen] / r, z[seen] * r)
    penalty = np.float32(p.presence_penalty) * (counts > 0) + np.float32(p.frequency_penalty) * counts
    z = z - penalty.astype(np.float32)
    if p.temperature == 0.0:
        return int(np.argmax(z))
    row = op.RowParams(p.temperature, p.top_k, p.top_p, p.min_p, seed=seq.seed, step=len(seq.token_ids) + ahead)
    return op.sample_row_reference(z, row)


def logits_for(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, VOCAB)) * 2 + 0.5).astype(np.float32)


def sample(sampler, logits, seqs, ahead=0):
    return sampler.sample(Tensor.from_numpy(logits, "cpu", float32), seqs, ahead=ahead).fetch()


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.7, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, logit_bias={3: 30.0, 9: -100.0}),
]


def test_each_row_follows_its_own_request():
    """A batch of requests with different parameters, each row against the reference of its own request.
    Planted bugs seen red: every row packed with the first sequence's parameters (seqs[0].packed_params read for
    each row); and the penalty slot left out of a penalised row's parameters (its penalties never applied)."""
    sampler = Sampler(VOCAB, max_rows=8, device="cpu", engine_seed=1)
    seqs = [make_seq(i, p, prompt=[1 + i, 2 + i, 3], outputs=[4 + i, 4 + i, 11], slot=i) for i, p in enumerate(MIXED)]
    for step in range(3):
        logits = logits_for(len(seqs), seed=step)
        for i, s in enumerate(seqs):  # a row's own tokens lead, so its penalties decide its draw
            logits[i, s.token_ids] += 4.0
        tokens, lp, _, _ = sample(sampler, logits, seqs)
        assert lp is None
        assert tokens.tolist() == [reference_token(logits[i], s) for i, s in enumerate(seqs)], step
        for s, t in zip(seqs, tokens):  # book the token as the engine would
            s.token_ids.append(int(t))
            s.output_ids.append(int(t))


def test_a_seeded_row_draws_the_same_whatever_its_neighbours_and_ahead_shifts_the_position():
    """Planted bug seen red: the row's position taken without `ahead` (an overlapped step drew the previous
    position's token)."""
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = logits_for(4, seed=5)
    alone = Sampler(VOCAB, 4, "cpu")
    seq = make_seq(0, params, prompt=[1, 2, 3], slot=0, seed=1234)
    [t_alone] = sample(alone, logits[:1], [seq])[0].tolist()
    crowd = Sampler(VOCAB, 4, "cpu")
    others = [make_seq(i, SamplingParams(temperature=0.5, top_k=3), [5, 6], slot=i) for i in (1, 2, 3)]
    seq2 = make_seq(0, params, prompt=[1, 2, 3], slot=0, seed=1234)
    t_crowd = sample(crowd, np.concatenate([logits[1:], logits[:1]]), others + [seq2])[0][-1]
    assert t_alone == t_crowd == reference_token(logits[0], seq)
    draws = {sample(Sampler(VOCAB, 1, "cpu"), logits[:1], [make_seq(0, params, [1, 2, 3], seed=1234)], ahead=a)[0][0]
             for a in range(6)}
    for a in range(6):
        s = make_seq(0, params, [1, 2, 3], seed=1234)
        assert sample(Sampler(VOCAB, 1, "cpu"), logits[:1], [s], ahead=a)[0][0] == reference_token(logits[0], s, a)
    assert len(draws) > 1  # the position keys the draw


def test_penalty_rows_follow_the_slot_owner():
    """A sequence's penalties count its own output so far (a preempted one coming back included), and a slot reused
    by another sequence starts from that sequence's prompt and output, not the last owner's counts.
    Planted bugs seen red: leaving the output counts at zero after penalty_reset; and _prepare_penalties skipping
    the reset whenever the slot had any owner (checking the slot, not the sequence)."""
    sampler = Sampler(VOCAB, 2, "cpu")
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, :8] = np.arange(8, 0, -1)  # token 0 best, then 1, 2, ...
    a = make_seq(10, SamplingParams(temperature=0.0, frequency_penalty=2.0), prompt=[3], outputs=[0], slot=0)
    assert sample(sampler, logits, [a])[0][0] == reference_token(logits[0], a) == 1
    b = make_seq(11, SamplingParams(temperature=0.0, repetition_penalty=3.0), prompt=[5], slot=0)
    assert sample(sampler, logits, [b])[0][0] == reference_token(logits[0], b) == 0  # a's tokens not penalised


def test_logit_bias_rows_follow_the_slot_owner_and_logprobs_are_per_request():
    """Planted bug seen red: the bias row reused for a new owner of the slot (the old request's bias applied to
    the new one); and logprobs returned for no row when only the last request asked."""
    sampler = Sampler(VOCAB, 2, "cpu")
    logits = logits_for(2, seed=9)
    biased = make_seq(1, SamplingParams(temperature=0.0, logit_bias={7: 50.0}), [1], slot=0)
    plain = make_seq(2, SamplingParams(temperature=0.0, logprobs=2), [1], slot=1)
    tokens, lp, top_ids, top_lp = sample(sampler, logits, [biased, plain])
    assert tokens.tolist() == [7, int(np.argmax(logits[1]))]
    assert top_ids.shape == (2, op.MAX_TOP_LOGPROBS) and lp is not None
    ref = logits[1].astype(np.float64) - np.log(np.exp(logits[1].astype(np.float64)).sum())
    assert lp[1] == pytest.approx(ref[tokens[1]], abs=1e-4)
    assert top_ids[1, :2].tolist() == np.argsort(-logits[1])[:2].tolist()
    other = make_seq(3, SamplingParams(temperature=0.0, logit_bias={8: 50.0}), [1], slot=0)
    assert sample(sampler, logits[:1], [other])[0].tolist() == [8]
    assert sample(sampler, logits[:1], [make_seq(4, SamplingParams(temperature=0.0), [1], slot=0)])[0].tolist() == \
        [int(np.argmax(logits[0]))]


def test_request_seed():
    """A request's seed wins; else the engine seed and request id derive one; else each call is fresh.
    Planted bug seen red: ignoring the request id in the derived seed (every unseeded request of a seeded engine
    drew the same tokens)."""
    s = Sampler(VOCAB, 1, "cpu", engine_seed=5)
    assert s.request_seed(3, 99) == 99
    assert s.request_seed(3, None) == s.request_seed(3, None) != s.request_seed(4, None)
    fresh = Sampler(VOCAB, 1, "cpu")
    assert len({fresh.request_seed(3, None) for _ in range(4)}) == 4


def test_row_count_mismatch_is_an_internal_error():
    """Planted bug seen red: sampling min(rows, sequences) rows silently."""
    with pytest.raises(RuntimeError, match="logit rows"):
        sample(Sampler(VOCAB, 4, "cpu"), logits_for(2), [make_seq(0, SamplingParams(), [1])])
