"""Batched token sampling, each row with its own parameters: penalties, greedy / temperature, top-k, top-p,
min-p, and an exact draw with a counter-based RNG (Philox4x32-10 keyed by the row's seed, counter from the step
and the token index), so that a seeded row gives the same token whatever else is in the batch.

Per row (docs/kernels/sampling.md has the algorithm and why it is exact):
0. the row's logit bias (`logit_bias[bias_row]`, when the row has one) is added to the logits, and the tokens its
   token mask (`token_mask[mask_row]`: bit i % 32 of word i // 32) leaves out get -inf; everything below, the
   log-probs included, sees these logits as the row's raw logits;
1. penalties, when the row has a penalty slot and the state tensors are given: repetition penalty on the tokens
   marked in `seen[slot]` (logit > 0 -> logit / r, else logit * r), then
   logit -= presence * (count > 0) + frequency * count with `counts[slot]`;
2. temperature 0 -> greedy argmax (lowest index on ties);
3. z = logit * (1 / T); top-k keeps z >= the k-th largest z (ties kept; k <= 0 or k >= V is off); top-p keeps
   the smallest set of most likely tokens, among those top-k kept, whose mass reaches top_p (ties at the boundary
   kept); min-p keeps p >= min_p * p_max. Every filter keeps {z >= threshold}: the kept set is {z >= theta};
4. the token is argmax over the kept set of z_i + g_i, g_i = -log(-log(u_i)) (Gumbel-max: an exact draw from the
   renormalised distribution), u_i from Philox4x32-10(key = seed, counter = (i // 4, step, 0, 0)) word i % 4;
5. counts[slot, token] += 1 and seen[slot, token] = 1 (the state stays on the device);
6. optionally the log-softmax of the RAW logits at the token, and the top-N raw log-probs (descending, ties
   lowest id first).
The CUDA op is one launch with no host synchronisation and no allocation (given outputs): it can be captured in
a CUDA graph, with new parameters written into the same fparams/iparams buffers before each replay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from ..tensor import Tensor, float32, int32, uint8
from ._checks import check_tensor, output, same_device
from ..sampling import MAX_LOGPROBS
from ._launch import aligned, check_alias, check_int32_range
from ..runtime.compiler import piece

MAX_TOP_LOGPROBS = MAX_LOGPROBS  # the most top-N log-probs per row (SamplingParams.logprobs' limit)
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY = range(6)
NUM_F = 8  # fparams columns (the unused ones are zero)
I_TOP_K, I_SEED_LO, I_SEED_HI, I_STEP, I_PENALTY_SLOT, I_MASK_ROW, I_BIAS_ROW = range(7)
NUM_I = 8  # iparams columns

_BLOCK = 512  # threads per row in cuda_src/sampling.cu
# sampling.cu is compiled as two pieces (runtime/compiler.py, "shape pieces"): sampling:v1 = sample_f32_vec, which a
# start-up compiles (every Qwen3's vocab is a multiple of 4), sampling:v0 = sample_f32, compiled on first use.
_PIECES = {True: piece("sampling", vec=1), False: piece("sampling", vec=0)}


@dataclass(frozen=True)
class RowParams:
    """One row's sampling parameters (validated). penalty_slot -1 = no penalties and no state update; mask_row /
    bias_row: the row of `token_mask` / `logit_bias` this row uses, -1 = none."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    step: int = 0
    penalty_slot: int = -1
    mask_row: int = -1
    bias_row: int = -1

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ValueError(f"{f.name} must be an integer, got {v!r}")
                object.__setattr__(self, f.name, int(v))
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                    raise ValueError(f"{f.name} must be a finite number, got {v!r}")
                object.__setattr__(self, f.name, float(v))
        checks = (
            ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
            ("top_k", -2**31 <= self.top_k < 2**31, "an int32 (<= 0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", 0 <= self.seed < 2**64, "in [0, 2**64)"),
            ("step", 0 <= self.step < 2**32, "in [0, 2**32)"),
            ("penalty_slot", -1 <= self.penalty_slot < 2**31, "-1 (none) or a slot index"),
            ("mask_row", -1 <= self.mask_row < 2**31, "-1 (none) or a row index"),
            ("bias_row", -1 <= self.bias_row < 2**31, "-1 (none) or a row index"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_row_params(row) -> RowParams:
    if isinstance(row, RowParams):
        return row
    names = [f.name for f in fields(RowParams)]
    if isinstance(row, tuple) and not hasattr(row, "_fields"):
        return RowParams(*row)
    return RowParams(**{n: getattr(row, n) for n in names})


def pack_sampling_params(rows) -> tuple[np.ndarray, np.ndarray]:
    """rows: RowParams, or objects / tuples with the same fields (in RowParams' order for plain tuples).
    Returns (fparams float32 [B, NUM_F], iparams int32 [B, NUM_I])."""
    rows = [_as_row_params(r) for r in rows]
    fp = np.zeros((len(rows), NUM_F), np.float32)
    ip = np.zeros((len(rows), NUM_I), np.int64)
    if rows:  # one array per table (a per-row NumPy assignment costs ~10 us: 2.5 ms for a batch of 256)
        fp[:, [F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_PRESENCE, F_FREQUENCY]] = [
            (r.temperature, r.top_p, r.min_p, r.repetition_penalty, r.presence_penalty, r.frequency_penalty)
            for r in rows]
        ip[:, [I_TOP_K, I_SEED_LO, I_SEED_HI, I_STEP, I_PENALTY_SLOT, I_MASK_ROW, I_BIAS_ROW]] = [
            (r.top_k, r.seed & 0xFFFFFFFF, r.seed >> 32, r.step, r.penalty_slot, r.mask_row, r.bias_row)
            for r in rows]
    # Seeds and steps are unsigned 32-bit words stored in int32 columns (two's complement).
    return fp, (ip & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def unpack_row(fparams_row: np.ndarray, iparams_row: np.ndarray) -> RowParams:
    u = np.asarray(iparams_row).astype(np.int32).view(np.uint32)
    i = np.asarray(iparams_row).astype(np.int32)
    f = np.asarray(fparams_row, np.float32)
    return RowParams(temperature=float(f[F_TEMPERATURE]), top_k=int(i[I_TOP_K]), top_p=float(f[F_TOP_P]),
                     min_p=float(f[F_MIN_P]), repetition_penalty=float(f[F_REPETITION]),
                     presence_penalty=float(f[F_PRESENCE]), frequency_penalty=float(f[F_FREQUENCY]),
                     seed=int(u[I_SEED_LO]) | int(u[I_SEED_HI]) << 32, step=int(u[I_STEP]),
                     penalty_slot=int(i[I_PENALTY_SLOT]), mask_row=int(i[I_MASK_ROW]), bias_row=int(i[I_BIAS_ROW]))


# ---- Philox4x32-10 and the Gumbel noise (the same bits as the kernel) -----------------------------------------
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """counter: 4 arrays (or ints) of uint32 words, key: 2; returns the 4 output words (uint32 arrays)."""
    c = [np.asarray(w, np.uint64) & _MASK32 for w in counter]
    k0, k1 = (int(w) & 0xFFFFFFFF for w in key)
    c0, c1, c2, c3 = np.broadcast_arrays(*c)
    for _ in range(10):
        p0 = c0 * np.uint64(_M0)
        p1 = c2 * np.uint64(_M1)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & _MASK32)
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return tuple(w.astype(np.uint32) for w in (c0, c1, c2, c3))


_GUMBEL_MAX = np.float32(16.7)  # > -log(-log(1 - 2**-24)) = 16.64, the largest noise gumbel_noise returns
_PRUNE_ABOVE = 4096  # candidate counts above which the reference prunes by the top token's noise first


def gumbel_noise(seed: int, step: int, token_ids: np.ndarray) -> np.ndarray:
    """float32 Gumbel noise of the given tokens for (seed, step)."""
    ids = np.asarray(token_ids, np.int64)
    groups, where = np.unique(ids >> 2, return_inverse=True)  # one Philox call per 4 consecutive tokens
    words = np.stack(philox4x32_10((groups, step, 0, 0), (seed & 0xFFFFFFFF, seed >> 32)), axis=1)
    bits = words[where.reshape(-1), ids.reshape(-1) & 3].reshape(ids.shape)
    u = ((bits >> np.uint32(9)) * np.uint32(2) + np.uint32(1)).astype(np.float32) * np.float32(2.0**-24)
    return -np.log(-np.log(u))


# ---- the reference --------------------------------------------------------------------------------------------
def _penalized_scaled(logits_row, p: RowParams, counts_row, seen_row) -> np.ndarray:
    """z: penalties then temperature, float32 operations in the kernel's order."""
    z = np.array(logits_row, np.float32)
    if p.penalty_slot >= 0 and counts_row is not None and seen_row is not None:
        if p.repetition_penalty != 1.0:
            r = np.float32(p.repetition_penalty)
            m = np.asarray(seen_row) != 0
            v = z[m]
            z[m] = np.where(v > 0, v / r, v * r)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            c = np.asarray(counts_row)
            z = z - (np.float32(p.presence_penalty) * (c > 0).astype(np.float32)
                     + np.float32(p.frequency_penalty) * c.astype(np.float32))
    if p.greedy:
        return z
    return z * (np.float32(1.0) / np.float32(p.temperature))


def _upper_value(values: np.ndarray, zmax: np.float32, target: float) -> np.float32:
    """The largest value v with sum(exp(x - zmax) for x >= v) >= target (the top-p boundary); the smallest value
    when rounding leaves the total below target. Sorts only the best 1024 when they hold the mass."""
    n = values.shape[0]
    probe = min(n, 1024)
    best = -np.partition(-values, probe - 1)[:probe] if probe < n else values
    if probe < n and float(np.exp(best - zmax).sum(dtype=np.float64)) < target:
        best = values
    ordered = -np.sort(-best)
    cum = np.cumsum(np.exp(ordered - zmax), dtype=np.float64)
    hit = int(np.searchsorted(cum, target, side="left"))
    return ordered[min(hit, ordered.shape[0] - 1)]


def _threshold(z: np.ndarray, p: RowParams) -> np.float32:
    """theta: the row keeps {z >= theta}."""
    v = z.shape[0]
    zmax = z.max()
    theta = np.float32(-np.inf)
    candidates = z
    if 0 < p.top_k < v:
        theta = np.partition(z, v - p.top_k)[v - p.top_k]
        candidates = z[z >= theta]
    if p.top_p < 1.0:
        total = float(np.exp(candidates - zmax).sum(dtype=np.float64))
        theta = max(theta, _upper_value(candidates, zmax, p.top_p * total))
    if p.min_p > 0.0:
        theta = max(theta, zmax + np.log(np.float32(p.min_p)))
    return np.float32(theta)


def sampling_distribution_reference(logits_row, row_params, counts_row=None, seen_row=None) -> np.ndarray:
    """The distribution a row's token is drawn from, float64 [V] (one-hot at the argmax when greedy)."""
    p = _as_row_params(row_params)
    z = _penalized_scaled(logits_row, p, counts_row, seen_row)
    out = np.zeros(z.shape[0], np.float64)
    zmax = z.max()
    if p.greedy or zmax == -np.inf:
        out[int(np.argmax(z))] = 1.0
        return out
    kept = np.flatnonzero(z >= _threshold(z, p))
    w = np.exp(z[kept].astype(np.float64) - float(zmax))
    out[kept] = w / w.sum()
    return out


def sample_row_reference(logits_row, row_params, counts_row=None, seen_row=None) -> int:
    """The token the kernel draws for one row (state not updated)."""
    p = _as_row_params(row_params)
    z = _penalized_scaled(logits_row, p, counts_row, seen_row)
    zmax = z.max()
    if p.greedy or zmax == -np.inf:
        return int(np.argmax(z))
    kept = np.flatnonzero(z >= _threshold(z, p))
    if kept.size > _PRUNE_ABOVE:
        # Only tokens within the largest noise of (the top token + its noise) can win: the others need no Philox.
        top = int(np.argmax(z))
        reach = z[top] + gumbel_noise(p.seed, p.step, np.array([top]))[0] - _GUMBEL_MAX
        kept = kept[z[kept] >= reach]
    perturbed = z[kept] + gumbel_noise(p.seed, p.step, kept)
    return int(kept[np.argmax(perturbed)])  # first maximum: the lowest token id on ties


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = np.asarray(row, np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum())) if m > -np.inf else np.full_like(x, np.nan)


def top_logprobs_reference(logits_row, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], log-probs float64 [n]) of the n largest raw log-probs; ties lowest id first."""
    lp = _log_softmax(logits_row)
    v = lp.shape[0]
    cand = np.argpartition(-lp, n - 1)[:n] if n < v else np.arange(v)
    cand = np.flatnonzero(lp >= lp[cand].min())  # every tie of the n-th value
    order = cand[np.lexsort((cand, -lp[cand]))][:n]
    return order.astype(np.int32), lp[order]


def mask_bits(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab]: token i allowed by an int32 bitmask row (bit i % 32 of word i // 32)."""
    words = np.ascontiguousarray(mask_row, np.int32)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def masked_biased_reference(logits_row, bias_row=None, mask_row=None) -> np.ndarray:
    """Step 0: float32 logits + bias (one float32 addition per token), -inf where the mask has a 0 bit."""
    z = np.array(logits_row, np.float32)
    if bias_row is not None:
        z = z + np.asarray(bias_row, np.float32)
    if mask_row is not None:
        z[~mask_bits(mask_row, z.shape[0])] = -np.inf
    return z


