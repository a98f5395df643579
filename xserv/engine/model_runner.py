"""Runs the model on the scheduled sequences and returns logits: batch metadata, the activation workspace, and on
CUDA steps replayed from CUDA graphs: decode steps from graphs captured per (batch-size, context-length) bucket, and
a step that is one short prefill chunk and nothing else from graphs captured per token-count bucket.

A decode step's metadata is built with NumPy from per-sequence arrays (no per-token Python work): block tables
live in a host mirror indexed by the sequence's slot, updated only when a sequence gains a block."""
from __future__ import annotations

import math

import numpy as np

from ..tensor import Tensor, int32
from .batch import Batch, SeqChunk, batch_from_arrays, build_host_arrays
from .config import EngineConfig

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Decode graphs are also bucketed by context length: the split-KV attention sizes its grid from the host-side
# max_kv_len, so a graph captured for max_model_len (40,960 for Qwen3) runs ~160 mostly idle splits per kv head
# and a combine over all of them on every step of a short chat.
GRAPH_KV_BUCKET_START, GRAPH_KV_BUCKET_GROWTH = 2048, 4
# Graphs of up to FINE_KV_MAX_BATCH sequences are also captured for contexts of FINE_KV_BUCKETS keys (those below
# the first bucket above). At those batch sizes the plan splits each sequence's keys several ways, and a grid sized
# for 2,048 keys is the wrong one for a short chat: at batch 1 it launches 32 splits of 64 keys per kv head where a
# 512-key context fills 8, and the 24 empty CTAs per kv head hold their SM slots until the qkv GEMV ends (the o
# projection's CTAs cannot start and prefetch beside the attention). Profiled on an H100 at batch 1, context 512:
# ~3 us a layer of the 8B-FP8 step, ~2 us of the 30B-A3B's (docs/engine.md, "Context buckets"). Larger batches
# split each sequence once or twice and gain nothing from these graphs.
FINE_KV_BUCKETS = (512, 1024)
FINE_KV_MAX_BATCH = 16
# A decode graph's metadata lives in one int32 device buffer per context bucket, uploaded with one copy per step
# (five small copies and their gaps took ~10 us of GPU time per step): these rows of max_bs entries, then the block
# table [max_bs, bucket width]. token_index: where a step launched ahead takes each row's input token from in
# ModelRunner.feed_src (-1: input_ids), read by the graph's first kernel (ops.embedding's token feedback).
# state_slots: each row's per-sequence state row (models with recurrent layers; padding rows: the scratch slot).
_GRAPH_INPUTS = ("input_ids", "positions", "kv_lens", "slot_mapping", "token_index", "state_slots")
_PAD = {"input_ids": 0, "positions": 0, "kv_lens": 1, "slot_mapping": -1, "token_index": -1}  # rows n..bucket
# Prefill graphs: one sequence's chunk of up to EngineConfig.prefill_graph_tokens tokens, padded to the next bucket
# of a doubling ladder from PREFILL_GRAPH_START. Eager, such a step pays ~25 us of host time per launch x ~400
# launches whatever its length; in a graph it costs its GPU time, at most 2x its own for the padding. Why the
# default largest bucket and the ladder: docs/engine.md ("Prefill graphs").
PREFILL_GRAPH_START = 16
# The prefill graphs' metadata lives in one int32 device buffer, uploaded with one copy per step:
# [cu_seqlens_q (2), kv_lens (1), logits row (1), state slot (1), input_ids (T), positions (T), slot_mapping (T),
#  block table]
_PF_CU, _PF_KV, _PF_LOGIT, _PF_STATE, _PF_IDS = 0, 2, 3, 4, 5


def logits_width(model) -> int:
    """The width of the model's logits: its vocabulary, or the tokenizer's part of it (a model's limit_logits)."""
    return getattr(model, "logits_width", model.config.vocab_size)


