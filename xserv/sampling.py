"""Sampling parameters and the host-side sampler (NumPy, float32 logits of one sequence per call).

Order, as Hugging Face applies them: repetition penalty -> temperature (0 = greedy argmax) -> top-k -> top-p ->
min-p -> one categorical draw from the request's own generator (reproducible per seed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Top-p first looks for the nucleus among this many best tokens (a partial partition, not a full sort of the
# vocabulary); only when their mass is below top_p does it sort everything.
_NUCLEUS_PROBE = 1024


MAX_LOGPROBS = 20  # top-N logprobs per token, at most
MAX_N = 16  # samples per prompt, at most


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list, hash=False)
    stop_token_ids: list[int] = field(default_factory=list, hash=False)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; N <= MAX_LOGPROBS: and the top N

    def __post_init__(self):
        def number(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or math.isnan(v):
                raise ValueError(f"{name} must be a number, got {v!r}")
            object.__setattr__(self, name, float(v))
            return float(v)

        def integer(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            object.__setattr__(self, name, int(v))
            return int(v)

        t = number("temperature")
        if not t >= 0 or math.isinf(t):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t}")
        k = integer("top_k")
        if k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {k}")
        p = number("top_p")
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        mp = number("min_p")
        if not 0 <= mp <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {mp}")
        rp = number("repetition_penalty")
        if not rp > 0 or math.isinf(rp):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {rp}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = number(name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {v}")
        if self.seed is not None:
            if not 0 <= integer("seed") < 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not 1 <= integer("n") <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= integer("logprobs") <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if integer("max_tokens") < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        else:
            stop = list(stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
            ids = [ids]
        ids = list(ids)
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", [int(i) for i in ids])
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_rng(seed: int | None = None) -> np.random.Generator:
    """A request's own generator: the same seed gives the same draws."""
    return np.random.default_rng(seed)


class Sampler:
    """Stateless: everything a draw depends on comes in through the arguments."""

    def sample(self, logits: np.ndarray, params: SamplingParams, previous_token_ids=(),
               rng: np.random.Generator | None = None) -> int:
        logits = self._penalized(logits, params, previous_token_ids)
        if params.temperature == 0.0:
            return int(np.argmax(logits))  # first (lowest) index among ties
        ids, weights = self._distribution(logits, params)
        if rng is None:
            rng = make_rng(params.seed)
        cdf = np.cumsum(weights, dtype=np.float64)
        i = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        return i if ids is None else int(ids[i])

    def probabilities(self, logits: np.ndarray, params: SamplingParams, previous_token_ids=()) -> np.ndarray:
        """The distribution `sample` draws from, float64 [V] (one-hot at the argmax when greedy)."""
        logits = self._penalized(logits, params, previous_token_ids)
        out = np.zeros(logits.shape[0], np.float64)
        if params.temperature == 0.0:
            out[int(np.argmax(logits))] = 1.0
            return out
        ids, weights = self._distribution(logits, params)
        weights = weights.astype(np.float64)
        out[slice(None) if ids is None else ids] = weights / weights.sum()
        return out

    # ---- steps --------------------------------------------------------------------------------------------
    @staticmethod
    def _penalized(logits, params: SamplingParams, previous_token_ids) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(f"logits: expected shape [vocab], got {logits.shape}")
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)
        top = logits.max()
        if np.isnan(top) or top == np.inf or top == -np.inf:
            raise ValueError(f"logits: the maximum is {top}; the model produced NaN/inf or masked every token")
        if params.repetition_penalty != 1.0 and len(previous_token_ids):
            ids = np.unique(np.asarray(previous_token_ids, dtype=np.int64))
            ids = ids[(ids >= 0) & (ids < logits.shape[0])]
            logits = logits.copy()
            vals = logits[ids]
            p = np.float32(params.repetition_penalty)
            logits[ids] = np.where(vals > 0, vals / p, vals * p)
        return logits

    @staticmethod
    def _distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
        """(candidate token ids or None for all, their unnormalised float32 weights) after temperature, top-k,
        top-p, min-p.
        float32 math (float64 exp over 152k entries costs 10x more); the weights are relative to the max token,
        which every filter keeps."""
        v = logits.shape[0]
        scaled = logits if params.temperature == 1.0 else logits * np.float32(1.0 / params.temperature)
        k = params.top_k
        ids = None  # None = every token
        if 0 < k < v:
            kth = np.partition(scaled, v - k)[v - k]  # the k-th largest value; ties with it are kept (as HF does)
            ids = np.flatnonzero(scaled >= kth)
            scaled = scaled[ids]
        weights = np.exp(scaled - scaled.max())
        if params.top_p < 1.0:
            tau = _nucleus_threshold(weights, params.top_p)
            if tau > 0:
                keep = np.flatnonzero(weights >= tau)
                ids = keep if ids is None else ids[keep]
                weights = weights[keep]
        if params.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  weight_i >= min_p (weights are exp(logit - max logit))
            keep = np.flatnonzero(weights >= np.float32(params.min_p))
            ids = keep if ids is None else ids[keep]
            weights = weights[keep]
        return ids, weights


def _nucleus_threshold(weights: np.ndarray, top_p: float) -> float:
    """The weight of the last token of the nucleus: the smallest set of highest-probability tokens whose mass
    reaches top_p. Tokens with weight >= it are kept (ties at the boundary all stay). Sorts values only (a SIMD
    sort, much faster than argsort), and first only the best _NUCLEUS_PROBE of them."""
    total = float(weights.sum(dtype=np.float64))
    target = top_p * total
    n = weights.shape[0]
    if n > _NUCLEUS_PROBE:
        best = -np.partition(-weights, _NUCLEUS_PROBE - 1)[:_NUCLEUS_PROBE]
        if float(best.sum(dtype=np.float64)) >= target:
            ordered = -np.sort(-best)
        else:
            ordered = -np.sort(-weights)
    else:
        ordered = -np.sort(-weights)
    cum_before = np.cumsum(ordered, dtype=np.float64) - ordered
    count = max(1, int(np.count_nonzero(cum_before < target)))
    return float(ordered[count - 1])
