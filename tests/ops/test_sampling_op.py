import math
from dataclasses import replace

import numpy as np
import pytest

from xserv.ops.sampling import (mask_bits, masked_biased_reference, I_PENALTY_SLOT, I_SEED_LO, I_STEP, MAX_TOP_LOGPROBS, NUM_F, NUM_I, RowParams, gumbel_noise, pack_sampling_params,
                                penalty_reset, penalty_state, philox4x32_10, sample, sample_reference,
                                sample_row_reference, sampling_distribution_reference, unpack_row)
from xserv.tensor import Tensor, float32, int32
from xserv.testing import poisoned

P_MIN = 1e-4  # chi-square significance: a correct sampler fails one option in 10,000 runs


# ---- helpers ----------------------------------------------------------------------------------------------------
def cpu(a):
    return Tensor.from_numpy(np.asarray(a), "cpu")


def separated_logits(rng, b, v, mean=0.3, std=2.0):
    """Random logits whose values are at least 1e-3 apart within a row (no float near-ties): a random
    permutation of an evenly spaced grid plus small jitter."""
    base = np.linspace(-3 * std, 3 * std, v) + mean
    rows = np.stack([rng.permutation(base) for _ in range(b)])
    return (rows + rng.uniform(-0.2, 0.2, rows.shape) * (6 * std / v)).astype(np.float32)


