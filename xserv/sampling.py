"""Sampling parameters of a request, validated on construction.

Applied in this order (xserv/engine/sampler.py, through the sampling op): logit_bias and the structured-output
mask (tokens the grammar does not allow get -inf) -> repetition / presence / frequency penalties -> temperature (0 = greedy argmax) -> top-k -> top-p -> min-p -> one draw keyed by the request's seed and
the token's position (reproducible whatever else is batched with it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .structured import StructuredOutput

MAX_LOGPROBS = 20  # top-N logprobs per token, at most
MAX_N = 16  # samples per prompt, at most
MAX_LOGIT_BIAS = 100.0  # |bias| per token, at most (OpenAI's range)


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
    # token id -> bias in [-100, 100], added to the logit before everything else (the engine checks the ids
    # against the model's vocabulary)
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    structured: StructuredOutput | None = None  # the answer's grammar (xserv/structured.py)

    def __post_init__(self):
        def number(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"{name} must be a number, got {v!r}")
            if not math.isfinite(v):  # nan compares false with every bound: say what is wrong, not the range
                raise ValueError(f"{name} must be finite, got {float(v)}")
            object.__setattr__(self, name, float(v))
            return float(v)

        def integer(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            object.__setattr__(self, name, int(v))
            return int(v)

        t = number("temperature")
        if t < 0:
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
        if rp <= 0:
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
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput (xserv.structured), got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}: ids non-negative integers (or their decimal strings, as JSON keys arrive), biases finite
    numbers in [-100, 100]. An empty map is None."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id -> bias, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        key = k
        if isinstance(k, str) and k.strip().isdigit():
            key = int(k)
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
            raise ValueError(f"logit_bias: token ids must be non-negative integers, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise ValueError(f"logit_bias[{k!r}] must be a finite number, got {v!r}")
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{k!r}] must be in [-100, 100], got {v}")
        out[int(key)] = float(v)
    return out or None
