"""Runs the model on the scheduled sequences and returns logits: batch metadata, the activation workspace, and on
CUDA decode steps replayed from CUDA graphs captured per (batch-size, context-length) bucket.

A decode step's metadata is built with NumPy from per-sequence arrays (no per-token Python work): block tables
live in a host mirror indexed by the sequence's slot, updated only when a sequence gains a block."""
from __future__ import annotations

import math

import numpy as np

from ..ops.gather import gather
from ..tensor import Tensor, int32
from .batch import Batch, SeqChunk, make_batch

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Decode graphs are also bucketed by context length: the split-KV attention sizes its grid from the host-side
# max_kv_len, so a graph captured for max_model_len (40,960 for Qwen3) runs ~160 mostly idle splits per kv head
# and a combine over all of them on every step of a short chat.
GRAPH_KV_BUCKET_START, GRAPH_KV_BUCKET_GROWTH = 2048, 4
_GRAPH_INPUTS = ("input_ids", "positions", "kv_lens", "slot_mapping")


def kv_len_buckets(max_model_len: int) -> list[int]:
    buckets, length = [], GRAPH_KV_BUCKET_START
    while length < max_model_len:
        buckets.append(length)
        length *= GRAPH_KV_BUCKET_GROWTH
    return buckets + [max_model_len]