def chi2_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; categories with expected count < 5 are pooled into one; a draw
    outside the support (expected 0) gives p = 0."""
    n = observed.sum()
    if np.any(observed[expected_p == 0] > 0):
        return 0.0
    exp = expected_p * n
    small = exp < 5
    obs_c = np.append(observed[~small], observed[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    dof = len(obs_c) - 1
    if dof == 0:
        return 1.0
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: a close normal approximation of the chi-square tail
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


def brute_force_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, presence=0.0,
                             frequency=0.0, counts=None, seen=None):
    """Independent oracle in float64 with a full sort (the textbook definitions)."""
    z = np.asarray(logits, np.float64).copy()
    if seen is not None and rep != 1.0:
        m = seen != 0
        z[m] = np.where(z[m] > 0, z[m] / rep, z[m] * rep)
    if counts is not None:
        z = z - presence * (counts > 0) - frequency * counts
    v = z.shape[0]
    if temperature == 0:
        out = np.zeros(v)
        out[np.argmax(z)] = 1
        return out
    z = z / temperature
    keep = np.ones(v, bool)
    if 0 < top_k < v:
        kth = np.sort(z)[::-1][top_k - 1]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        last = int(np.searchsorted(cum, top_p))  # first position whose cumulative mass reaches top_p
        keep &= p >= p[order[min(last, v - 1)]]
    if min_p > 0:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0)
    return q / q.sum()


OPTION_SETS = {
    "temperature": dict(temperature=0.7),
    "temperature_1": dict(temperature=1.0),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "penalties": dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    "all": dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
                frequency_penalty=0.2),
}


def _penalty_rows(rng, v):
    counts = np.zeros(v, np.int32)
    hit = rng.choice(v, v // 4, replace=False)
    counts[hit] = rng.integers(1, 4, hit.size)
    seen = np.zeros(v, np.uint8)
    seen[rng.choice(v, v // 3, replace=False)] = 1
    seen[counts > 0] = 1
    return counts, seen


def _params(options, seed=0, step=0, slot=-1):
    return RowParams(seed=seed, step=step, penalty_slot=slot, **options)


def _packed_params(options, slot=-1):
    """The float32 values the kernel sees, as RowParams (top_p 0.9 is 0.89999998 after packing)."""
    fp, ip = pack_sampling_params([_params(options, slot=slot)])
    return unpack_row(fp[0], ip[0])


# ---- Philox, params ---------------------------------------------------------------------------------------------
def test_philox_known_answers():
    # Random123's kat_vectors for philox4x32_10.
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in philox4x32_10(ctr, key)) == want


def test_gumbel_noise_is_per_token_and_seeded():
    ids = np.array([0, 1, 2, 3, 4, 77, 151935])
    g = gumbel_noise(12345, 9, ids)
    np.testing.assert_array_equal(g, gumbel_noise(12345, 9, ids[::-1])[::-1])
    assert not np.array_equal(g, gumbel_noise(12345, 10, ids))
    assert not np.array_equal(g, gumbel_noise(2**40 + 12345, 9, ids))
    big = gumbel_noise(7, 0, np.arange(200_000))
    assert np.all(np.isfinite(big)) and abs(big.mean() - 0.5772) < 0.01 and abs(big.std() - 1.2825) < 0.01


def test_reference_draw_is_the_gumbel_argmax_over_every_survivor(rng):
    # The reference skips tokens that cannot reach the best perturbed value; the result must equal the plain
    # argmax over every kept token (peaked rows, where the skip drops most of the vocabulary, and flat ones).
    v = 5000
    for row in range(4):
        x = (rng.standard_normal(v) * 2).astype(np.float32)
        if row % 2:
            x[rng.choice(v, 20)] += 15
        for s in range(25):
            p = RowParams(1.0 + 0.3 * row, top_p=0.99 if row == 3 else 1.0, seed=s * 101 + row, step=s)
            z = x * (np.float32(1) / np.float32(p.temperature))
            kept = np.flatnonzero(sampling_distribution_reference(x, p) > 0)
            want = kept[np.argmax(z[kept] + gumbel_noise(p.seed, p.step, kept))]
            assert sample_row_reference(x, p) == want


def test_pack_roundtrip_and_layout():
    rows = [RowParams(0.5, 20, 0.9, 0.1, 1.2, 0.3, -0.4, seed=2**64 - 1, step=2**32 - 1, penalty_slot=3),
            (0.0,), RowParams(top_k=-1)]
    fp, ip = pack_sampling_params(rows)
    assert fp.dtype == np.float32 and fp.shape == (3, NUM_F) and ip.dtype == np.int32 and ip.shape == (3, NUM_I)
    back = unpack_row(fp[0], ip[0])
    assert back.seed == 2**64 - 1 and back.step == 2**32 - 1 and back.penalty_slot == 3 and back.top_k == 20
    assert back.temperature == np.float32(0.5) and back.frequency_penalty == np.float32(-0.4)
    assert unpack_row(fp[1], ip[1]).greedy and unpack_row(fp[2], ip[2]).penalty_slot == -1
    assert np.all(fp[:, 6:] == 0) and np.all(ip[:, 7:] == 0)
    assert np.all(ip[:, 5:7] == -1)  # no mask row, no bias row
    fp, ip = pack_sampling_params([RowParams(mask_row=5, bias_row=2)])
    back = unpack_row(fp[0], ip[0])
    assert back.mask_row == 5 and back.bias_row == 2


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", float("inf")), ("top_p", 0.0),
                                          ("top_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0.0),
                                          ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("seed", -1),
                                          ("seed", 2**64), ("step", -1), ("penalty_slot", -2), ("top_k", 1.5),
                                          ("mask_row", -2), ("bias_row", 2**31),
                                          ("temperature", "hot")])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        pack_sampling_params([RowParams(**{field: value})])


# ---- the reference distribution against an independent oracle ------------------------------------------------
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_distribution_reference_vs_brute_force(rng, name):
    v = 300
    logits = separated_logits(rng, 1, v)[0]
    counts, seen = _penalty_rows(rng, v)
    p = _packed_params(OPTION_SETS[name], slot=0)
    got = sampling_distribution_reference(logits, p, counts, seen)
    want = brute_force_distribution(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                                    p.presence_penalty, p.frequency_penalty, counts, seen)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    assert np.array_equal(got > 0, want > 0)


def test_distribution_reference_keeps_ties():
    logits = np.array([3, 1, 2, 2, 2, 0, -1], np.float32)
    d = sampling_distribution_reference(logits, RowParams(1.0, top_k=2))
    assert np.array_equal(d > 0, [1, 0, 1, 1, 1, 0, 0])  # the 2nd largest value is tied three ways: all kept
    w = np.exp(np.array([3, 2, 2, 2.0]) - 3)
    np.testing.assert_allclose(d[[0, 2, 3, 4]], w / w.sum(), rtol=1e-6)
    # top-p: the nucleus reaches 0.5 at the first 2, and its tie stays
    d = sampling_distribution_reference(np.array([5, 4, 4, 0], np.float32), RowParams(1.0, top_p=0.3))
    assert np.array_equal(d > 0, [1, 0, 0, 0])
    d = sampling_distribution_reference(np.array([5, 4, 4, 0], np.float32), RowParams(1.0, top_p=0.75))
    assert np.array_equal(d > 0, [1, 1, 1, 0])


# ---- chi-square on the CPU op ---------------------------------------------------------------------------------
# What these add to the exact tests above (the distribution against the brute-force oracle, the draw as the Gumbel
# argmax over the kept tokens): that argmax(z + Philox Gumbel noise) does follow the distribution, i.e. that the
# noise is right. Its bugs are gross: noise shared by the 4 tokens of a Philox group moves the option sets'
# distributions by Cohen's w2 = sum((q - p)^2 / p) of 0.04-0.57, halved noise by 0.03-0.53, a draw that ignores
# the temperature by 0.10-0.16 (at T 0.6 and 0.7; the detection test below). Power (noncentral chi-square,
# lambda = n * w2, P_MIN = 1e-4, 6 to 31 pooled degrees of freedom) with CPU_DRAWS = 1000: the first two bugs fail
# six of the seven option sets with probability > 0.9999 each, the third the two sets below temperature 0.9 and
# the detection test (probability 0.9992); any test misses a w2 >= 0.1 shift with probability < 0.001 up to 40
# degrees of freedom. 2000 draws would buy w2 >= 0.05 at twice the CPU time (each draw runs the reference
# sampler, ~0.45 ms); smaller shifts (a 10% temperature error is w2 ~0.01: ~10,000 draws) are the exact tests'
# to catch. The GPU tests draw 40,000-60,000 at a time.
CPU_DRAWS = 1000


def _draw_cpu(logits, options, n, counts=None, seen=None):
    """n draws of the CPU reference (seeds 0..n-1), each seeing the same penalty state."""
    p = _packed_params(options, slot=0 if counts is not None else -1)
    return np.array([sample_row_reference(logits, replace(p, seed=s, step=s % 5), counts, seen) for s in range(n)])


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_cpu_chi_square(rng, name):
    v, n = 64, CPU_DRAWS
    logits = separated_logits(rng, 1, v, std=1.0)[0]
    counts, seen = _penalty_rows(rng, v)
    use_state = "penalt" in name or name == "all"
    tokens = _draw_cpu(logits, OPTION_SETS[name], n, counts if use_state else None, seen if use_state else None)
    p = _packed_params(OPTION_SETS[name], slot=0 if use_state else -1)
    want = sampling_distribution_reference(logits, p, counts if use_state else None, seen if use_state else None)
    assert chi2_pvalue(np.bincount(tokens, minlength=v), want) > P_MIN


def test_cpu_chi_square_detects_a_wrong_distribution(rng):
    # The test has power: the draws at temperature 0.7 fail against the temperature-1 distribution.
    v = 64
    logits = separated_logits(rng, 1, v, std=1.0)[0]
    tokens = _draw_cpu(logits, dict(temperature=0.7), CPU_DRAWS)
    want = sampling_distribution_reference(logits, RowParams(1.0))
    assert chi2_pvalue(np.bincount(tokens, minlength=v), want) < P_MIN


# ---- the CPU op: edge cases, state, logprobs, errors ----------------------------------------------------------
def _run_cpu(logits, rows, counts=None, seen=None, top_n=0, logprobs=False):
    fp, ip = pack_sampling_params(rows)
    b = len(rows)
    out = poisoned((b,), int32, "cpu")
    kw = {}
    if counts is not None:
        kw.update(penalty_counts=counts, penalty_seen=seen)
    if logprobs:
        kw["logprobs_out"] = poisoned((b,), float32, "cpu")
    if top_n:
        kw.update(top_ids_out=poisoned((b, top_n), int32, "cpu"), top_logprobs_out=poisoned((b, top_n), float32, "cpu"))
    sample(cpu(logits), cpu(fp), cpu(ip), out, **kw)
    return out.array, kw


def test_cpu_edge_cases(rng):
    v = 1000
    x = separated_logits(rng, 1, v)[0]
    top = int(np.argmax(x))
    one = np.full(v, -np.inf, np.float32)
    one[417] = -3.0
    rows = [RowParams(1.0, top_k=1, seed=s) for s in range(4)] + [RowParams(0.8, top_p=1e-6, seed=s) for s in range(4)]
    tokens, _ = _run_cpu(np.repeat(x[None], 8, 0), rows)
    assert np.all(tokens == top)
    tokens, _ = _run_cpu(np.repeat(one[None], 3, 0), [RowParams(1.0, seed=1), RowParams(0.0), RowParams(2.0, top_p=0.5)])
    assert np.all(tokens == 417)
    tokens, _ = _run_cpu(np.full((1, 5), -np.inf, np.float32), [RowParams(1.0)])
    assert tokens[0] == 0
    # top_k >= V and top_k <= 0 are off: the same draw as no top-k
    rows = [RowParams(0.9, top_k=k, seed=11, step=3) for k in (0, -1, v, v + 5)]
    tokens, _ = _run_cpu(np.repeat(x[None], 4, 0), rows)
    assert len(set(tokens.tolist())) == 1


def test_cpu_frequency_presence_and_repetition_penalties():
    v = 8
    logits = np.array([2.0, 2.0, -1.0, -1.0, 0.5, 0.0, 0.0, 0.0], np.float32)
    counts = np.zeros((1, v), np.int32)
    seen = np.zeros((1, v), np.uint8)
    counts[0, 0] = 3  # counted 3 times: 3x the frequency penalty plus presence once
    counts[0, 1] = 1
    seen[0, [0, 1, 2]] = 1  # repetition penalty: 2.0 -> 2.0 / r, -1.0 -> -1.0 * r
    p = RowParams(1.0, repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5, penalty_slot=0)
    d = sampling_distribution_reference(logits, p, counts[0], seen[0])
    z = np.array([2 / 2 - 0.25 - 1.5, 2 / 2 - 0.25 - 0.5, -2.0, -1.0, 0.5, 0, 0, 0])
    np.testing.assert_allclose(d, np.exp(z) / np.exp(z).sum(), rtol=1e-6)
    # greedy with penalties: the argmax moves off the penalised tokens
    tokens, _ = _run_cpu(logits[None], [RowParams(0.0, presence_penalty=0.25, frequency_penalty=0.5,
                                                  repetition_penalty=2.0, penalty_slot=0)], cpu(counts), cpu(seen))
    assert tokens[0] == 4
    assert counts[0, 4] == 1 and seen[0, 4] == 1 and counts[0, 0] == 3  # the state advanced for the token only


def test_cpu_penalty_reset_and_state_advance():
    counts, seen = penalty_state(3, 10, "cpu")
    counts.array[1] = 7
    penalty_reset(counts, seen, 1, [2, 5, 5, 9])
    assert counts.array[1].sum() == 0 and seen.array[1].tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0, 1]
    logits = np.zeros((2, 10), np.float32)
    logits[:, 3] = 5
    _run_cpu(logits, [RowParams(0.0, penalty_slot=1), RowParams(0.0, penalty_slot=2)], counts, seen)
    _run_cpu(logits, [RowParams(0.0, penalty_slot=1), RowParams(0.0)], counts, seen)
    assert counts.array[1, 3] == 2 and counts.array[2, 3] == 1 and seen.array[1, 3] == 1 and counts.array[0].sum() == 0
    with pytest.raises(ValueError, match="slot"):
        penalty_reset(counts, seen, 3, [1])
    with pytest.raises(ValueError, match="prompt_ids"):
        penalty_reset(counts, seen, 0, [10])


def test_cpu_logprobs_and_top_n(rng):
    v = 500
    x = separated_logits(rng, 3, v)
    x[2, [7, 3, 11]] = x[2].max() + 1  # a three-way tie at the top: lowest ids first
    rows = [RowParams(0.0), RowParams(0.8, seed=3), RowParams(1.0, top_k=5, seed=4)]
    tokens, kw = _run_cpu(x, rows, top_n=5, logprobs=True)
    x64 = x.astype(np.float64)
    lsm = x64 - (x64.max(1, keepdims=True) + np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1, keepdims=True)))
    np.testing.assert_allclose(kw["logprobs_out"].array, lsm[np.arange(3), tokens], atol=1e-5)
    for r in range(3):
        order = sorted(range(v), key=lambda i: (-x[r, i], i))[:5]
        assert kw["top_ids_out"].array[r].tolist() == order
        np.testing.assert_allclose(kw["top_logprobs_out"].array[r], lsm[r, order], atol=1e-5)
    assert kw["top_ids_out"].array[2, :3].tolist() == [3, 7, 11]


def test_cpu_seed_invariance(rng):
    v = 2000
    x = separated_logits(rng, 6, v)
    rows = [RowParams(0.7, top_p=0.9, seed=1000 + r, step=r) for r in range(6)]
    alone = [_run_cpu(x[r:r + 1], [rows[r]])[0][0] for r in range(6)]
    together, _ = _run_cpu(x[::-1], rows[::-1])
    assert together[::-1].tolist() == alone
    assert sample_row_reference(x[0], rows[0]) == alone[0]


def test_errors_name_the_argument():
    x = cpu(np.zeros((2, 16), np.float32))
    fp, ip = (cpu(a) for a in pack_sampling_params([RowParams()] * 2))
    with pytest.raises(ValueError, match="logits"):
        sample(cpu(np.zeros((2, 16), np.float64).astype(np.float32)[:, :0]), fp, ip)
    with pytest.raises(ValueError, match="logits"):
        sample(cpu(np.zeros((2, 16), np.int32)), fp, ip)
    with pytest.raises(ValueError, match="fparams"):
        sample(x, cpu(np.zeros((3, NUM_F), np.float32)), ip)
    with pytest.raises(ValueError, match="iparams"):
        sample(x, fp, cpu(np.zeros((2, NUM_I), np.float32)))
    with pytest.raises(ValueError, match="out"):
        sample(x, fp, ip, cpu(np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match="penalty_counts and penalty_seen"):
        sample(x, fp, ip, penalty_counts=cpu(np.zeros((1, 16), np.int32)))
    with pytest.raises(ValueError, match="penalty_seen"):
        sample(x, fp, ip, penalty_counts=cpu(np.zeros((1, 16), np.int32)),
               penalty_seen=cpu(np.zeros((1, 15), np.uint8)))
    n = MAX_TOP_LOGPROBS + 1
    with pytest.raises(ValueError, match="top_ids_out"):
        sample(cpu(np.zeros((2, 64), np.float32)), fp, ip, top_ids_out=cpu(np.zeros((2, n), np.int32)),
               top_logprobs_out=cpu(np.zeros((2, n), np.float32)))
    with pytest.raises(ValueError, match="top_logprobs_out"):
        sample(x, fp, ip, top_ids_out=cpu(np.zeros((2, 3), np.int32)), top_logprobs_out=cpu(np.zeros((2, 3), np.int32)))
    with pytest.raises(ValueError, match="logprobs_out"):
        sample(x, fp, ip, logprobs_out=cpu(np.zeros((2, 1), np.float32)))


# ---- token masks and logit bias (structured output, logit_bias) -------------------------------------------------
def _random_mask(rng, b, v, keep=0.3):
    """int32 [b, ceil(v / 32)] bitmasks keeping ~keep of the tokens, and the same as bool [b, v]."""
    allowed = rng.random((b, v)) < keep
    allowed[:, rng.integers(0, v)] = True  # never empty
    padded = np.zeros((b, ((v + 31) // 32) * 32), bool)
    padded[:, :v] = allowed
    words = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    return np.ascontiguousarray(words), allowed


def _mask_bias_rows(rng, b, v, slots):
    """Mixed rows (_mixed_rows) where some rows have a mask, some a bias, some both, some neither; masks in a
    compact table (row j of the table for the j-th masked row), biases by the row's slot."""
    rows = _mixed_rows(rng, b, v, slots)
    m = 0
    for i, r in enumerate(rows):
        kind = i % 4  # 0 neither, 1 mask, 2 bias, 3 both
        rows[i] = replace(r, penalty_slot=i if r.penalty_slot >= 0 else -1,
                          mask_row=m if kind in (1, 3) else -1, bias_row=i if kind >= 2 else -1)
        m += kind in (1, 3)
    masks, allowed = _random_mask(rng, max(m, 1), v)
    bias = np.zeros((b, v), np.float32)
    for i in range(b):
        hit = rng.choice(v, min(v, 40), replace=False)
        bias[i, hit] = rng.uniform(-100, 100, hit.size).astype(np.float32)
        bias[i, hit[:3]] = [100.0, -100.0, 7.5]
    return rows, masks, allowed, bias


