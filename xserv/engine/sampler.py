"""Logits in, tokens out: every row of a step sampled in one launch of the sampling op (`xserv/ops/sampling.py`:
the CUDA kernel on the GPU, its NumPy reference on the CPU), each row with its own parameters.

Randomness is counter-based (Philox keyed by the request's seed, counter = the token's position), so a seeded
request draws the same tokens whatever else is in the batch. Penalty state (token counts and the seen set per
sequence) lives next to the logits, in rows indexed by the sequence's slot; the op updates it as it samples.
Only token ids (and the logprobs a request asks for) come back to the host, after the step's one sync.

Constrained rows (structured output) get a token mask per step: the sequence's matcher fills a row of a host
bitmask (pinned on CUDA), the rows of the step's constrained sequences are uploaded with one asynchronous copy,
and the kernel reads row `mask_row` of it. Logit bias lives in a per-slot table [slots, vocab] made at the first
request that has one, its row written once per sequence. Rows with neither read neither (and a step without any
uploads nothing)."""
from __future__ import annotations

import secrets
import time

import numpy as np

from ..ops import sampling as op
from ..ops.argmax import argmax
from ..runtime import get_device
from ..structured import fill_masks, mask_words
from ..tensor import Tensor, float32, int32

_SEED_MIX = 1_000_003