def sample_reference(logits, fparams, iparams, counts=None, seen=None, top_n: int = 0, logprobs: bool = True,
                     token_mask=None, logit_bias=None):
    """NumPy version of `sample` on arrays: (tokens int32 [B], logprobs float64 [B] (zeros unless `logprobs`),
    top ids int32 [B, N], top log-probs float64 [B, N]). Updates counts/seen in place like the kernel."""
    logits = np.asarray(logits, np.float32)
    b = logits.shape[0]
    tokens = np.zeros(b, np.int32)
    lps = np.zeros(b, np.float64)
    top_ids = np.zeros((b, top_n), np.int32)
    top_lp = np.zeros((b, top_n), np.float64)
    have_state = counts is not None and seen is not None
    for r in range(b):
        p = unpack_row(fparams[r], iparams[r])
        slot = p.penalty_slot if have_state and 0 <= p.penalty_slot < counts.shape[0] else -1
        if slot != p.penalty_slot:
            p = replace(p, penalty_slot=-1)
        c_row = counts[slot] if slot >= 0 else None
        s_row = seen[slot] if slot >= 0 else None
        row = logits[r]
        has_mask = token_mask is not None and 0 <= p.mask_row < token_mask.shape[0]
        has_bias = logit_bias is not None and 0 <= p.bias_row < logit_bias.shape[0]
        if has_mask or has_bias:
            row = masked_biased_reference(row, logit_bias[p.bias_row] if has_bias else None,
                                          token_mask[p.mask_row] if has_mask else None)
        t = sample_row_reference(row, p, c_row, s_row)
        tokens[r] = t
        if logprobs:
            lps[r] = _log_softmax(row)[t]
        if top_n:
            top_ids[r], top_lp[r] = top_logprobs_reference(row, top_n)
        if slot >= 0:
            counts[slot, t] += 1
            seen[slot, t] = 1
    return tokens, lps, top_ids, top_lp