class ModelRunner:
    def __init__(self, model, kv_cache, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 workspace=None, logits_chunk: int = 512):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = kv_cache.block_size
        self.logits_chunk = logits_chunk
        self.workspace = workspace or model.make_workspace(max(max_num_batched_tokens, max_num_seqs), max_num_seqs)
        self.graphs: dict[tuple[int, int], object] = {}  # (batch-size bucket, max_kv_len bucket) -> graph
        self._graph_keepalive: list = []
        self.last_run_replayed = False
        # host mirror of every running sequence's block table, by slot (see Scheduler); rows rewritten on change
        self._max_blocks = math.ceil(max_model_len / self.block_size)
        self._tables = np.zeros((max_num_seqs, self._max_blocks), np.int32)
        self._table_len = np.zeros(max_num_seqs, np.int64)
        self._table_of: list = [None] * max_num_seqs  # the block-table list each mirror row was copied from

    # ---- forward ------------------------------------------------------------------------------------------------
    def run(self, scheduled, *, ahead: int = 0, token_index: np.ndarray | None = None,
            token_src: Tensor | None = None) -> Tensor:
        """Forward over `scheduled` [(sequence, tokens to compute)]; float32 logits [rows, vocab], one row per
        sequence whose chunk reaches its last token (in order). `ahead`/`token_index`/`token_src`: a decode step
        launched before the previous step's tokens reached the host (see LLMEngine): every row is one ahead of
        its sequence's host state, and row i's input token is token_src[token_index[i]], gathered on the device.
        Such steps must be graph-eligible (`can_replay`)."""
        seqs = [s for s, _ in scheduled]
        if self.can_replay(scheduled, ahead):
            self.last_run_replayed = True
            return self._replay(seqs, ahead, token_index, token_src)
        if ahead:
            raise RuntimeError("internal: a step launched ahead must replay a decode graph")
        self.last_run_replayed = False
        chunks = []
        for seq, n in scheduled:
            start = seq.num_computed
            last = start + n == seq.num_tokens
            chunks.append(SeqChunk(seq.token_ids[start:start + n], start, seq.block_table, "last" if last else "none"))
        return self.forward(chunks)

    def can_replay(self, scheduled, ahead: int = 0) -> bool:
        """A pure decode step that a captured graph covers (batch size and context length)."""
        return bool(self.graphs) and len(scheduled) <= self._max_graph_bs and all(n == 1 for _, n in scheduled) \
            and max(s.num_computed for s, _ in scheduled) + ahead < self.max_model_len

    def forward(self, chunks: list[SeqChunk]) -> Tensor:
        batch = make_batch(chunks, self.block_size, self.device)
        return self.model.forward(batch, self.kv_cache, self.workspace)

    def logits(self, token_ids: list[int], block_table: list[int], chunk: int | None = None) -> np.ndarray:
        """Logits at every position of one sequence, prefilled `chunk` tokens at a time through the paged cache
        into the blocks of `block_table` (lent by the caller)."""
        chunk = chunk or self.logits_chunk
        out = np.empty((len(token_ids), self.model.config.vocab_size), np.float32)
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start:start + chunk]
            batch = make_batch([SeqChunk(piece, start, block_table, "all")], self.block_size, self.device)
            out[start:start + len(piece)] = self.model.forward(batch, self.kv_cache).numpy()
        return out

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
        max_bs = min(max_batch_size or self.max_num_seqs, self.max_num_seqs)
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_bs] + [max_bs]
        self._kv_buckets = kv_len_buckets(self.max_model_len)
        d = self.device
        self._inputs = {name: Tensor.zeros((max_bs,), int32, d) for name in _GRAPH_INPUTS}
        cu_seqlens = Tensor.from_numpy(np.arange(max_bs + 1, dtype=np.int32), d)
        # one block-table buffer per context bucket, as wide as that bucket needs: a step uploads only that width
        self._bucket_tables = {L: Tensor.zeros((max_bs, math.ceil(L / self.block_size)), int32, d)
                               for L in self._kv_buckets}
        self._staging = {name: np.zeros(max_bs, np.int32) for name in _GRAPH_INPUTS}
        self._token_index = Tensor.zeros((max_bs,), int32, d)
        # Largest first, so that buffers sized by the first capture (the attention workspace) fit every later one.
        for bs in sorted(sizes, reverse=True):
            for max_kv_len in reversed(self._kv_buckets):
                g = self._inputs
                batch = Batch(
                    input_ids=g["input_ids"][:bs], positions=g["positions"][:bs], cu_seqlens_q=cu_seqlens[:bs + 1],
                    kv_lens=g["kv_lens"][:bs], block_tables=self._bucket_tables[max_kv_len][:bs],
                    slot_mapping=g["slot_mapping"][:bs], logits_indices=None, num_tokens=bs, num_seqs=bs,
                    max_q_len=1, max_kv_len=max_kv_len)

                def step(batch=batch):
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

    def _pad_inputs(self, n: int, bs: int, max_kv_len: int) -> None:
        """Rows n..bs of the static buffers: slot -1 writes nothing, kv_len 1 reads block 0."""
        for name, value in (("input_ids", 0), ("positions", 0), ("kv_lens", 1), ("slot_mapping", -1)):
            self._staging[name][n:bs] = value
        if n == 0:
            for name in _GRAPH_INPUTS:
                self._inputs[name][:bs].copy_(self._staging[name][:bs])
            self._bucket_tables[max_kv_len][:bs].zero_()

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

    def _replay(self, seqs, ahead: int, token_index, token_src) -> Tensor:
        n = len(seqs)
        bs = int(self._bucket_of[n])
        slots = self._sync_tables(seqs)
        positions = np.fromiter((s.num_computed for s in seqs), np.int64, n) + ahead
        max_kv_len = next(b for b in self._kv_buckets if b >= int(positions.max()) + 1)
        width = self._bucket_tables[max_kv_len].shape[1]
        st = self._staging
        if token_index is None:
            st["input_ids"][:n] = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, n)
        st["positions"][:n] = positions
        st["kv_lens"][:n] = positions + 1
        bsz = self.block_size
        st["slot_mapping"][:n] = self._tables[slots, positions // bsz] * bsz + positions % bsz
        self._pad_inputs(n, bs, max_kv_len)
        for name in _GRAPH_INPUTS:
            if name == "input_ids" and token_index is not None:
                continue  # gathered below; padding rows keep whatever valid ids they hold
            self._inputs[name][:bs].copy_(st[name][:bs])
        if token_index is not None:
            self._token_index[:n].copy_(np.asarray(token_index, np.int32))
            gather(token_src, self._token_index[:n], self._inputs["input_ids"][:n])
        tables = np.zeros((bs, width), np.int32)
        tables[:n] = self._tables[slots, :width]
        self._bucket_tables[max_kv_len][:bs].copy_(tables)
        self.graphs[(bs, max_kv_len)].replay()
        return self.workspace.logits[:n]
