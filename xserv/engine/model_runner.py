"""Runs the model on batches: builds the batch metadata, owns the activation workspace, samples greedy rows
on the device, and on CUDA replays decode steps from CUDA graphs captured per (batch-size, context-length) bucket."""
from __future__ import annotations

import math

import numpy as np

from ..tensor import Tensor, int32
from .batch import Batch, SeqChunk, make_batch

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Decode graphs are also bucketed by context length: the split-KV attention sizes its grid from the host-side
# max_kv_len, so a graph captured for max_model_len (40,960 for Qwen3) runs ~160 mostly idle splits per kv head
# and a combine over all of them on every step of a short chat.
GRAPH_KV_BUCKET_START, GRAPH_KV_BUCKET_GROWTH = 2048, 4


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
        self.argmax_out = Tensor.empty((max_num_seqs,), int32, self.device)
        self.graphs: dict[tuple[int, int], object] = {}  # (batch-size bucket, max_kv_len bucket) -> graph
        self._graph_inputs = None
        self._graph_keepalive: list = []

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, chunks: list[SeqChunk]) -> tuple[Tensor, Batch]:
        if self.graphs and self._graph_eligible(chunks):
            return self._replay(chunks)
        batch = make_batch(chunks, self.block_size, self.device)
        return self.model.forward(batch, self.kv_cache, self.workspace), batch

    def run_and_sample(self, chunks, greedy: list[bool], sample_host, seqs) -> list[int]:
        """Forward, then one token per sequence in `seqs` (those whose chunk asked for logits, in order)."""
        logits, _batch = self.forward(chunks)
        n = len(seqs)
        if n == 0:
            return []
        if logits.shape[0] != n:
            raise RuntimeError(f"internal: {logits.shape[0]} logit rows for {n} sequences")
        if all(greedy):
            from ..ops.argmax import argmax

            return [int(t) for t in argmax(logits, out=self.argmax_out[:n]).numpy()]
        host = logits.numpy()
        return [int(np.argmax(host[i])) if g else sample_host(seq, host[i]) for i, (g, seq) in enumerate(zip(greedy, seqs))]

    def logits(self, token_ids: list[int], chunk: int | None = None) -> np.ndarray:
        """Logits at every position of one sequence, prefilled `chunk` tokens at a time through the paged cache
        (blocks borrowed for the call and given back)."""
        chunk = chunk or self.logits_chunk
        alloc = self.kv_cache.allocator
        need = self.kv_cache.blocks_for(len(token_ids))
        if not alloc.can_allocate(need):
            raise RuntimeError(f"KV cache busy: {need} blocks needed, {alloc.num_free} free")
        table = alloc.allocate(need)
        try:
            out = np.empty((len(token_ids), self.model.config.vocab_size), np.float32)
            for start in range(0, len(token_ids), chunk):
                piece = token_ids[start:start + chunk]
                batch = make_batch([SeqChunk(piece, start, table, "all")], self.block_size, self.device)
                out[start:start + len(piece)] = self.model.forward(batch, self.kv_cache).numpy()
            return out
        finally:
            alloc.free(table)

    # ---- CUDA graphs for decode ---------------------------------------------------------------------------
    def _graph_eligible(self, chunks) -> bool:
        return len(chunks) <= self._max_graph_bs and all(
            len(c.token_ids) == 1 and c.logits == "last" and len(c.block_table) <= self._graph_max_blocks
            for c in chunks)

    def _bucket(self, n: int) -> int:
        return self._bucket_of[n]

    def _kv_bucket(self, kv_len: int) -> int:
        return next(b for b in self._kv_buckets if b >= kv_len)

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
        """Capture one decode step per batch-size bucket up to `max_batch_size` (default max_num_seqs). Decode
        batches then run as: metadata copied into static buffers (padded to the bucket), one graph launch.
        `graph_factory(step) -> object with replay()` replaces CUDA graph capture (tests run the logic on CPU)."""
        if graph_factory is None:
            if self.device != "cuda":
                return []
            graph_factory = self._capture_cuda_graph
        max_bs = min(max_batch_size or self.max_num_seqs, self.max_num_seqs)
        sizes = [b for b in GRAPH_BATCH_SIZES if b < max_bs] + [max_bs]
        self._kv_buckets = kv_len_buckets(self.max_model_len)
        max_blocks = math.ceil(self.max_model_len / self.block_size)
        d = self.device
        g = {
            "input_ids": Tensor.zeros((max_bs,), int32, d),
            "positions": Tensor.zeros((max_bs,), int32, d),
            "cu_seqlens_q": Tensor.from_numpy(np.arange(max_bs + 1, dtype=np.int32), d),
            "kv_lens": Tensor.from_numpy(np.ones(max_bs, np.int32), d),
            "block_tables": Tensor.zeros((max_bs, max_blocks), int32, d),
            "slot_mapping": Tensor.full((max_bs,), -1, int32, d),
        }
        self._graph_inputs = g
        self._graph_max_blocks = max_blocks
        self._graph_batches = {}
        self._graph_views = {}
        self._staging = {name: np.zeros(t.shape, np.int32) for name, t in g.items() if name != "cu_seqlens_q"}
        # Largest first, so that buffers sized by the first capture (the attention workspace) fit every later one.
        for bs in sorted(sizes, reverse=True):
            self._graph_views[bs] = None
            for max_kv_len in reversed(self._kv_buckets):
                batch = Batch(
                    input_ids=g["input_ids"][:bs], positions=g["positions"][:bs],
                    cu_seqlens_q=g["cu_seqlens_q"][:bs + 1], kv_lens=g["kv_lens"][:bs],
                    block_tables=g["block_tables"][:bs], slot_mapping=g["slot_mapping"][:bs], logits_indices=None,
                    num_tokens=bs, num_seqs=bs, max_q_len=1, max_kv_len=max_kv_len,
                    logits_rows=np.arange(bs, dtype=np.int32), logits_per_seq=[(i, 1) for i in range(bs)])

                def step(batch=batch):
                    self.model.forward(batch, self.kv_cache, self.workspace)

                step()  # warm-up outside capture: compiles kernels, lets cuBLAS pick its algorithms
                if d == "cuda":
                    from ..runtime import synchronize

                    synchronize()
                self.graphs[(bs, max_kv_len)] = graph_factory(step)
                self._graph_batches[(bs, max_kv_len)] = batch
                self._graph_views[bs] = {name: getattr(batch, name) for name in self._staging}
        batch_sizes = sorted({bs for bs, _ in self.graphs})
        self._max_graph_bs = batch_sizes[-1]
        self._bucket_of = [min(b for b in batch_sizes if b >= n) for n in range(self._max_graph_bs + 1)]
        return batch_sizes

    def _replay(self, chunks) -> tuple[Tensor, Batch]:
        """A decode step from its graph: the batch metadata written into host staging arrays (rows past the
        batch padded: slot -1 writes nothing, kv_len 1 reads block 0), uploaded into the static buffers."""
        n = len(chunks)
        bs = self._bucket(n)
        st = self._staging
        bsz = self.block_size
        for i, c in enumerate(chunks):
            pos = c.start_pos
            table = c.block_table
            st["input_ids"][i] = c.token_ids[0]
            st["positions"][i] = pos
            st["kv_lens"][i] = pos + 1
            st["slot_mapping"][i] = table[pos // bsz] * bsz + pos % bsz
            st["block_tables"][i, :len(table)] = table
        if bs > n:
            st["input_ids"][n:bs] = 0
            st["positions"][n:bs] = 0
            st["kv_lens"][n:bs] = 1
            st["slot_mapping"][n:bs] = -1
            st["block_tables"][n:bs] = 0
        for name, view in self._graph_views[bs].items():
            view.copy_(st[name][:bs])
        key = (bs, self._kv_bucket(max(c.start_pos + 1 for c in chunks)))
        self.graphs[key].replay()
        return self.workspace.logits[:n], self._graph_batches[key]
