"""The engine's per-token logprob entries in OpenAI's two formats: chat (`content` items with top_logprobs) and
completions (parallel lists with text offsets)."""
from __future__ import annotations

import math


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


# A logprob that is not a finite number (-inf, NaN) has no JSON form (RFC 8259: Python would write the bare
# -Infinity, which JavaScript's JSON.parse, Go and Rust refuse): it goes out as this, the value vLLM writes.
NON_FINITE_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NON_FINITE_LOGPROB


def _top(entry: dict, top_n: int) -> list[tuple[int, float]]:
    """The entry's top (token id, logprob) pairs, at most top_n, without the tokens that could not be sampled (at
    -inf, e.g. masked by a constraint): a step that allows fewer tokens than top_n lists fewer."""
    return [(t, _finite(lp)) for t, lp in (entry.get("top") or [])[:top_n] if lp != -math.inf]


def chat_logprobs(tokenizer, entries: list[dict] | None, top_n: int) -> dict | None:
    if entries is None:
        return None

    def one(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for e in entries:
        item = one(e["token_id"], _finite(e["logprob"]))
        item["top_logprobs"] = [one(t, lp) for t, lp in _top(e, top_n)]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer, entries: list[dict] | None, top_n: int, text_offset: int) -> dict | None:
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(_token_text(tokenizer, e["token_id"]))
        text_offset += len(tokens[-1])
    top = [{_token_text(tokenizer, t): lp for t, lp in _top(e, top_n)} for e in entries]
    return {"tokens": tokens, "token_logprobs": [_finite(e["logprob"]) for e in entries],
            "top_logprobs": top if top_n else None, "text_offset": offsets}
