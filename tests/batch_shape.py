"""What two CPU-backend runs of the same request share when they differ only in batch shape (alone or among others,
a prefix computed or served from the cache, chunked, preempted and recomputed, padded to a CUDA-graph bucket), for
any BLAS.

The CPU backend rounds activations to bf16 where the GPU kernels do. A BLAS may sum a GEMM row's products in an order
that depends on the shape (OpenBLAS picks its kernel by the row count), so a float32 sum can move by an ulp and the
bf16 value rounded from it by one bf16 ulp (2^-8 relative). Through the tiny test models that moved a logprob by up
to 4.0e-3: measured with float64 sums for half the row counts (`XSERV_TEST_OTHER_BLAS=1`, tests/conftest.py), and
the same 4.0e-3 was reported with OpenBLAS 0.3.31 on an AMD EPYC. So two such runs agree:

- on every logit and logprob to ROUNDING_ATOL, five times the largest move measured, wherever they have seen the
  same tokens;
- on every token up to the first one they choose differently, and that step must be one whose choice a move of
  ROUNDING_ATOL could flip: for a greedy request, its two best logprobs within NEAR_TIE of each other; for a seeded
  sampled one (Philox keyed by the seed and the position: the same draw whatever else is in the batch), a
  Gumbel-max draw (xserv/ops/sampling.py) won by less than its values may move, or a token near the edge of its
  top-k / top-p / min-p set. After a different token the two continuations are different texts;
- on the whole text when they agree on every token.

After a first difference the two runs have nothing more in common; so that a fault showing late in a run (after a
preemption, say) cannot hide behind an earlier near tie, each token from there on is checked against logits
computed afresh for its own context (`assert_follows_logits`): it is their choice but where a rounding may flip it.
An unseeded sampled request has nothing to compare. A MoE model has near ties of its own, two experts' router
logits within NEAR_TIE, where a rounding moves its logits by more (test_moe_model pins them). A cached block served
after the wrong prefix moves a logprob by far more (planted in test_engine_invariants: 0.54, and other tokens), and
so do the faults the other tests plant, so the bound still catches what these tests exist for."""
from __future__ import annotations

import math

import numpy as np

from xserv.sampling import SamplingParams

ROUNDING_ATOL = 2e-2
NEAR_TIE = 2 * ROUNDING_ATOL  # two logprobs that may each move by ROUNDING_ATOL may swap when closer than this
GREEDY = SamplingParams(temperature=0.0)


def first_difference(got_ids, want_ids) -> int | None:
    """Index of the first token where two runs differ (the shorter one's length when one is a prefix of the
    other), None when they are the same."""
    for i, (g, w) in enumerate(zip(got_ids, want_ids)):
        if g != w:
            return i
    return None if len(got_ids) == len(want_ids) else min(len(got_ids), len(want_ids))


def is_near_tie(best_logprobs) -> bool:
    """A greedy step whose choice a rounding may flip, from its best logprobs (descending; two or more: a step
    listing fewer, such as one whose two best tokens share a text in a completions response, counts as a tie)."""
    best = list(best_logprobs)
    return len(best) < 2 or best[0] - best[1] <= NEAR_TIE


def _row(logits_row, params, prompt_ids, output_ids):
    """(row params, penalty counts, seen) of the sampler's row for the token after prompt_ids + output_ids: its
    position keys the seeded draw; the prompt and output are seen, the output counted (engine/sampler.py)."""
    from xserv.ops import sampling as op

    penalised = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    counts = seen = None
    if penalised:
        vocab = np.asarray(logits_row).shape[0]
        seen = np.zeros(vocab, np.uint8)
        seen[np.asarray([*prompt_ids, *output_ids], np.int64)] = 1
        counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab).astype(np.int32)
    if params.temperature > 0 and params.seed is None:
        raise ValueError("an unseeded sampled request draws afresh in every run: there is nothing to compare")
    p = op.RowParams(params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
                     params.presence_penalty, params.frequency_penalty, params.seed or 0,
                     len(prompt_ids) + len(output_ids), 0 if penalised else -1)
    return p, counts, seen


def choice(logits_row, params, prompt_ids, output_ids) -> int:
    """The token the sampler takes from `logits_row` after prompt_ids + output_ids (greedy or seeded)."""
    from xserv.ops import sampling as op

    p, counts, seen = _row(logits_row, params, prompt_ids, output_ids)
    return int(op.sample_row_reference(np.asarray(logits_row, np.float32), p, counts, seen))