# ---- the op ---------------------------------------------------------------------------------------------------
def sample(logits: Tensor, fparams: Tensor, iparams: Tensor, out: Tensor | None = None, *,
           penalty_counts: Tensor | None = None, penalty_seen: Tensor | None = None,
           logprobs_out: Tensor | None = None, top_ids_out: Tensor | None = None,
           top_logprobs_out: Tensor | None = None, token_mask: Tensor | None = None,
           logit_bias: Tensor | None = None) -> Tensor:
    """logits float32 [B, V] (not modified); fparams float32 [B, NUM_F] and iparams int32 [B, NUM_I] from
    pack_sampling_params; out int32 [B]. penalty_counts int32 [S, V] and penalty_seen uint8 [S, V] (1 where the
    token is in the prompt or the output), both or neither: rows with penalty_slot in [0, S) are penalised and
    their slot updated; two rows of one call must not share a slot. logprobs_out float32 [B]; top_ids_out int32
    and top_logprobs_out float32 [B, N], N <= MAX_TOP_LOGPROBS, both or neither."""
    check_tensor("logits", logits, dtype=float32, ndim=2)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits: vocabulary dimension is 0")
    check_int32_range("logits", vocab)
    check_tensor("fparams", fparams, dtype=float32, shape=(batch, NUM_F))
    check_tensor("iparams", iparams, dtype=int32, shape=(batch, NUM_I))
    if (penalty_counts is None) != (penalty_seen is None):
        raise ValueError("penalty_counts and penalty_seen: give both or neither")
    slots = 0
    if penalty_counts is not None:
        check_tensor("penalty_counts", penalty_counts, dtype=int32, ndim=2)
        slots = penalty_counts.shape[0]
        check_tensor("penalty_counts", penalty_counts, shape=(slots, vocab))
        check_tensor("penalty_seen", penalty_seen, dtype=uint8, shape=(slots, vocab))
    if (top_ids_out is None) != (top_logprobs_out is None):
        raise ValueError("top_ids_out and top_logprobs_out: give both or neither")
    top_n = 0
    if top_ids_out is not None:
        check_tensor("top_ids_out", top_ids_out, dtype=int32, ndim=2)
        top_n = top_ids_out.shape[1]
        if top_n > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_ids_out: {top_n} log-probs per row asked, at most {MAX_TOP_LOGPROBS}")
        if top_n > vocab:
            raise ValueError(f"top_ids_out: {top_n} log-probs per row asked, the vocabulary has {vocab}")
        check_tensor("top_ids_out", top_ids_out, shape=(batch, top_n))
        check_tensor("top_logprobs_out", top_logprobs_out, dtype=float32, shape=(batch, top_n))
    if logprobs_out is not None:
        check_tensor("logprobs_out", logprobs_out, dtype=float32, shape=(batch,))
    mask_rows = bias_rows = 0
    if token_mask is not None:
        check_tensor("token_mask", token_mask, dtype=int32, ndim=2)
        mask_rows = token_mask.shape[0]
        check_tensor("token_mask", token_mask, shape=(mask_rows, (vocab + 31) // 32))
    if logit_bias is not None:
        check_tensor("logit_bias", logit_bias, dtype=float32, ndim=2)
        bias_rows = logit_bias.shape[0]
        check_tensor("logit_bias", logit_bias, shape=(bias_rows, vocab))
    device = same_device(logits=logits, fparams=fparams, iparams=iparams, out=out, penalty_counts=penalty_counts,
                         penalty_seen=penalty_seen, logprobs_out=logprobs_out, top_ids_out=top_ids_out,
                         top_logprobs_out=top_logprobs_out, token_mask=token_mask, logit_bias=logit_bias)
    out = output("out", out, (batch,), int32, device)
    outputs = {"out": out, "logprobs_out": logprobs_out, "top_ids_out": top_ids_out,
               "top_logprobs_out": top_logprobs_out}
    for name, t in outputs.items():
        if t is not None:
            check_alias(name, t, "logits", logits, allow_identical=False)
            for other, o in (("fparams", fparams), ("iparams", iparams), ("penalty_counts", penalty_counts),
                             ("penalty_seen", penalty_seen), ("token_mask", token_mask), ("logit_bias", logit_bias)):
                if o is not None:
                    check_alias(name, t, other, o, allow_identical=False)
    if batch == 0:
        return out
    if device == "cpu":
        counts = penalty_counts.array if penalty_counts is not None else None
        seen = penalty_seen.array if penalty_seen is not None else None
        tokens, lps, ids, top_lps = sample_reference(
            logits.array, fparams.array, iparams.array, counts, seen, top_n, logprobs=logprobs_out is not None,
            token_mask=None if token_mask is None else token_mask.array,
            logit_bias=None if logit_bias is None else logit_bias.array)
        out.array[...] = tokens
        if logprobs_out is not None:
            logprobs_out.array[...] = lps
        if top_n:
            top_ids_out.array[...] = ids
            top_logprobs_out.array[...] = top_lps
        return out
    from ..runtime import kernel

    vec = vocab % 4 == 0 and aligned(logits) and (logit_bias is None or aligned(logit_bias))
    name = "sample_f32_vec" if vec else "sample_f32"
    def ptr(t):  # a missing optional tensor is a null pointer
        return 0 if t is None else t

    kernel(_PIECES[vec], name)(batch, _BLOCK, logits, fparams, iparams, ptr(penalty_counts), ptr(penalty_seen), out,
                             ptr(logprobs_out), ptr(top_ids_out), ptr(top_logprobs_out), ptr(token_mask),
                             ptr(logit_bias), np.int32(vocab), np.int32(top_n), np.int32(slots), np.int32(mask_rows),
                             np.int32(bias_rows))
    return out


def penalty_state(num_slots: int, vocab: int, device="cuda") -> tuple[Tensor, Tensor]:
    """Zeroed (counts int32 [num_slots, vocab], seen uint8 [num_slots, vocab])."""
    if num_slots < 1 or vocab < 1:
        raise ValueError(f"penalty_state: num_slots and vocab must be >= 1, got {num_slots}, {vocab}")
    return Tensor.zeros((num_slots, vocab), int32, device), Tensor.zeros((num_slots, vocab), uint8, device)


def penalty_reset(counts: Tensor, seen: Tensor, slot: int, prompt_ids) -> None:
    """Start a sequence in `slot`: zero its counts, and mark exactly its prompt tokens as seen."""
    check_tensor("counts", counts, dtype=int32, ndim=2)
    check_tensor("seen", seen, dtype=uint8, shape=counts.shape, device=counts.device)
    slots, vocab = counts.shape
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < slots:
        raise ValueError(f"slot: expected an integer in [0, {slots}), got {slot!r}")
    ids = np.asarray(prompt_ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"prompt_ids: token ids must be in [0, {vocab})")
    row = np.zeros(vocab, np.uint8)
    row[ids] = 1
    counts[int(slot)].zero_()
    seen[int(slot)].copy_(row)