def test_mask_bits_and_reference_step_zero(rng):
    v = 1003
    words, allowed = _random_mask(rng, 3, v)
    direct = np.array([[(int(words[r, i // 32]) >> (i % 32)) & 1 for i in range(v)] for r in range(3)], bool)
    np.testing.assert_array_equal(direct, allowed)
    np.testing.assert_array_equal(mask_bits(words[1], v), allowed[1])
    x = separated_logits(rng, 1, v)[0]
    bias = rng.uniform(-100, 100, v).astype(np.float32)
    z = masked_biased_reference(x, bias, words[2])
    expect = np.where(allowed[2], (x.astype(np.float32) + bias).astype(np.float32), -np.inf)
    np.testing.assert_array_equal(z, expect)


def test_cpu_mask_and_bias_against_a_direct_computation(rng):
    """The op with token_mask / logit_bias draws what the unmasked op draws on logits + bias with the masked
    tokens at -inf (every option: penalties, greedy, filters), and its log-probs are those of that row."""
    b, v = 16, 1003
    rows, masks, allowed, bias = _mask_bias_rows(rng, b, v, b)
    x = separated_logits(rng, b, v)
    fp, ip = pack_sampling_params(rows)
    out = poisoned((b,), int32, "cpu")
    lp = poisoned((b,), float32, "cpu")
    ids, tlp = poisoned((b, 5), int32, "cpu"), poisoned((b, 5), float32, "cpu")
    sample(cpu(x), cpu(fp), cpu(ip), out, logprobs_out=lp, top_ids_out=ids, top_logprobs_out=tlp,
           token_mask=cpu(masks), logit_bias=cpu(bias))
    direct = x.copy()
    for i, r in enumerate(rows):
        if r.bias_row >= 0:
            direct[i] = direct[i] + bias[r.bias_row]
        if r.mask_row >= 0:
            direct[i, ~allowed[r.mask_row]] = -np.inf
    plain = [replace(r, mask_row=-1, bias_row=-1) for r in rows]
    want, kw = _run_cpu(direct, plain, top_n=5, logprobs=True)
    np.testing.assert_array_equal(out.array, want)
    np.testing.assert_allclose(lp.array, kw["logprobs_out"].array)
    np.testing.assert_array_equal(ids.array, kw["top_ids_out"].array)
    for i, r in enumerate(rows):
        if r.mask_row >= 0:
            assert allowed[r.mask_row, out.array[i]] and allowed[r.mask_row, ids.array[i]].all()
    # a row without mask or bias ignores the tables entirely
    alone, _ = _run_cpu(x[:1], [rows[0]])
    assert rows[0].mask_row < 0 and rows[0].bias_row < 0 and alone[0] == out.array[0]


def test_cpu_bias_forces_and_forbids(rng):
    v = 500
    x = separated_logits(rng, 8, v)
    bias = np.zeros((1, v), np.float32)
    bias[0, 123] = 100.0
    rows = [RowParams(temperature=t, seed=s, bias_row=0) for t, s in zip([0.0, 1.0, 1.5, 0.7] * 2, range(8))]
    fp, ip = pack_sampling_params(rows)
    out = poisoned((8,), int32, "cpu")
    sample(cpu(x), cpu(fp), cpu(ip), out, logit_bias=cpu(bias))
    assert (out.array == 123).all()
    top = np.argmax(x, axis=1)
    bias = np.zeros((8, v), np.float32)
    bias[np.arange(8), top] = -100.0
    rows = [RowParams(temperature=0.0, bias_row=i) for i in range(8)]
    fp, ip = pack_sampling_params(rows)
    sample(cpu(x), cpu(fp), cpu(ip), out, logit_bias=cpu(bias))
    assert not (out.array == top).any()


def test_mask_and_bias_errors_name_the_argument():
    x = cpu(np.zeros((2, 40), np.float32))
    fp, ip = (cpu(a) for a in pack_sampling_params([RowParams()] * 2))
    with pytest.raises(ValueError, match="token_mask"):
        sample(x, fp, ip, token_mask=cpu(np.zeros((1, 1), np.int32)))  # 40 tokens need 2 words
    with pytest.raises(ValueError, match="token_mask"):
        sample(x, fp, ip, token_mask=cpu(np.zeros((1, 2), np.uint8)))
    with pytest.raises(ValueError, match="logit_bias"):
        sample(x, fp, ip, logit_bias=cpu(np.zeros((1, 39), np.float32)))


# ---- GPU ----------------------------------------------------------------------------------------------------------
def dev(a):
    return Tensor.from_numpy(np.asarray(a), "cuda")


def _run_gpu(logits, fp, ip, counts=None, seen=None, top_n=0, logprobs=True):
    b = logits.shape[0]
    out = poisoned((b,), int32)
    kw = {"logprobs_out": poisoned((b,), float32)} if logprobs else {}
    if counts is not None:
        kw.update(penalty_counts=counts, penalty_seen=seen)
    if top_n:
        kw.update(top_ids_out=poisoned((b, top_n), int32), top_logprobs_out=poisoned((b, top_n), float32))
    sample(logits if isinstance(logits, Tensor) else dev(logits), dev(fp), dev(ip), out, **kw)
    return out.numpy(), {k: t.numpy() for k, t in kw.items() if k.endswith("_out")}


def _mixed_rows(rng, b, v, slots):
    """Every kind of row, including ones that take the kernel's global-memory paths (top-k beyond the buffer,
    top-p without top-k on flat rows)."""
    kinds = [dict(temperature=0.0), dict(temperature=0.6, top_k=20, top_p=0.95), dict(temperature=1.0),
             dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, min_p=0.05), dict(temperature=1.0, top_k=1),
             dict(temperature=0.9, top_k=5000), dict(temperature=3.0, top_p=0.99), dict(temperature=0.5, top_k=50,
             min_p=0.1), dict(temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4,
             frequency_penalty=0.3), dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
             dict(temperature=1.2, top_p=1e-6), dict(temperature=0.6, top_k=3000, top_p=0.999)]
    rows = []
    for r in range(b):
        k = kinds[r % len(kinds)]
        slot = r % slots if "repetition_penalty" in k else -1
        rows.append(RowParams(seed=int(rng.integers(0, 2**64, dtype=np.uint64)), step=int(rng.integers(0, 2**31)),
                              penalty_slot=slot, **k))
    return rows


def _state(rng, slots, v):
    counts = np.zeros((slots, v), np.int32)
    seen = np.zeros((slots, v), np.uint8)
    for s in range(slots):
        hit = rng.choice(v, 300, replace=False)
        counts[s, hit] = rng.integers(1, 4, hit.size)
        seen[s, rng.choice(v, 2000, replace=False)] = 1
    return counts, seen


@pytest.mark.gpu
@pytest.mark.parametrize("b, v", [(256, 151936), (13, 151937), (7, 1003), (5, 64)])
def test_cuda_matches_reference(rng, b, v):
    x = separated_logits(rng, b, v, std=3.0)
    slots = b  # distinct slots per row (rows of one call must not share one)
    rows = _mixed_rows(rng, b, v, slots)
    for i, r in enumerate(rows):
        if r.penalty_slot >= 0:
            rows[i] = replace(r, penalty_slot=i)
    fp, ip = pack_sampling_params(rows)
    counts, seen = _state(rng, slots, v) if v > 2000 else (np.zeros((slots, v), np.int32), np.zeros((slots, v), np.uint8))
    ref_counts, ref_seen = counts.copy(), seen.copy()
    n = min(MAX_TOP_LOGPROBS, v)
    dc, ds = dev(counts), dev(seen)
    got, outs = _run_gpu(x, fp, ip, dc, ds, top_n=n)
    tokens, lps, ids, top_lps = sample_reference(x, fp, ip, ref_counts, ref_seen, n)
    mismatch = np.flatnonzero(got != tokens)
    assert mismatch.size <= max(1, b // 100), f"rows {mismatch.tolist()}: {got[mismatch]} vs {tokens[mismatch]}"
    ok = got == tokens
    np.testing.assert_allclose(outs["logprobs_out"][ok], lps[ok], atol=1e-4)
    np.testing.assert_array_equal(outs["top_ids_out"], ids)
    np.testing.assert_allclose(outs["top_logprobs_out"], top_lps, atol=1e-4)
    if mismatch.size == 0:
        np.testing.assert_array_equal(dc.numpy(), ref_counts)
        np.testing.assert_array_equal(ds.numpy(), ref_seen)


def _draw_gpu(logits_row, options, n, counts=None, seen=None):
    """n draws on the GPU in one call: n copies of the row with seeds 1, 7920, ... and steps 0..12; with a penalty
    state, every row gets its own slot holding the same state (rows of one call must not share a slot)."""
    fp, ip = pack_sampling_params([_params(options)])
    fp, ip = np.repeat(fp, n, 0), np.repeat(ip, n, 0)
    ip[:, I_SEED_LO] = (np.arange(n, dtype=np.uint64) * 7919 + 1).astype(np.uint32).view(np.int32)
    ip[:, I_STEP] = np.arange(n) % 13
    x = np.repeat(logits_row[None], n, 0)
    if counts is None:
        return _run_gpu(x, fp, ip, logprobs=False)[0]
    ip[:, I_PENALTY_SLOT] = np.arange(n)
    return _run_gpu(x, fp, ip, dev(np.repeat(counts[None], n, 0)), dev(np.repeat(seen[None], n, 0)),
                    logprobs=False)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("v", [64, 1000])
def test_cuda_chi_square(rng, name, v):
    n = 40000 if v == 64 else 60000
    logits = separated_logits(rng, 1, v, std=1.0 if v == 64 else 2.0)[0]
    use_state = "penalt" in name or name == "all"
    counts, seen = _penalty_rows(rng, v) if use_state else (None, None)
    tokens = _draw_gpu(logits, OPTION_SETS[name], n, counts, seen)
    p = _packed_params(OPTION_SETS[name], slot=0 if use_state else -1)
    want = sampling_distribution_reference(logits, p, counts, seen)
    assert chi2_pvalue(np.bincount(tokens, minlength=v), want) > P_MIN


@pytest.mark.gpu
def test_cuda_chi_square_flat_rows_take_the_global_path(rng):
    # 151,936 nearly equal logits: top-p 0.5 keeps ~76k tokens (beyond the shared-memory buffer); exact ties
    # (constant logits) overflow the buffer. Check the histogram of coarse token bins against the reference.
    v, n = 151936, 1500
    logits = (rng.standard_normal(v) * 0.05).astype(np.float32)
    for row_logits, options in ((logits, dict(temperature=1.0, top_p=0.5)), (np.zeros(v, np.float32),
                                                                              dict(temperature=1.0, top_k=100000))):
        tokens = _draw_gpu(row_logits, options, n)
        want = sampling_distribution_reference(row_logits, _packed_params(options))
        bins = np.arange(v) * 64 // v
        assert chi2_pvalue(np.bincount(bins[tokens], minlength=64), np.bincount(bins, weights=want, minlength=64)) > P_MIN


@pytest.mark.gpu
def test_cuda_seed_invariance_across_batches(rng):
    v = 151936
    x = separated_logits(rng, 40, v)
    rows = _mixed_rows(rng, 40, v, slots=1)
    rows = [replace(r, penalty_slot=-1) for r in rows]
    fp, ip = pack_sampling_params(rows)
    full, _ = _run_gpu(x, fp, ip)
    perm = rng.permutation(40)[:17]
    part, _ = _run_gpu(x[perm], fp[perm], ip[perm])
    np.testing.assert_array_equal(part, full[perm])
    single = [_run_gpu(x[i:i + 1], fp[i:i + 1], ip[i:i + 1])[0][0] for i in range(5)]
    np.testing.assert_array_equal(single, full[:5])


@pytest.mark.gpu
def test_cuda_edge_cases(rng):
    v = 151936
    x = separated_logits(rng, 1, v)[0]
    one = np.full(v, -np.inf, np.float32)
    one[100003] = -7.0
    rows = [(x, RowParams(1.0, top_k=1, seed=1)), (x, RowParams(0.7, top_p=1e-7, seed=2)), (x, RowParams(0.0)),
            (one, RowParams(1.0, seed=3)), (one, RowParams(0.5, top_k=10, top_p=0.5, seed=4)), (one, RowParams(0.0)),
            (np.full(v, -np.inf, np.float32), RowParams(1.0)), (x, RowParams(0.9, top_k=v + 3, seed=9)),
            (x, RowParams(0.9, top_k=0, seed=9))]
    fp, ip = pack_sampling_params([r for _, r in rows])
    got, _ = _run_gpu(np.stack([l for l, _ in rows]), fp, ip, logprobs=False)
    top = int(np.argmax(x))
    assert got[:3].tolist() == [top, top, top] and got[3:6].tolist() == [100003] * 3 and got[6] == 0
    assert got[7] == got[8] == sample_row_reference(x, unpack_row(fp[8], ip[8]))


@pytest.mark.gpu
def test_cuda_penalty_state_over_steps(rng):
    v, slots, steps = 4096, 4, 6
    counts, seen = penalty_state(slots, v)
    ref_counts, ref_seen = np.zeros((slots, v), np.int32), np.zeros((slots, v), np.uint8)
    prompts = [rng.integers(0, v, 50) for _ in range(slots)]
    for s in range(slots):
        penalty_reset(counts, seen, s, prompts[s])
        ref_seen[s, prompts[s]] = 1
    for step in range(steps):
        x = separated_logits(rng, slots, v, std=1.0)
        rows = [RowParams(0.0 if s == 0 else 0.8, top_k=40, repetition_penalty=1.5, presence_penalty=1.0,
                          frequency_penalty=0.7, seed=s, step=step, penalty_slot=s) for s in range(slots)]
        fp, ip = pack_sampling_params(rows)
        got, _ = _run_gpu(x, fp, ip, counts, seen)
        want = sample_reference(x, fp, ip, ref_counts, ref_seen)[0]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(counts.numpy(), ref_counts)
    np.testing.assert_array_equal(seen.numpy(), ref_seen)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(rng):
    from xserv.runtime.graphs import CUDAGraph

    b, v = 8, 151936
    logits, fparams, iparams = Tensor.empty((b, v), float32), Tensor.empty((b, NUM_F), float32), Tensor.empty((b, NUM_I), int32)
    out, lps = Tensor.empty((b,), int32), Tensor.empty((b,), float32)
    ids, tlp = Tensor.empty((b, 5), int32), Tensor.empty((b, 5), float32)
    counts, seen = penalty_state(b, v)

    def step():
        sample(logits, fparams, iparams, out, penalty_counts=counts, penalty_seen=seen, logprobs_out=lps,
               top_ids_out=ids, top_logprobs_out=tlp)

    def write_inputs(i):
        x = separated_logits(rng, b, v)
        rows = _mixed_rows(rng, b, v, slots=b)
        rows = [replace(r, penalty_slot=j, step=i) for j, r in enumerate(rows)]
        fp, ip = pack_sampling_params(rows)
        logits.copy_(x), fparams.copy_(fp), iparams.copy_(ip)
        return x, fp, ip

    write_inputs(0)
    step()  # compile and load outside the capture
    counts.zero_(), seen.zero_()
    ref_counts, ref_seen = np.zeros((b, v), np.int32), np.zeros((b, v), np.uint8)
    graph = CUDAGraph()
    with graph.capture():
        step()
    for i in range(3):
        x, fp, ip = write_inputs(i + 1)
        out.copy_(np.full(b, -1, np.int32))
        graph.replay()
        tokens, lp, tid, tl = sample_reference(x, fp, ip, ref_counts, ref_seen, 5)
        np.testing.assert_array_equal(out.numpy(), tokens)
        np.testing.assert_allclose(lps.numpy(), lp, atol=1e-4)
        np.testing.assert_array_equal(ids.numpy(), tid)
    np.testing.assert_array_equal(counts.numpy(), ref_counts)
    np.testing.assert_array_equal(seen.numpy(), ref_seen)
    graph.close()


@pytest.mark.gpu
@pytest.mark.parametrize("b, v", [(256, 151936), (13, 151937), (7, 1003)])
def test_cuda_mask_and_bias_match_reference(rng, b, v):
    """Token masks and logit bias inside the kernel: mixed rows (neither, mask, bias, both; every filter and
    penalty kind) against the reference: tokens, log-probs and top-N; every drawn and listed token is allowed."""
    rows, masks, allowed, bias = _mask_bias_rows(rng, b, v, b)
    x = separated_logits(rng, b, v, std=3.0)
    fp, ip = pack_sampling_params(rows)
    counts, seen = (np.zeros((b, v), np.int32), np.zeros((b, v), np.uint8))
    ref_counts, ref_seen = counts.copy(), seen.copy()
    out = poisoned((b,), int32)
    kw = dict(logprobs_out=poisoned((b,), float32), top_ids_out=poisoned((b, 5), int32),
              top_logprobs_out=poisoned((b, 5), float32))
    sample(dev(x), dev(fp), dev(ip), out, penalty_counts=dev(counts), penalty_seen=dev(seen), token_mask=dev(masks),
           logit_bias=dev(bias), **kw)
    got = out.numpy()
    tokens, lps, ids, top_lps = sample_reference(x, fp, ip, ref_counts, ref_seen, 5, token_mask=masks,
                                                 logit_bias=bias)
    mismatch = np.flatnonzero(got != tokens)
    assert mismatch.size <= max(1, b // 100), f"rows {mismatch.tolist()}: {got[mismatch]} vs {tokens[mismatch]}"
    ok = got == tokens
    np.testing.assert_allclose(kw["logprobs_out"].numpy()[ok], lps[ok], atol=1e-4)
    np.testing.assert_array_equal(kw["top_ids_out"].numpy(), ids)
    np.testing.assert_allclose(kw["top_logprobs_out"].numpy(), top_lps, atol=1e-4)
    for i, r in enumerate(rows):
        if r.mask_row >= 0:
            assert allowed[r.mask_row, got[i]] and allowed[r.mask_row, kw["top_ids_out"].numpy()[i]].all()


@pytest.mark.gpu
def test_cuda_chi_square_with_mask_and_bias(rng):
    """Draws of a masked, biased row follow the reference distribution of that row."""
    v = 1000
    words, allowed = _random_mask(rng, 1, v, keep=0.05)
    x = separated_logits(rng, 1, v)[0]
    bias = rng.uniform(-2, 2, v).astype(np.float32)
    n = 4000
    rows = [RowParams(temperature=0.8, top_p=0.95, seed=1 + 7919 * i, step=i % 13, mask_row=0, bias_row=0)
            for i in range(n)]
    fp, ip = pack_sampling_params(rows)
    out = poisoned((n,), int32)
    sample(dev(np.tile(x, (n, 1))), dev(fp), dev(ip), out, token_mask=dev(words), logit_bias=dev(bias[None]))
    got = out.numpy()
    assert allowed[0, got].all()
    p = sampling_distribution_reference(masked_biased_reference(x, bias, words[0]), rows[0])
    assert chi2_pvalue(np.bincount(got, minlength=v), p) > P_MIN


@pytest.mark.gpu
def test_cuda_errors():
    fp, ip = pack_sampling_params([RowParams()] * 2)
    with pytest.raises(ValueError, match="different devices"):
        sample(dev(np.zeros((2, 16), np.float32)), cpu(fp), dev(ip))
    with pytest.raises(ValueError, match="different devices"):
        sample(dev(np.zeros((2, 16), np.float32)), dev(fp), dev(ip), out=cpu(np.zeros(2, np.int32)))