def draw_may_flip(logits_row, params, prompt_ids, output_ids) -> bool:
    """Whether a run in another batch shape may choose another token than `logits_row` gives, at the step after
    prompt_ids + output_ids, with `params` (SamplingParams: greedy, or seeded sampling).

    Every logit of the other run is within ROUNDING_ATOL of `logits_row`'s, so every z (the logit after the
    penalties, over T) moves by at most ROUNDING_ATOL * rho / T (rho: the repetition penalty's factor either way),
    and two z's against each other by `slack`, twice that. The choice stands when its winner is kept however they
    move and beats every token that may be kept by more than `slack`: in z for a greedy step, in z + Gumbel noise
    (xserv/ops/sampling.py's draw) for a sampled one."""
    from xserv.ops import sampling as op

    row = np.asarray(logits_row, np.float32)
    p, counts, seen = _row(row, params, prompt_ids, output_ids)
    rho = max(p.repetition_penalty, 1 / p.repetition_penalty)
    slack = 2 * ROUNDING_ATOL * rho / (1.0 if p.greedy else p.temperature)
    z = op._penalized_scaled(row, p, counts, seen).astype(np.float64)
    if p.greedy:
        top2 = np.partition(z, -2)[-2:]
        return bool(top2[1] - top2[0] <= slack)
    maybe, surely = _kept_bounds(z, p, slack)
    winner = int(op.sample_row_reference(row, p, counts, seen))
    if not surely[winner]:
        return True
    score = z[winner] + float(op.gumbel_noise(p.seed, p.step, np.array([winner]))[0])
    rivals = np.flatnonzero(maybe & (z >= score - slack - float(op._GUMBEL_MAX)))  # the others cannot come close
    rivals = rivals[rivals != winner]
    return bool(np.any(z[rivals] + op.gumbel_noise(p.seed, p.step, rivals) >= score - slack))


def _kept_bounds(z: np.ndarray, p, slack: float) -> tuple[np.ndarray, np.ndarray]:
    """(maybe, surely) bool [V]: the tokens that the top-k / top-p / min-p filters of xserv/ops/sampling.py may
    keep, and those they keep, in any run whose z's differ from `z` by at most `slack` relative to each other. The
    kept set is the intersection of the filters' sets; top-p works within the top-k set."""
    v = z.shape[0]
    order = np.argsort(-z, kind="stable")
    zs = z[order]  # descending
    maybe = np.ones(v, bool)
    surely = np.ones(v, bool)
    n_sup = n_sub = v  # top-k: the candidates top-p sees, at most / at least
    if 0 < p.top_k < v:
        n_sup = int(np.count_nonzero(zs >= zs[p.top_k - 1] - slack))
        n_sub = int(np.count_nonzero(zs > zs[p.top_k] + slack))
        maybe[n_sup:] = surely[n_sub:] = False
    if p.top_p < 1.0:
        # Each token's weight exp(z) moves by a factor within e^(+-slack/2) against a common one, so a ratio of two
        # masses by e^(+-slack). A token is kept iff the mass ranked strictly above it is below top_p of the
        # candidates' mass: bound the first from above (anything within slack may overtake it) and the second from
        # below (the fewest candidates), and the other way round for the tokens that cannot be kept.
        cum = np.concatenate([[0.0], np.cumsum(np.exp(zs - zs[0]))])
        neg = -zs  # ascending: count of zs > t = searchsorted(neg, -t, "left")
        above_at_most = cum[np.minimum(np.searchsorted(neg, -(zs - slack), "left"), n_sup)]
        above_at_least = cum[np.minimum(np.searchsorted(neg, -(zs + slack), "left"), n_sub)]
        surely &= math.exp(slack) * above_at_most < p.top_p * cum[n_sub]
        maybe &= math.exp(-slack) * above_at_least < p.top_p * cum[n_sup]
    if p.min_p > 0.0:
        edge = zs[0] + math.log(p.min_p)
        maybe &= zs >= edge - slack
        surely &= zs >= edge + slack
    out_maybe, out_surely = np.empty(v, bool), np.empty(v, bool)
    out_maybe[order], out_surely[order] = maybe, surely
    return out_maybe, out_surely


