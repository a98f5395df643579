"""The generation loop: requests in, tokens out.

Each step either prefills (new prompts, several packed in one forward, long prompts in chunks) or decodes one
token for every running sequence in one batched forward. Sampling runs on the host from float32 logits (greedy
rows use the argmax op on the device). Sequences stop on EOS, stop token ids, stop strings or max_tokens.
When the KV pool runs out during decode, the newest sequence is preempted (its blocks freed, recomputed later).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from .batch import SeqChunk
from .model_runner import ModelRunner

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[dict] | None = None  # per output token: {"token_id", "logprob", "top": [(id, logprob), ...]}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _as_list(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop if s]


class StopStringMatcher:
    """Accumulates detokenized text, finds stop strings, and says how much text is safe to emit: text that could
    still turn into the start of a stop string is held back until the next tokens decide."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        if not self.stops:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _safe_end(self) -> int:
        if self.stopped or not self.stops:
            return len(self.text)
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return len(self.text) - hold

    def take(self, final: bool = False) -> str:
        """The text not yet emitted that is safe to emit (all of it when `final`)."""
        end = len(self.text) if final else self._safe_end()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out


class Sequence:
    def __init__(self, seq_id: int, prompt_ids: list[int], params, rng, detokenizer, prompt: str | None,
                 stop_ids: set[int]):
        self.seq_id = seq_id
        self.prompt = prompt
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.rng = rng
        self.detokenizer = detokenizer
        self.stop_ids = stop_ids
        self.matcher = StopStringMatcher(_as_list(params.stop))
        self.status = WAITING
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stream_buffer: deque[str] | None = None  # text deltas not yet read by a TextStream

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == FINISHED

    @property
    def greedy(self) -> bool:
        p = self.params
        return p.temperature == 0 and getattr(p, "repetition_penalty", 1.0) == 1.0

    def output(self) -> RequestOutput:
        return RequestOutput(self.seq_id, self.prompt, self.token_ids[:self.num_prompt_tokens], self.matcher.text,
                             self.output_ids, self.finish_reason)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, *, max_model_len: int, eos_token_ids, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, seed: int = 0):
        from ..sampling import Sampler

        self.runner = runner
        self.kv_cache = runner.kv_cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.seed = seed
        self.sampler = Sampler()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.num_preemptions = 0

    # ---- requests -----------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, longer than the model's context of {self.max_model_len} "
                             f"tokens (max_model_len)")
        if n > self.kv_cache.num_tokens:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds ({self.kv_cache.num_tokens} "
                             f"tokens); pass a larger kv_cache_tokens")
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary (size {vocab})")

    def add_request(self, prompt_ids, params, prompt: str | None = None, *, stream: bool = False) -> Sequence:
        from ..sampling import make_rng

        prompt_ids = [int(t) for t in prompt_ids]
        self.check_prompt(prompt_ids)
        seq_id = next(self._ids)
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + seq_id) % (2**63)
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        detokenizer = self.tokenizer.detokenizer(skip_special_tokens=True, prompt_ids=prompt_ids)
        seq = Sequence(seq_id, prompt_ids, params, make_rng(seed), detokenizer, prompt, stop_ids)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if seq.status == FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.status = FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        """Counters for monitoring: requests running/waiting, KV blocks, prefix-cache tokens, preemptions."""
        alloc = self.kv_cache.allocator
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_blocks_total": alloc.num_blocks, "kv_blocks_free": alloc.num_free,
                "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0,
                "num_preemptions": self.num_preemptions}

    # ---- scheduling ---------------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.kv_cache.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.kv_cache.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.kv_cache.allocator.can_allocate(need):
            return False
        seq.block_table += self.kv_cache.allocator.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)

    def _schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """Sequences with more than one token to compute (new prompts, unfinished chunks), up to the token
        budget. New sequences are admitted only while the running ones keep a block of headroom each."""
        budget = self.max_num_batched_tokens
        scheduled = []
        for seq in [s for s in self.running if len(s.token_ids) - s.num_computed > 1]:
            if budget <= 0:
                break
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self._grow(seq, seq.num_computed + n):
                break
            scheduled.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(len(seq.token_ids), budget)
            need = self.kv_cache.blocks_for(n)
            headroom = len(self.running)
            if self.kv_cache.allocator.num_free < need + headroom:
                if not self.running and not scheduled:
                    if not self.kv_cache.allocator.can_allocate(need):
                        raise RuntimeError("the KV cache cannot hold a single prompt chunk")
                else:
                    break
            self.waiting.popleft()
            self._grow(seq, n)
            seq.status = RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _schedule_decode(self) -> list[tuple[Sequence, int]]:
        scheduled = []
        for seq in list(self.running):
            if seq.status != RUNNING:
                continue  # preempted below
            while not self._grow(seq, len(seq.token_ids)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == RUNNING:
                scheduled.append((seq, 1))
        return scheduled

    # ---- one step -----------------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, str]]:
        """Run one forward; returns (sequence, new text) for every sequence that got a token this step."""
        scheduled = self._schedule_prefill() or self._schedule_decode()
        if not scheduled:
            if self.waiting:
                raise RuntimeError("the KV cache is too small to make progress on the waiting requests")
            return []
        chunks = []
        for seq, n in scheduled:
            start = seq.num_computed
            completes = start + n == len(seq.token_ids)
            chunks.append(SeqChunk(seq.token_ids[start:start + n], start, seq.block_table,
                                   "last" if completes else "none"))
        sample_rows = [(seq, i) for i, (seq, n) in enumerate(scheduled) if chunks[i].logits == "last"]
        greedy = [seq.greedy for seq, _ in sample_rows]
        tokens = self.runner.run_and_sample(chunks, greedy, self._sample_host, [s for s, _ in sample_rows])
        for seq, n in scheduled:
            seq.num_computed += n
        results = []
        for (seq, _), token in zip(sample_rows, tokens):
            delta = self._append(seq, int(token))
            if delta and seq.stream_buffer is not None:
                seq.stream_buffer.append(delta)
            results.append((seq, delta))
        return results

    def _sample_host(self, seq: Sequence, logits_row: np.ndarray) -> int:
        return int(self.sampler.sample(logits_row, seq.params, seq.token_ids, seq.rng))

    def _append(self, seq: Sequence, token: int) -> str:
        seq.token_ids.append(token)
        params = seq.params
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        else:
            seq.matcher.push(seq.detokenizer.push(token))
            if seq.matcher.stopped:
                reason = "stop"
        if reason is None and (seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if not seq.matcher.stopped:
                seq.matcher.push(seq.detokenizer.flush())
            self._finish(seq, reason)
            return seq.matcher.take(final=True)
        return seq.matcher.take()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    # ---- whole requests -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params_list, prompt_texts=None) -> list[RequestOutput]:
        texts = prompt_texts or [None] * len(prompts)
        seqs = []
        try:
            for ids, params, text in zip(prompts, params_list, texts):
                seqs.append(self.add_request(ids, params, text))
            while any(not s.is_finished for s in seqs):
                self.step()
        finally:
            for s in seqs:
                self.abort(s)
        return [s.output() for s in seqs]

    def stream(self, prompt_ids, params, prompt: str | None = None) -> "TextStream":
        """An iterator of one request's text deltas as they come; `.output` holds the request so far."""
        return TextStream(self, self.add_request(prompt_ids, params, prompt))

    def logits(self, token_ids) -> np.ndarray:
        """float32 [len, vocab]: the logits at every position of `token_ids` (prefilled in chunks)."""
        token_ids = [int(t) for t in token_ids]
        self.check_prompt(token_ids)
        return self.runner.logits(token_ids, chunk=self.runner.logits_chunk)


class TextStream:
    """Text deltas of one request, stepping the engine on demand. Closing it (or breaking out of the loop and
    dropping it, or an exception such as KeyboardInterrupt inside the loop) aborts the request."""

    def __init__(self, engine: LLMEngine, seq: Sequence):
        self.engine = engine
        self.seq = seq
        seq.stream_buffer = self._pending = deque()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            while not self._pending:
                if self.seq.is_finished:
                    raise StopIteration
                self.engine.step()  # steps every running request; this one's text lands in _pending
        except BaseException:
            self.close()
            raise
        return self._pending.popleft()

    def close(self) -> None:
        self.engine.abort(self.seq)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def output(self) -> RequestOutput:
        return self.seq.output()

    @property
    def num_tokens(self) -> int:
        return self.seq.num_output_tokens