def uses_penalties(params) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class Sampler:
    def __init__(self, vocab_size: int, max_rows: int, device: str, engine_seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = device
        self.engine_seed = engine_seed
        self.tokens = Tensor.empty((max_rows,), int32, device)
        self.logprob = Tensor.empty((max_rows,), float32, device)
        self.top_ids = Tensor.empty((max_rows, op.MAX_TOP_LOGPROBS), int32, device)
        self.top_logprobs = Tensor.empty((max_rows, op.MAX_TOP_LOGPROBS), float32, device)
        self.fparams = Tensor.zeros((max_rows, op.NUM_F), float32, device)
        self.iparams = Tensor.zeros((max_rows, op.NUM_I), int32, device)
        self.counts, self.seen = op.penalty_state(max_rows, vocab_size, device)
        self._penalty_owner = np.full(max_rows, -1, np.int64)  # seq_id whose counts a slot's row holds
        self.mask_words = mask_words(vocab_size)
        self.token_mask = Tensor.zeros((max_rows, self.mask_words), int32, device)
        self.logit_bias: Tensor | None = None  # [max_rows, vocab] float32, made at the first biased request
        self._bias_owner = np.full(max_rows, -1, np.int64)
        self.mask_seconds = 0.0  # host time spent computing token masks (all steps)
        self.mask_rows = 0  # token masks computed (all steps)
        self._host_masks = None  # CPU: the masks are filled straight into token_mask's array
        self._host_tokens = None
        if device == "cuda":  # two steps can be in flight: each reads its tokens back into its own pinned array
            from ..runtime.pinned import Event, PinnedArray

            self._host_tokens = [(PinnedArray((max_rows,), np.int32), Event()) for _ in range(2)]
            self._next_host = 0
            # The read-back runs on the device's copy stream, beside the next step's first kernels: `_sampled`
            # marks the tokens written (the copy waits for it), `_copied` the copy done (the next write of the
            # tokens waits for that: long done by then, the next step's forward lies between).
            self._sampled, self._copied = Event(), Event()
            self._copied_pending = False
            # Two host masks, used in turn, each with an event after its upload: a host buffer is refilled only
            # once the copy that read it has run (in practice long before: the step that used it has been booked).
            self._host_masks = [(PinnedArray((max_rows, self.mask_words), np.int32), Event()) for _ in range(2)]
            self._next_mask = 0
            self._mask_pending = [False, False]

    def request_seed(self, seq_id: int, seed: int | None) -> int:
        """A request's own seed; else one derived from the engine's seed and the request id; else (no engine seed)
        a fresh one from the OS's entropy."""
        if seed is not None:
            return seed
        if self.engine_seed is None:
            return secrets.randbits(64)
        return (self.engine_seed * _SEED_MIX + seq_id) % 2**64

    def sample(self, logits: Tensor, seqs, ahead: int = 0) -> "SampleResult":
        """Launch sampling of one token per row of `logits` (row i belongs to seqs[i]). Asynchronous on CUDA: the
        tokens are copied back as the step ends, and `SampleResult.fetch()` waits for them. `ahead`: the
        sequences' host state lags the step by that many tokens (a step launched before the previous one was
        booked); the sampled token's position, which keys the random draw, counts them."""
        n = len(seqs)
        if logits.shape[0] != n:
            raise RuntimeError(f"internal: {logits.shape[0]} logit rows for {n} sequences")
        fparams = np.empty((n, op.NUM_F), np.float32)
        iparams = np.empty((n, op.NUM_I), np.int32)
        greedy_only = True
        constrained = []
        for i, seq in enumerate(seqs):
            packed = seq.packed_params
            if packed is None:  # a sequence's parameters are packed once; position and slot change per step
                p = seq.params
                row = op.RowParams(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
                                   p.presence_penalty, p.frequency_penalty, seq.seed, 0, -1)
                f, ip = op.pack_sampling_params([row])
                packed = seq.packed_params = (f[0], ip[0], uses_penalties(p), p.temperature == 0.0)
            fparams[i], iparams[i] = packed[0], packed[1]
            iparams[i, op.I_STEP] = len(seq.token_ids) + ahead
            live = seq.slot >= 0  # a row whose sequence ended while it was in flight is sampled plain (and dropped)
            if packed[2] and live:
                iparams[i, op.I_PENALTY_SLOT] = seq.slot
                self._prepare_penalties(seq)
            if seq.params.logit_bias and live:
                iparams[i, op.I_BIAS_ROW] = seq.slot
                self._prepare_bias(seq)
            if seq.constraint is not None and live:
                iparams[i, op.I_MASK_ROW] = len(constrained)
                constrained.append(seq)
            greedy_only = greedy_only and packed[3] and not packed[2] and iparams[i, op.I_BIAS_ROW] < 0
        top_n = max((s.params.logprobs or 0 for s in seqs if s.params.logprobs is not None), default=-1)
        kw = {}
        if top_n >= 0:
            kw["logprobs_out"] = self.logprob[:n]
            if top_n > 0:
                kw["top_ids_out"] = self.top_ids[:n]  # every row gets MAX_TOP_LOGPROBS; each keeps its own N
                kw["top_logprobs_out"] = self.top_logprobs[:n]
        if self._host_tokens is not None and self._copied_pending:  # the last read-back of the tokens is done
            self._copied.wait_on(get_device().stream_handle)
        if constrained:
            kw["token_mask"] = self._upload_masks(constrained)
        if self.logit_bias is not None:
            kw["logit_bias"] = self.logit_bias
        if greedy_only and top_n < 0 and not constrained:
            argmax(logits, out=self.tokens[:n])  # the same tokens as the sampler's greedy rows, sooner
        else:
            self.fparams[:n].copy_(fparams)
            self.iparams[:n].copy_(iparams)
            op.sample(logits, self.fparams[:n], self.iparams[:n], out=self.tokens[:n], penalty_counts=self.counts,
                      penalty_seen=self.seen, **kw)
        if self._host_tokens is None:  # the CPU backend has already computed them
            return SampleResult(self, n, top_n, (self.tokens[:n].numpy().copy(), None))
        pinned, event = self._host_tokens[self._next_host]
        self._next_host ^= 1
        device = get_device()
        copy = device.copy_stream_handle
        self._sampled.record(device.stream_handle)
        self._sampled.wait_on(copy)
        host = (pinned.copy_from_async(self.tokens[:n], copy), event)
        event.record(copy)
        self._copied.record(copy)
        self._copied_pending = True
        return SampleResult(self, n, top_n, host)

    def _upload_masks(self, seqs) -> Tensor:
        """Fill the next token's mask of each constrained sequence (row j for seqs[j]) and queue its upload;
        returns the device rows."""
        k = len(seqs)
        t0 = time.perf_counter()
        constraints = [seq.constraint for seq in seqs]
        if self._host_masks is None:
            fill_masks(constraints, self.token_mask.numpy())
        else:
            pinned, event = self._host_masks[self._next_mask]
            if self._mask_pending[self._next_mask]:
                event.synchronize()
            fill_masks(constraints, pinned.array)
            stream = get_device().stream_handle
            pinned.copy_to_async(self.token_mask, k * self.mask_words * 4, stream)
            event.record(stream)
            self._mask_pending[self._next_mask] = True
            self._next_mask ^= 1
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += k
        return self.token_mask[:k]

    def _prepare_bias(self, seq) -> None:
        """Make the slot's row of the bias table hold `seq`'s logit_bias."""
        if self.logit_bias is None:
            self.logit_bias = Tensor.zeros((self.tokens.shape[0], self.vocab_size), float32, self.device)
        if self._bias_owner[seq.slot] == seq.seq_id:
            return
        row = np.zeros(self.vocab_size, np.float32)
        for t, b in seq.params.logit_bias.items():
            row[t] = b
        self.logit_bias[seq.slot].copy_(row)
        self._bias_owner[seq.slot] = seq.seq_id

    def _prepare_penalties(self, seq) -> None:
        """Make the slot's penalty row describe `seq`: its prompt (and any output so far, after a preemption)."""
        if self._penalty_owner[seq.slot] == seq.seq_id:
            return  # the row is still this sequence's (nothing else used the slot since it last sampled)
        op.penalty_reset(self.counts, self.seen, seq.slot, seq.token_ids)
        outputs = seq.output_ids
        if outputs:
            counts = np.bincount(np.asarray(outputs, np.int64), minlength=self.vocab_size).astype(np.int32)
            self.counts[seq.slot].copy_(counts)
        self._penalty_owner[seq.slot] = seq.seq_id


class SampleResult:
    """The tokens (and logprobs) of one launched step, read once."""

    def __init__(self, sampler: Sampler, n: int, top_n: int, host=None):
        self.sampler, self.n, self.top_n, self.host = sampler, n, top_n, host

    def fetch(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(tokens int32 [n], logprob [n] | None, top ids [n, N] | None, top logprobs [n, N] | None); waits."""
        s, n = self.sampler, self.n
        if self.host is not None:
            view, event = self.host
            if event is not None:
                event.synchronize()
            tokens = view.copy()
        else:
            tokens = s.tokens[:n].numpy().copy()
        if self.top_n < 0:
            return tokens, None, None, None
        logprob = s.logprob[:n].numpy().copy()
        if self.top_n == 0:
            return tokens, logprob, None, None
        return tokens, logprob, s.top_ids[:n].numpy().copy(), s.top_logprobs[:n].numpy().copy()