def prefill_token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets of the prefill graphs: 16, 32, 64, ... below max_tokens, then max_tokens ([] for 0)."""
    if max_tokens < 1:
        return []
    buckets, n = [], PREFILL_GRAPH_START
    while n < max_tokens:
        buckets.append(n)
        n *= 2
    return buckets + [max_tokens]


def kv_len_buckets(max_model_len: int, batch_size: int | None = None) -> list[int]:
    """The context lengths decode graphs are captured for: GRAPH_KV_BUCKET_START growing by
    GRAPH_KV_BUCKET_GROWTH up to max_model_len, and for a batch_size of at most FINE_KV_MAX_BATCH the
    FINE_KV_BUCKETS below the first of those."""
    buckets, length = [], GRAPH_KV_BUCKET_START
    while length < max_model_len:
        buckets.append(length)
        length *= GRAPH_KV_BUCKET_GROWTH
    buckets.append(max_model_len)
    if batch_size is not None and batch_size <= FINE_KV_MAX_BATCH:
        buckets = [b for b in FINE_KV_BUCKETS if b < buckets[0]] + buckets
    return buckets


class ModelRunner:
    def __init__(self, model, kv_cache, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 workspace=None, logits_chunk: int = 512):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = kv_cache.block_size
        # the per-sequence state of a model with recurrent layers (engine/state_cache.py): a sequence's row is its
        # scheduler slot; padding rows and one-off forwards use the scratch row
        self.state = getattr(kv_cache, "state", None)
        self.logits_chunk = logits_chunk
        self.workspace = workspace or model.make_workspace(max(max_num_batched_tokens, max_num_seqs), max_num_seqs)
        self.graphs: dict[tuple[int, int], object] = {}  # (batch-size bucket, max_kv_len bucket) -> graph
        self.prefill_graphs: dict[int, object] = {}  # token-count bucket -> graph (one sequence, no decode rows)
        self._graph_keepalive: list = []
        self.last_run_replayed = False  # the last step replayed a decode graph (LLMEngine launches ahead after one)
        self.last_run_prefill_graph = False  # the last step replayed a prefill graph
        # host mirror of every running sequence's block table, by slot (see Scheduler); rows rewritten on change
        self._max_blocks = math.ceil(max_model_len / self.block_size)
        self._tables = np.zeros((max_num_seqs, self._max_blocks), np.int32)
        self._table_len = np.zeros(max_num_seqs, np.int64)
        self._table_of: list = [None] * max_num_seqs  # the block-table list each mirror row was copied from
        # The device buffer of sampled tokens a decode step launched ahead takes its inputs from (LLMEngine sets
        # the sampler's); the decode graphs captured while it is set read it, and only they can run such a step.
        self.feed_src: Tensor | None = None
        self._graphs_feed = False  # the decode graphs were captured with feed_src set
        # Tensor parallelism (xserv/parallel/group.py). On rank 0, `group`: every forward, graph capture and graph
        # replay first sends its inputs (NumPy arrays, through shared memory) to the other ranks, whose runners
        # repeat it (`follow`), so all ranks join the model's collectives in the same order. On the other ranks,
        # `token_offset`: the first token id of the rank's vocab-parallel embedding rows; `follow` shifts the ids it
        # receives by it, so the embedding op gives zero rows for ids of other ranks (its out-of-range rule).
        self.group = None
        self.token_offset = 0

    # ---- forward ------------------------------------------------------------------------------------------------
    def run(self, scheduled, *, ahead: int = 0, token_index: np.ndarray | None = None) -> Tensor:
        """Forward over `scheduled` [(sequence, tokens to compute)]; float32 logits [rows, vocab], one row per
        sequence whose chunk reaches its last token (in order). `ahead`/`token_index`: a decode step launched
        before the previous step's tokens reached the host (see LLMEngine): every row is one ahead of its
        sequence's host state, and row i's input token is feed_src[token_index[i]], read on the device by the
        graph's first kernel. Such steps must be graph-eligible (`can_replay`)."""
        seqs = [s for s, _ in scheduled]
        self.last_run_prefill_graph = False
        if self.can_replay(scheduled, ahead):
            self.last_run_replayed = True
            return self._replay(seqs, ahead, token_index)
        if ahead:
            raise RuntimeError("internal: a step launched ahead must replay a decode graph")
        self.last_run_replayed = False
        if self.can_replay_prefill(scheduled):
            self.last_run_prefill_graph = True
            return self._replay_prefill(*scheduled[0])
        chunks = []
        for seq, n in scheduled:
            start = seq.num_computed
            last = start + n == seq.num_tokens
            chunks.append(SeqChunk(seq.token_ids[start:start + n], start, seq.block_table, "last" if last else "none",
                                   self._state_slot(seq.slot)))
        return self.forward(chunks)

    def _state_slot(self, slot: int) -> int:
        """The state row of a sequence in scheduler slot `slot` (-1: the model keeps no per-sequence state)."""
        return -1 if self.state is None else slot

    def can_replay(self, scheduled, ahead: int = 0) -> bool:
        """A pure decode step that a captured graph covers (batch size and context length): every row computes its
        sequence's last token (position len(token_ids) - 1, or the next one when launched ahead: then the host
        state lags the step in flight, a decode step or a prefill chunk that ends the prompt)."""
        if not self.graphs or len(scheduled) > self._max_graph_bs:
            return False
        if ahead:
            if not self._graphs_feed or any(n != 1 for _, n in scheduled):  # (graphs without the feedback)
                return False
        elif any(n != 1 or s.num_computed + 1 != len(s.token_ids) for s, n in scheduled):
            return False  # (a one-token chunk in the middle of a prompt runs eagerly)
        return max(len(s.token_ids) for s, _ in scheduled) - 1 + ahead < self.max_model_len

    def can_replay_prefill(self, scheduled) -> bool:
        """One sequence's chunk and nothing else (no decode rows), no longer than the largest prefill graph."""
        return bool(self.prefill_graphs) and len(scheduled) == 1 and 1 <= scheduled[0][1] <= self._max_prefill_tokens

    def forward(self, chunks: list[SeqChunk]) -> Tensor:
        return self.forward_arrays(build_host_arrays(chunks, self.block_size))

    def forward_arrays(self, h: dict, own_workspace: bool = True) -> Tensor:
        """An eager forward of build_host_arrays' result (with the runner's workspace, or one sized for it)."""
        if self.group is not None:
            self.group.send("forward", {k: v for k, v in h.items() if not isinstance(v, np.ndarray)},
                            {k: v for k, v in h.items() if isinstance(v, np.ndarray)}, own_workspace=own_workspace)
        batch = batch_from_arrays(h, self.device)
        return self.model.forward(batch, self.kv_cache, self.workspace if own_workspace else None)

    def logits(self, token_ids: list[int], block_table: list[int], chunk: int | None = None) -> np.ndarray:
        """Logits at every position of one sequence, prefilled `chunk` tokens at a time through the paged cache
        into the blocks of `block_table` (lent by the caller)."""
        chunk = chunk or self.logits_chunk
        out = np.empty((len(token_ids), logits_width(self.model)), np.float32)
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start:start + chunk]
            scratch = -1 if self.state is None else self.state.scratch_slot
            h = build_host_arrays([SeqChunk(piece, start, block_table, "all", scratch)], self.block_size)
            out[start:start + len(piece)] = self.forward_arrays(h, own_workspace=False).numpy()
        return out

    def close(self) -> None:
        """Destroy every CUDA graph and let go of the buffers captured in them."""
        for graph in [*self.graphs.values(), *self.prefill_graphs.values()]:
            close = getattr(graph, "close", None)
            if close is not None:
                close()
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._graph_keepalive.clear()

    # ---- CUDA graphs for decode ---------------------------------------------------------------------------------
    def _capture_cuda_graph(self, step):
        from ..runtime import get_runtime, synchronize
        from ..runtime.graphs import CUDAGraph

        graph = CUDAGraph()
        # buffers allocated while capturing are baked into the graph: keep them alive as long as the graphs
        with get_runtime().allocator.keep_alive(self._graph_keepalive), graph.capture():
            step()
        synchronize()
        return graph

    def capture_decode_graphs(self, max_batch_size: int | None = None, graph_factory=None) -> list[int]:
        """Capture one decode step per (batch-size, context-length) bucket up to `max_batch_size` (default
        max_num_seqs). A decode step then runs as: metadata copied into static buffers (padded to the bucket), one
        graph launch. `graph_factory(step) -> object with replay()` replaces CUDA graph capture (tests run the
        logic on the CPU)."""
        if graph_factory is None:
            if self.device != "cuda":
                return []
            graph_factory = self._capture_cuda_graph
        if self.group is not None:  # the other ranks capture the same graphs, their warm-up steps in lockstep
            self.group.send("capture_decode", {"max_batch_size": max_batch_size, "eager": self.device == "cpu",
                                               "feed": 0 if self.feed_src is None else self.feed_src.shape[0]})
        # Tensor parallelism with the token feedback: each graph starts by broadcasting rank 0's sampled tokens
        # (its feed_src, the sampler's) into the other ranks' feed_src (shifted to their embedding rows), so a
        # step launched ahead reads the same tokens on every rank.
        comm = getattr(self.model, "comm", None)
        broadcast = comm if self.feed_src is not None and comm is not None else None
        max_bs = min(max_batch_size or self.max_num_seqs, self.max_num_seqs)
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_bs] + [max_bs]
        # each batch-size bucket's context buckets, and all of them (one metadata buffer each)
        self._bs_kv_buckets = {bs: kv_len_buckets(self.max_model_len, bs) for bs in sizes}
        self._kv_buckets = sorted({b for buckets in self._bs_kv_buckets.values() for b in buckets})
        self._graphs_feed = self.feed_src is not None
        d = self.device
        self._meta_rows = max_bs
        cu_seqlens = Tensor.from_numpy(np.arange(max_bs + 1, dtype=np.int32), d)
        # one metadata buffer per context bucket, its block table as wide as that bucket needs (a step uploads the
        # rows, then only the table rows of its batch-size bucket), and its host image
        self._meta, self._meta_host = {}, {}
        for L in self._kv_buckets:
            size = len(_GRAPH_INPUTS) * max_bs + max_bs * math.ceil(L / self.block_size)
            self._meta[L] = Tensor.zeros((size,), int32, d)
            self._meta_host[L] = np.zeros(size, np.int32)
        # Largest first, so that buffers sized by the first capture (the attention workspace) fit every later one.
        for bs in sorted(sizes, reverse=True):
            for max_kv_len in reversed(self._bs_kv_buckets[bs]):
                g = self._meta_fields(self._meta[max_kv_len], max_kv_len)
                batch = Batch(
                    input_ids=g["input_ids"][:bs], positions=g["positions"][:bs], cu_seqlens_q=cu_seqlens[:bs + 1],
                    kv_lens=g["kv_lens"][:bs], block_tables=g["block_tables"][:bs],
                    slot_mapping=g["slot_mapping"][:bs], logits_indices=None, num_tokens=bs, num_seqs=bs,
                    max_q_len=1, max_kv_len=max_kv_len,
                    feed=None if self.feed_src is None else (self.feed_src, g["token_index"][:bs]),
                    state_slots=None if self.state is None else g["state_slots"][:bs])

                def step(batch=batch):
                    if broadcast is not None:
                        broadcast.broadcast_tokens(self.feed_src, self.token_offset)
                    self.model.forward(batch, self.kv_cache, self.workspace)

                self._pad_inputs(0, bs, max_kv_len)
                step()  # warm-up outside capture: compiles kernels, lets cuBLAS pick its algorithms
                if d == "cuda":
                    from ..runtime import synchronize

                    synchronize()
                self.graphs[(bs, max_kv_len)] = graph_factory(step)
        batch_sizes = sorted({bs for bs, _ in self.graphs})
        self._max_graph_bs = batch_sizes[-1]
        self._bucket_of = np.array([min(b for b in batch_sizes if b >= n) for n in range(self._max_graph_bs + 1)])
        return batch_sizes

    def _meta_fields(self, meta, max_kv_len: int) -> dict:
        """Views of a bucket's metadata buffer (device Tensor or its host image): each _GRAPH_INPUTS row, and
        "block_tables" [max_bs, width]."""
        rows, width = self._meta_rows, math.ceil(max_kv_len / self.block_size)
        fields = {name: meta[i * rows:(i + 1) * rows] for i, name in enumerate(_GRAPH_INPUTS)}
        table = meta[len(_GRAPH_INPUTS) * rows:len(_GRAPH_INPUTS) * rows + rows * width]
        fields["block_tables"] = table.reshape(rows, width) if isinstance(table, np.ndarray) else table.view(rows, width)
        return fields

    def _meta_size(self, bs: int, max_kv_len: int) -> int:
        return len(_GRAPH_INPUTS) * self._meta_rows + bs * math.ceil(max_kv_len / self.block_size)

    def _upload_meta(self, bs: int, max_kv_len: int) -> dict:
        """One copy: every row of the host image, then the block table's first bs rows. Returns the device views."""
        size = self._meta_size(bs, max_kv_len)
        meta = self._meta[max_kv_len]
        meta[:size].copy_(self._meta_host[max_kv_len][:size])
        return self._meta_fields(meta, max_kv_len)

    def _pad_inputs(self, n: int, bs: int, max_kv_len: int) -> None:
        """Rows n..bs of the host image: slot -1 writes nothing, kv_len 1 reads block 0 (table rows zeroed)."""
        host = self._meta_fields(self._meta_host[max_kv_len], max_kv_len)
        for name, value in _PAD.items():
            host[name][n:bs] = value
        host["state_slots"][n:bs] = 0 if self.state is None else self.state.scratch_slot
        host["block_tables"][n:bs] = 0
        if n == 0:
            self._upload_meta(bs, max_kv_len)

    def _sync_tables(self, seqs) -> np.ndarray:
        """The slots of `seqs`, with their rows of the host table mirror brought up to date."""
        slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
        for seq, slot in zip(seqs, slots):
            table = seq.block_table
            # a sequence's table only grows while it runs; an admission (also after a preemption) makes a new list
            if self._table_of[slot] is not table or self._table_len[slot] != len(table):
                self._tables[slot, :len(table)] = table
                self._table_len[slot] = len(table)
                self._table_of[slot] = table
        return slots

    def _replay(self, seqs, ahead: int, token_index) -> Tensor:
        n = len(seqs)
        bs = int(self._bucket_of[n])
        slots = self._sync_tables(seqs)
        positions = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n) + (ahead - 1)
        max_kv_len = next(b for b in self._bs_kv_buckets[bs] if b >= int(positions.max()) + 1)
        st = self._meta_fields(self._meta_host[max_kv_len], max_kv_len)
        if token_index is None:
            st["input_ids"][:n] = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, n)
            st["token_index"][:n] = -1
        else:  # the rows' input tokens come from feed_src on the device (input_ids is not read)
            st["token_index"][:n] = token_index
        st["positions"][:n] = positions
        st["kv_lens"][:n] = positions + 1
        st["state_slots"][:n] = slots
        bsz = self.block_size
        st["slot_mapping"][:n] = self._tables[slots, positions // bsz] * bsz + positions % bsz
        st["block_tables"][:n] = self._tables[slots, :st["block_tables"].shape[1]]
        self._pad_inputs(n, bs, max_kv_len)
        if self.group is not None:
            self.group.send("decode", {"bs": bs, "max_kv_len": max_kv_len},
                            {"meta": self._meta_host[max_kv_len][:self._meta_size(bs, max_kv_len)]})
        self._upload_meta(bs, max_kv_len)
        self.graphs[(bs, max_kv_len)].replay()
        return self.workspace.logits[:n]

    # ---- CUDA graphs for short prefills -------------------------------------------------------------------------
    def capture_prefill_graphs(self, max_tokens: int = EngineConfig.prefill_graph_tokens,
                               graph_factory=None) -> list[int]:
        """Capture one forward of a single sequence's chunk per token-count bucket (prefill_token_buckets) up to
        `max_tokens` (capped by the workspace and max_model_len). Everything that varies is device data: tokens,
        positions, slots, the chunk length (cu_seqlens_q [0, n]), the KV length (a prefix may already be cached) and
        the block table; rows n..bucket are padding (token 0 at position 0, slot -1: the KV write skips them, the
        attention's tiles past q_len = n exit, and every other op is row-wise), and the logits come from row n - 1
        through the logits-row gather. `graph_factory` as in capture_decode_graphs."""
        if graph_factory is None:
            if self.device != "cuda":
                return []
            graph_factory = self._capture_cuda_graph
        sizes = prefill_token_buckets(min(max_tokens, self.workspace.max_tokens, self.max_model_len))
        if not sizes:
            return []
        if self.group is not None:
            self.group.send("capture_prefill", {"max_tokens": max_tokens, "eager": self.device == "cpu"})
        tmax = sizes[-1]
        self._pf_pos, self._pf_slot, self._pf_table = _PF_IDS + tmax, _PF_IDS + 2 * tmax, _PF_IDS + 3 * tmax
        width = self._max_blocks
        meta = Tensor.zeros((self._pf_table + width,), int32, self.device)
        self._pf_meta, self._pf_host = meta, np.zeros(meta.shape, np.int32)
        for tokens in sorted(sizes, reverse=True):
            batch = Batch(
                input_ids=meta[_PF_IDS:_PF_IDS + tokens], positions=meta[self._pf_pos:self._pf_pos + tokens],
                cu_seqlens_q=meta[_PF_CU:_PF_CU + 2], kv_lens=meta[_PF_KV:_PF_KV + 1],
                block_tables=meta[self._pf_table:].view(1, width),
                slot_mapping=meta[self._pf_slot:self._pf_slot + tokens], logits_indices=meta[_PF_LOGIT:_PF_LOGIT + 1],
                num_tokens=tokens, num_seqs=1, max_q_len=tokens, max_kv_len=self.max_model_len,
                state_slots=None if self.state is None else meta[_PF_STATE:_PF_STATE + 1])

            def step(batch=batch):
                self.model.forward(batch, self.kv_cache, self.workspace)

            # warm-up inputs: a one-token chunk whose K/V goes nowhere (slot -1) and which reads block 0
            self._stage_prefill(tokens, [0], 0, [0], slots=np.full(1, -1, np.int32),
                                state_slot=0 if self.state is None else self.state.scratch_slot)
            step()  # warm-up outside capture: compiles kernels, lets cuBLAS pick its algorithms
            if self.device == "cuda":
                from ..runtime import synchronize

                synchronize()
            self.prefill_graphs[tokens] = graph_factory(step)
        self._max_prefill_tokens = tmax
        self._prefill_bucket_of = np.array([min(b for b in sizes if b >= n) for n in range(tmax + 1)])
        return sorted(self.prefill_graphs)

    def _stage_prefill(self, tokens: int, token_ids, start: int, block_table, slots=None, state_slot: int = 0) -> None:
        """Upload the metadata of a chunk of len(token_ids) tokens at positions start.. (state row `state_slot`) into
        the bucket-`tokens` layout of the prefill graphs' buffer (one copy)."""
        n = len(token_ids)
        kv_len = start + n
        bsz = self.block_size
        num_blocks = -(-kv_len // bsz)
        h = self._pf_host
        h[_PF_CU], h[_PF_CU + 1], h[_PF_KV], h[_PF_LOGIT], h[_PF_STATE] = 0, n, kv_len, n - 1, state_slot
        ids, pos, slot, table = _PF_IDS, self._pf_pos, self._pf_slot, self._pf_table
        h[ids:ids + n] = token_ids
        h[ids + n:ids + tokens] = 0
        positions = np.arange(start, kv_len, dtype=np.int64)
        h[pos:pos + n] = positions
        h[pos + n:pos + tokens] = 0
        h[table:table + num_blocks] = block_table[:num_blocks]
        if slots is None:
            slots = h[table + positions // bsz] * bsz + positions % bsz
        h[slot:slot + n] = slots
        h[slot + n:slot + tokens] = -1
        end = table + num_blocks
        self._pf_meta[:end].copy_(h[:end])
        return end

    def _replay_prefill(self, seq, n: int) -> Tensor:
        tokens = int(self._prefill_bucket_of[n])
        start = seq.num_computed
        end = self._stage_prefill(tokens, seq.token_ids[start:start + n], start, seq.block_table,
                                  state_slot=max(self._state_slot(seq.slot), 0))
        if self.group is not None:
            self.group.send("prefill", {"tokens": tokens}, {"meta": self._pf_host[:end]})
        self.prefill_graphs[tokens].replay()
        return self.workspace.logits[:1 if start + n == seq.num_tokens else 0]


    # ---- tensor parallelism: the other ranks --------------------------------------------------------------------
    def follow(self, command: str, args: dict, arrays: dict) -> None:
        """Repeat what rank 0's runner did (its `group.send`): the same eager forward, graph capture or graph replay
        on this rank's shard, from the same host arrays (`arrays`, this rank's copies; token ids shifted by
        token_offset first)."""
        if command == "forward":
            h = {**args, **arrays}
            h.pop("own_workspace", None)
            h["input_ids"] = h["input_ids"] - np.int32(self.token_offset)
            self.model.forward(batch_from_arrays(h, self.device), self.kv_cache,
                               self.workspace if args.get("own_workspace", True) else None)
        elif command == "decode":
            bs, max_kv_len = args["bs"], args["max_kv_len"]
            meta = arrays["meta"]
            meta[:self._meta_rows] -= np.int32(self.token_offset)  # row 0 of _GRAPH_INPUTS: input_ids
            self._meta[max_kv_len][:meta.shape[0]].copy_(meta)
            self.graphs[(bs, max_kv_len)].replay()
        elif command == "prefill":
            tokens, meta = args["tokens"], arrays["meta"]
            meta[_PF_IDS:_PF_IDS + tokens] -= np.int32(self.token_offset)
            self._pf_meta[:meta.shape[0]].copy_(meta)
            self.prefill_graphs[tokens].replay()
        elif command == "capture_decode":
            if args.get("feed"):  # rank 0 launches steps ahead: the broadcast tokens land here (capture_decode_graphs)
                self.feed_src = Tensor.zeros((args["feed"],), int32, self.device)
            self.capture_decode_graphs(args["max_batch_size"], graph_factory=_eager_graph if args["eager"] else None)
        elif command == "capture_prefill":
            self.capture_prefill_graphs(args["max_tokens"], graph_factory=_eager_graph if args["eager"] else None)
        else:
            raise ValueError(f"unknown tensor-parallel step command {command!r}")


class _EagerGraph:
    """A 'graph' whose replay runs the captured step eagerly: what the other ranks use while rank 0 runs the CPU
    tests' graph factories (the replay logic tested without CUDA)."""

    def __init__(self, step):
        self.replay = step


def _eager_graph(step) -> _EagerGraph:
    return _EagerGraph(step)