def assert_same_run(got, want, params=None, model=None, context=None) -> int:
    """`got` and `want` (RequestOutputs of the same request, `params` its SamplingParams: greedy when None) agree as
    the module says. The step where they first choose differently must be one whose choice may flip: judged from
    `want`'s logprobs (a greedy request asked with logprobs >= 2) or from the logits that `model` (an LLM or
    LLMEngine) computes for want's tokens up to that step. Given `model`, got's tokens from there on must follow
    their own context's logits (`assert_follows_logits`). Returns how many tokens were compared with want's (want's
    length when the runs agree on every token)."""
    params = params or GREEDY
    penalised = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    differ = first_difference(got.token_ids, want.token_ids)
    if differ is not None:
        assert differ < len(want.token_ids), (context, "got runs on after want ended", differ)
        top = want.logprobs[differ]["top"] if want.logprobs is not None else []
        if params.temperature == 0 and not penalised and len(top) >= 2:
            may_flip = is_near_tie(lp for _, lp in top)
        else:
            assert model is not None, "a greedy request asked without logprobs, or a sampled one: give the model"
            prompt, before = list(want.prompt_token_ids), list(want.token_ids[:differ])
            may_flip = draw_may_flip(model.logits(prompt + before)[-1], params, prompt, before)
        assert may_flip, (context, f"token {differ} differs where no rounding could flip it",
                          got.token_ids, want.token_ids)
    else:
        assert got.text == want.text, (context, got.text, want.text)
    compared = len(want.token_ids) if differ is None else differ
    if got.logprobs is not None and want.logprobs is not None:
        # the same tokens so far, so the same logprobs up to rounding, at the first differing step too
        for i in range(min(compared + 1, len(got.logprobs), len(want.logprobs))):
            g, w = got.logprobs[i], want.logprobs[i]
            if g["token_id"] == w["token_id"]:
                assert abs(g["logprob"] - w["logprob"]) <= ROUNDING_ATOL, (context, i, g["logprob"], w["logprob"])
            # the top lists' ids may swap at a near tie inside the list: compare each id's logprob where both list it
            gl, wl = dict(g["top"]), dict(w["top"])
            assert gl.keys() & wl.keys() or not wl, (context, i)
            for token in gl.keys() & wl.keys():
                assert abs(gl[token] - wl[token]) <= ROUNDING_ATOL, (context, i, token, gl[token], wl[token])
    if model is not None and differ is not None:
        assert_follows_logits(got, params, model, context, start=differ)
    return compared


def assert_same_runs(got, want, params=None, model=None, context=None) -> int:
    """`assert_same_run` over lists of runs, `params` one SamplingParams for all or a list with one per run. Returns
    the tokens compared."""
    params = params if isinstance(params, list) else [params] * len(want)
    assert len(got) == len(want) == len(params), context
    return sum(assert_same_run(g, w, p, model, (context, i)) for i, (g, w, p) in enumerate(zip(got, want, params)))


def assert_follows_logits(out, params, model, context=None, start: int = 0) -> None:
    """Each token of `out` from `start` on (a RequestOutput of a greedy or seeded request with `params`) is the one
    that the logits of its own context, computed afresh by `model` (an LLM or LLMEngine: another batch shape),
    choose, except where a rounding may flip that choice. Unlike a comparison with another run, this one does not
    stop at a first difference: it checks a run to its end (what came after a preemption, say) whatever a near tie
    did before."""
    params = params or GREEDY
    prompt, ids = list(out.prompt_token_ids), list(out.token_ids)
    if start >= len(ids):
        return
    rows = model.logits(prompt + ids[:-1])[len(prompt) - 1:]
    for i in range(start, len(ids)):
        token = ids[i]
        if choice(rows[i], params, prompt, ids[:i]) != token:
            assert draw_may_flip(rows[i], params, prompt, ids[:i]), (
                context, f"token {i} is not what its context's logits choose, and no rounding could flip it", ids)


def assert_same_completion(got: dict, want: dict, context=None) -> int:
    """Two /v1/completions choices ({"text", "logprobs"}, asked with logprobs >= 2) of the same greedy request a batch
    shape apart agree as the module says, token by token as the response names them (by their text). Two of a
    step's best tokens with the same text leave one key in its top_logprobs: a flip between them shows only at a
    later step, so from such a step on a difference is allowed, and the texts need not be equal. Returns how many
    tokens were compared."""
    g, w = got["logprobs"], want["logprobs"]
    hidden = next((k for k, top in enumerate(w["top_logprobs"]) if len(top) < 2), len(w["tokens"]))
    differ = first_difference(g["tokens"], w["tokens"])
    if differ is not None and differ < hidden:
        assert differ < len(w["tokens"]), (context, "got runs on after want ended", differ)
        assert is_near_tie(sorted(w["top_logprobs"][differ].values(), reverse=True)), (
            context, f"token {differ} differs where no rounding could flip it", g["tokens"], w["tokens"])
    if differ is None and hidden == len(w["tokens"]):
        assert got["text"] == want["text"], (context, got["text"], want["text"])
    compared = min(len(w["tokens"]) if differ is None else differ, hidden)
    for i in range(min(compared + 1, len(g["tokens"]), len(w["tokens"]))):
        if g["tokens"][i] == w["tokens"][i]:
            assert abs(g["token_logprobs"][i] - w["token_logprobs"][i]) <= ROUNDING_ATOL, (context, i)
        gl, wl = g["top_logprobs"][i], w["top_logprobs"][i]
        for token in gl.keys() & wl.keys():
            assert abs(gl[token] - wl[token]) <= ROUNDING_ATOL, (context, i, token, gl[token], wl[token])
    return compared
