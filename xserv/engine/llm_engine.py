"""The generation loop: requests in, tokens out.

One `step()`:
1. waits for the step in flight (the only sync) and books its tokens: advances each sequence, registers filled KV
   blocks in the prefix cache, ends sequences on a stop token id, max_tokens or the context length;
2. asks the scheduler for the next step (decodes plus prefill chunks under the token budget) and launches it:
   forward (a CUDA graph replay for pure decode steps) and the sampling op, without waiting;
3. while the GPU runs that step, does the per-token host work of the step just booked: incremental detokenizing
   for sequences that stream or have stop strings (others decode their text once, when they finish), stop
   strings, stream buffers.
A sequence that a stop string ends in (3) already has a row in the step in flight; that token is dropped.
Structured output: a constrained row's token mask is computed on the host from the sequence's matcher, which must
have consumed every token before the one being sampled. So a step with constrained rows launches its forward, then
(after the previous step is booked, when that step was launched ahead) computes the masks while the forward runs,
and launches the sampling op last.
When the step in flight is a pure decode step (or a prefill graph's chunk that ends its prompt), the next decode
step is launched *before* (1), its input tokens gathered on the device (see `_decode_ahead`), so the GPU never
waits for the host between decode steps.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .block_manager import BlockManager
from .config import CPU_KV_BYTES, EngineConfig
from .kv_cache import KVCache, KVCacheSpec, kv_cache_dtype, usable_device_memory
from .model_runner import ModelRunner, logits_width
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import FINISHED, RUNNING, RequestOutput, Sequence  # noqa: F401 (RequestOutput: the library's)
from .state_cache import StateCache, slot_bytes

log = logging.getLogger("xserv")


def choice_params(params) -> list:
    """One SamplingParams (n=1) per sample of `params`: the same values, sample i seeded with seed + i when a seed
    is given."""
    one = dataclasses.replace(params, n=1)
    if params.seed is None:
        return [one] * params.n
    return [dataclasses.replace(one, seed=(params.seed + i) % 2**64) for i in range(params.n)]


@dataclass
class _Launched:
    scheduled: list  # [(sequence, tokens computed)]
    sampled: list  # the sequences that get a token, in the order of the sampler's rows
    result: object  # SampleResult, or None when no row samples
    replayed: bool  # a decode step run from a CUDA graph
    prefill_graph: bool = False  # one sequence's prompt chunk run from a prefill CUDA graph
    logits: object = None  # the forward's logits while the sampling launch waits for the matchers (constrained rows)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, *, max_model_len: int, eos_token_ids,
                 config: EngineConfig | None = None, sampler: Sampler | None = None):
        config = config or EngineConfig()
        self.config = config
        self.runner = runner
        self.kv_cache = runner.kv_cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = logits_width(runner.model)
        device = runner.device
        self.blocks = BlockManager(self.kv_cache.num_blocks, self.kv_cache.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.batched_tokens(device))
        self.sampler = sampler or Sampler(self.vocab_size, config.max_num_seqs, device, config.seed)
        # what a step launched ahead reads (in the graphs captured after this). Tensor parallelism: the other ranks
        # have no sampler; each decode graph then begins by broadcasting rank 0's tokens to them, where the group's
        # communicator can (the IPC kernels; with NCCL only, or on a larger batch, no step is launched ahead)
        comm = getattr(runner.model, "comm", None) if runner.group is not None else None
        feeds = comm is None or comm.can_broadcast_tokens(self.sampler.tokens.shape[0])
        runner.feed_src = self.sampler.tokens if feeds else None
        self._ids = itertools.count()
        self._inflight: deque[_Launched] = deque()  # launched steps not yet booked (at most two)
        self.num_steps_ahead = 0  # decode steps launched before the previous step was booked
        self.step_profile: list | None = None  # set to [] to record GPU timing events per step (benchmarks)
        # where step() spends its time: "wait" (for the GPU, inside "book") and the host work around it
        self.host_seconds = {"book": 0.0, "wait": 0.0, "schedule_launch": 0.0, "emit": 0.0}
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, built at the first constrained request

    @classmethod
    def from_model(cls, model, tokenizer, config: EngineConfig, *, context_len: int, eos_token_ids,
                   group=None) -> "LLMEngine":
        """Everything around a loaded model, in the order memory needs: activation workspace and sampler state,
        then the KV cache from what memory is left, the runner, the engine, and last the CUDA graphs (decode, then
        short prefills). `group`: rank 0's TPGroup of a tensor-parallel model (xserv/parallel/group.py): every rank
        makes the same workspace, a KV pool of the same number of blocks (the smallest any rank's memory allows)
        and the same runner, and captures the same graphs."""
        device, mc = model.device, model.config
        max_len = min(config.max_model_len or context_len, context_len)
        layout = tuple(getattr(model, "state_layout", ()))
        if layout:
            if group is not None:
                raise ValueError("tensor parallelism is not supported yet for models with recurrent layers "
                                 "(hybrid Gated DeltaNet models): use tensor_parallel_size 1")
            config = _fit_state_slots(config, layout, device)
        batched = config.batched_tokens(device)
        tokens = getattr(tokenizer, "vocab_size", None)
        if hasattr(model, "limit_logits") and tokens is not None and tokens < mc.vocab_size:
            model.limit_logits(tokens)  # the head's padding rows past the tokenizer's tokens are never sampled
        workspace = model.make_workspace(batched, config.max_num_seqs)
        sampler = Sampler(logits_width(model), config.max_num_seqs, device, config.seed)
        spec = KVCacheSpec(*model.kv_layout, config.block_size)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        # the state slots first: on CUDA the KV pool takes a share of what memory is left after them
        state = StateCache(layout, config.max_num_seqs, device) if layout else None
        others = [] if group is None else group.call(
            "prepare", max_tokens=batched, max_logits=config.max_num_seqs, block_size=config.block_size,
            memory_fraction=config.gpu_memory_fraction, kv_cache_dtype=config.kv_cache_dtype)
        kv_tokens = config.kv_cache_tokens
        if kv_tokens is None and device == "cpu":
            kv_tokens = min(4 * max_len, max(CPU_KV_BYTES // spec.bytes_per_token(kv_dtype), 2048))
        elif kv_tokens is None and group is not None:
            kv_tokens = min([KVCache.capacity_tokens(spec, kv_dtype, config.gpu_memory_fraction), *others])
        kv_cache = KVCache.create(spec, device, kv_dtype, num_tokens=kv_tokens,
                                  memory_fraction=config.gpu_memory_fraction)
        kv_cache.state = state
        max_model_len = min(max_len, kv_cache.num_tokens)
        runner = ModelRunner(model, kv_cache, max_num_batched_tokens=batched,
                             max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, workspace=workspace)
        if group is not None:
            group.call("runner", num_tokens=kv_cache.num_tokens, block_size=config.block_size,
                       kv_cache_dtype=config.kv_cache_dtype,
                       max_num_batched_tokens=batched, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len)
            runner.group = group
        engine = cls(runner, tokenizer, max_model_len=max_model_len, eos_token_ids=eos_token_ids, config=config,
                     sampler=sampler)
        if device == "cuda" and config.cuda_graphs:
            runner.capture_decode_graphs()
            runner.capture_prefill_graphs(config.prefill_graph_tokens)
        return engine

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- requests -----------------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; the context holds {self.max_model_len} tokens "
                             f"(max_model_len) and at least one must be left to generate")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")

    def check_params(self, params) -> None:
        """What SamplingParams cannot check alone: logit_bias ids inside the model's vocabulary."""
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(f"logit_bias token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")

    def make_constraint(self, structured):
        """A fresh matcher for one sequence (ValueError when the grammar does not compile against the tokenizer)."""
        from ..structured import GrammarConstraint, grammar_tokenizer

        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return GrammarConstraint(self._grammar_tokenizer, structured)

    def add_request(self, prompt_ids, params, prompt: str | None = None, *, stream: bool = False) -> Sequence:
        """Queue one sequence (params.n must be 1; see `add_samples`). `stream`: text deltas are wanted as tokens
        come (otherwise the text is decoded once, at the end, unless stop strings need it earlier)."""
        if params.n != 1:
            raise ValueError(f"add_request takes n=1 (got n={params.n}); use add_samples for several samples")
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_prompt(prompt_ids)
        self.check_params(params)
        constraint = self.make_constraint(params.structured) if params.structured is not None else None
        seq_id = next(self._ids)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        detok = None
        if stream or params.stop:
            detok = self.tokenizer.detokenizer(skip_special_tokens=True, prompt_ids=prompt_ids)
        seq = Sequence(seq_id, prompt_ids, params, seed=self.sampler.request_seed(seq_id, params.seed),
                       stop_ids=stop_ids, prompt=prompt, detokenizer=detok, constraint=constraint)
        self.scheduler.add(seq)
        return seq

    def add_samples(self, prompt_ids, params, prompt: str | None = None, *, stream: bool = False) -> list[Sequence]:
        """`params.n` sequences of one prompt (sample i seeded with seed + i when a seed is given); the prefix
        cache lets them share the prompt's KV blocks."""
        return [self.add_request(prompt_ids, p, prompt, stream=stream) for p in choice_params(params)]

    def abort(self, seq: Sequence) -> None:
        if seq.status == FINISHED:
            return
        self.scheduler.finish(seq, "abort")
        self._finalize_text(seq, dropped_last=False)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Counters for monitoring: requests running/waiting, KV blocks, prefix-cache tokens, preemptions."""
        b = self.blocks
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_total": b.num_blocks, "kv_blocks_free": b.num_free,
                "prefix_cache_query_tokens": b.query_tokens, "prefix_cache_hit_tokens": b.hit_tokens,
                "num_preemptions": self.scheduler.num_preemptions}

    # ---- one step -----------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, str]]:
        """Book the step in flight, launch the next, and return (sequence, new text) for every sequence that got a
        token in the booked step ("" for sequences that neither stream nor have stop strings, until they end)."""
        t0 = time.perf_counter()
        ahead = self._decode_ahead()
        if ahead is not None:
            rows, index = ahead
            self.num_steps_ahead += 1
            self._launch([(seq, 1) for seq in rows], ahead=1, token_index=index)
            booked = self._book(self._inflight.popleft())
            self._sample_deferred()
            t1 = t2 = time.perf_counter()
        else:
            booked = []
            while self._inflight:
                booked += self._book(self._inflight.popleft())
            t1 = time.perf_counter()
            scheduled = self.scheduler.schedule()
            if scheduled:
                self._launch(scheduled)
            t2 = time.perf_counter()
        results = self._emit(booked)
        t = self.host_seconds
        t["book"] += t1 - t0
        t["schedule_launch"] += t2 - t1
        t["emit"] += time.perf_counter() - t2
        return results

    def drain(self) -> list[tuple[Sequence, str]]:
        """Book every step in flight without launching another: afterwards nothing of this engine runs on the
        device. Returns what those steps produced, as `step()` does."""
        booked = []
        while self._inflight:
            booked += self._book(self._inflight.popleft())
        return self._emit(booked)

    def close(self) -> None:
        """End every request, wait for the device, and destroy the CUDA graphs (whose captured buffers are then
        the only references this engine holds to device memory: dropping the engine frees the rest)."""
        self.drain()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.abort(seq)
        if self.runner.device == "cuda":
            from ..runtime import synchronize

            synchronize()
        self.runner.close()

    def _decode_ahead(self):
        """When the step in flight is a pure decode step replayed from a graph (or a prefill graph's chunk, the
        step's only row) and nothing waits to be admitted, the next step is that step's sampled sequences decoding
        their next token: launch it now, before the step in flight has been booked, with each row's input token
        gathered on the device from the step in flight's output (`index`). Sequences that the token in flight ends
        by length are left out; one that a stop token or string ends keeps its row, whose token is dropped when
        booked. Returns (rows, index) or None."""
        if (not self.config.overlap_steps or self.runner.feed_src is None or len(self._inflight) != 1
                or self.scheduler.waiting):
            return None
        last = self._inflight[0]
        if not (last.replayed or last.prefill_graph):
            return None
        rows, index = [], []
        for i, seq in enumerate(last.sampled):
            if seq.status != RUNNING:
                continue
            if seq.logprobs is not None:
                return None  # logprobs are read back after each step, not ahead
            after = len(seq.token_ids) + 1  # tokens once the one in flight is booked
            if after - seq.num_prompt_tokens >= seq.params.max_tokens or after >= self.max_model_len:
                continue
            rows.append(seq)
            index.append(i)
        if not rows or not self.runner.can_replay([(s, 1) for s in rows], ahead=1):
            return None
        for seq in rows:  # room for the K/V of the token in flight
            if not self.scheduler.reserve(seq, len(seq.token_ids) + 1):
                return None
        return rows, np.array(index, np.int32)

    def _launch(self, scheduled, *, ahead: int = 0, token_index=None) -> None:
        if ahead:
            sampled = [seq for seq, _ in scheduled]
        else:
            sampled = [seq for seq, n in scheduled if seq.num_computed + n == len(seq.token_ids)]
        events = self._step_events()
        logits = self.runner.run(scheduled, ahead=ahead, token_index=token_index)
        deferred = ahead and any(seq.constraint is not None for seq in sampled)
        # Constrained rows: the masks are computed here, while the forward runs (the matchers are up to date unless
        # the step was launched ahead: then after the previous step is booked, in _sample_deferred).
        result = self.sampler.sample(logits, sampled, ahead) if sampled and not deferred else None
        if events is not None:
            from ..runtime import get_device

            events[1].record(get_device().stream_handle)
            self.step_profile.append((events, len(scheduled), sum(n for _, n in scheduled),
                                      self.runner.last_run_replayed, bool(ahead)))
        self._inflight.append(_Launched(scheduled, sampled, result, self.runner.last_run_replayed,
                                        self.runner.last_run_prefill_graph, logits if deferred else None))

    def _sample_deferred(self) -> None:
        """Launch the sampling of the newest step if it waited for its matchers (it was launched ahead with
        constrained rows, and the step before it is booked now: every sequence's host state has caught up)."""
        last = self._inflight[-1] if self._inflight else None
        if last is None or last.logits is None:
            return
        last.result = self.sampler.sample(last.logits, last.sampled, 0)
        last.logits = None

    def _step_events(self):
        """With `step_profile` set to a list (benchmarks), each launched step records a pair of timing events."""
        if self.step_profile is None or self.runner.device != "cuda":
            return None
        from ..runtime import get_device
        from ..runtime.pinned import Event

        events = (Event(timing=True), Event(timing=True))
        events[0].record(get_device().stream_handle)
        return events

    def _book(self, launched: "_Launched") -> list[tuple[Sequence, int, str | None]]:
        """Wait for a launched step; (sequence, token, finish reason so far) for each sampled row."""
        scheduled, sampled, result = launched.scheduled, launched.sampled, launched.result
        postprocess = self.scheduler.postprocess
        for seq, n in scheduled:
            if seq.status == RUNNING:
                seq.num_computed += n
                postprocess(seq, seq.num_computed)
        if result is None:
            return []
        waited = time.perf_counter()
        tokens, logprob, top_ids, top_logprobs = result.fetch()
        self.host_seconds["wait"] += time.perf_counter() - waited
        if self.runner.group is not None:  # a rank that failed during the step: its tokens are not to be trusted
            self.runner.group.check()
        booked = []
        max_len = self.max_model_len
        for i, (seq, token) in enumerate(zip(sampled, tokens.tolist())):
            if seq.status != RUNNING:
                continue  # ended (abort, stop token or string) while its row was in flight
            ids = seq.token_ids
            ids.append(token)
            if seq.logprobs is not None:
                k = seq.params.logprobs
                top = [] if k == 0 else list(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))
                seq.logprobs.append({"token_id": token, "logprob": float(logprob[i]), "top": top})
            reason = None
            constraint = seq.constraint
            if constraint is not None and token not in seq.stop_ids:
                constraint.consume(token)
            if token in seq.stop_ids:
                reason = "stop"
            elif constraint is not None and constraint.done:  # the grammar is complete: the token is text
                reason = "grammar"
            elif len(ids) - seq.num_prompt_tokens >= seq.params.max_tokens or len(ids) >= max_len:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(seq, "stop" if reason == "grammar" else reason)
            booked.append((seq, token, reason))
        return booked

    def _emit(self, booked) -> list[tuple[Sequence, str]]:
        results = []
        for seq, token, reason in booked:
            delta = ""
            matcher = seq.matcher
            if matcher is not None:
                if reason != "stop":  # a stop token id is not part of the text
                    matcher.push(seq.detokenizer.push(token))
                    if matcher.stopped and seq.status != FINISHED:
                        self.scheduler.finish(seq, "stop")
                if seq.status == FINISHED:
                    self._finalize_text(seq, dropped_last=False)
                    delta = matcher.take(final=True)
                else:
                    delta = matcher.take()
                if delta and seq.stream_buffer is not None:
                    seq.stream_buffer.append(delta)
            elif seq.status == FINISHED:
                self._finalize_text(seq, dropped_last=reason == "stop")
                delta = seq.final_text
            results.append((seq, delta))
        return results

    def _finalize_text(self, seq: Sequence, dropped_last: bool) -> None:
        if seq.final_text is not None:
            return
        if seq.matcher is not None:
            if not seq.matcher.stopped:
                seq.matcher.push(seq.detokenizer.flush())
            seq.final_text = seq.matcher.text
        else:
            ids = seq.output_ids[:-1] if dropped_last else seq.output_ids
            seq.final_text = self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- logits -------------------------------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """float32 [len, vocab]: the logits at every position of `token_ids` (prefilled in chunks into blocks
        borrowed from the pool for the call)."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("token_ids is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens, longer than max_model_len {self.max_model_len}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")
        need = self.blocks.blocks_for(len(token_ids))
        if not self.blocks.can_allocate(need):
            raise RuntimeError(f"KV cache busy: {need} blocks needed, {self.blocks.num_free} free")
        table = self.blocks.allocate(need)
        try:
            return self.runner.logits(token_ids, table)
        finally:
            self.blocks.free(table)


# A model with per-sequence state: its slots take at most this share of the memory the caches may use (the rest
# is the KV pool of its attention layers), so that long contexts keep room.
STATE_MEMORY_SHARE = 0.5


def _fit_state_slots(config: EngineConfig, layout, device: str) -> EngineConfig:
    """The engine config for a model with per-sequence state (engine/state_cache.py). Concurrency is bounded by state
    slots as much as by KV blocks: each running sequence owns one slot (a 27B hybrid's is ~147 MiB), so on CUDA
    max_num_seqs is lowered, with a notice, to the slots that fit in STATE_MEMORY_SHARE of gpu_memory_fraction of
    the free memory. Prefix caching is turned off (a cached prefix would need the state after its last token)."""
    changes = {}
    if config.enable_prefix_caching:
        log.info("prefix caching is off for this model: its recurrent layers' state is not cached yet")
        changes["enable_prefix_caching"] = False
    if device == "cuda":
        free = usable_device_memory()
        per_slot = slot_bytes(layout)
        fit = int(free * config.gpu_memory_fraction * STATE_MEMORY_SHARE) // per_slot - 1  # one scratch slot
        if fit < 1:
            raise ValueError(f"not enough device memory for one sequence's recurrent state ({per_slot / 2**20:.1f} "
                             f"MiB a sequence, {free / 2**30:.2f} GiB free)")
        if fit < config.max_num_seqs:
            log.info("max_num_seqs lowered from %d to %d: each sequence's recurrent state takes %.1f MiB",
                     config.max_num_seqs, fit, per_slot / 2**20)
            changes["max_num_seqs"] = fit
    return config.replace(**changes) if changes else config
