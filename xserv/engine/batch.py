"""Batch metadata for one forward pass: packed tokens of several sequences, where they sit in the paged KV cache,
and which positions need logits. Prefill, chunked prefill, decode and mixed batches all use this one shape."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tensor import Tensor


@dataclass
class SeqChunk:
    """One sequence's part of a batch: `token_ids` are computed at positions start_pos, start_pos+1, ...;
    the KV of positions < start_pos is already in the cache at the blocks of `block_table`."""

    token_ids: list[int] | np.ndarray
    start_pos: int
    block_table: list[int]
    logits: str = "last"  # "last", "all" or "none"
    state_slot: int = -1  # the sequence's row of the per-sequence state (models with recurrent layers); -1: none


@dataclass
class Batch:
    input_ids: Tensor  # int32 [T] packed tokens
    positions: Tensor  # int32 [T]
    cu_seqlens_q: Tensor  # int32 [B+1]
    kv_lens: Tensor  # int32 [B] context length after this step (cached + new)
    block_tables: Tensor  # int32 [B, max_blocks]
    slot_mapping: Tensor  # int32 [T] block * block_size + offset
    logits_indices: Tensor | None  # int32 [N] rows of the packed tokens that need logits; None = every row
    num_tokens: int
    num_seqs: int
    max_q_len: int
    max_kv_len: int
    logits_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # host copy of logits_indices
    logits_per_seq: list[tuple[int, int]] = field(default_factory=list)  # (first row in logits, count) per sequence
    # The token feedback of decode graphs (ops.embedding's feed): row t's input is feed[0][feed[1][t]] where
    # feed[1][t] >= 0, the previous step's sampled token still on the device; None: input_ids as they are.
    feed: tuple[Tensor, Tensor] | None = None
    # int32 [B]: each sequence's row of the per-sequence state pools (engine/state_cache.py); None when the batch's
    # sequences have none (a model without recurrent layers)
    state_slots: Tensor | None = None


def build_host_arrays(chunks: list[SeqChunk], block_size: int) -> dict:
    """The batch metadata as NumPy int32 arrays plus host ints. (Decode steps replayed from CUDA graphs build
    theirs vectorised in ModelRunner._replay.)"""
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    q_lens = np.array([len(c.token_ids) for c in chunks], np.int64)
    if np.any(q_lens < 1):
        raise ValueError("every sequence in a batch needs at least one new token")
    kv_lens = np.array([c.start_pos + len(c.token_ids) for c in chunks], np.int64)
    need_blocks = -(-kv_lens // block_size)
    width = max(int(need_blocks.max()), max((len(c.block_table) for c in chunks), default=0), 1)
    block_tables = np.zeros((len(chunks), width), np.int32)
    input_ids, positions, slots, rows, per_seq = [], [], [], [], []
    offset = 0
    for i, c in enumerate(chunks):
        if len(c.block_table) < need_blocks[i]:
            raise ValueError(f"sequence {i}: {kv_lens[i]} tokens need {need_blocks[i]} blocks, block table has "
                             f"{len(c.block_table)}")
        table = np.asarray(c.block_table[:width], np.int64)
        block_tables[i, :len(table)] = table
        pos = np.arange(c.start_pos, c.start_pos + len(c.token_ids), dtype=np.int64)
        input_ids.append(np.asarray(c.token_ids, np.int64))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        first = len(rows)
        if c.logits == "all":
            rows.extend(range(offset, offset + len(pos)))
        elif c.logits == "last":
            rows.append(offset + len(pos) - 1)
        elif c.logits != "none":
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {c.logits!r}")
        per_seq.append((first, len(rows) - first))
        offset += len(pos)
    cu = np.zeros(len(chunks) + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    state_slots = np.array([c.state_slot for c in chunks], np.int32)
    if np.any(state_slots >= 0) and not np.all(state_slots >= 0):
        raise ValueError("either every sequence of a batch has a state slot or none has")
    return dict(
        input_ids=np.concatenate(input_ids).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        cu_seqlens_q=cu,
        kv_lens=kv_lens.astype(np.int32),
        block_tables=block_tables,
        slot_mapping=np.concatenate(slots).astype(np.int32),
        logits_rows=np.asarray(rows, np.int32),
        logits_per_seq=per_seq,
        num_tokens=int(offset),
        num_seqs=len(chunks),
        max_q_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
        state_slots=state_slots if len(state_slots) and state_slots[0] >= 0 else None,
    )


def make_batch(chunks: list[SeqChunk], block_size: int, device: str) -> Batch:
    return batch_from_arrays(build_host_arrays(chunks, block_size), device)


def batch_from_arrays(h: dict, device: str) -> Batch:
    """The Batch of build_host_arrays' result, its arrays uploaded to `device` (tensor parallelism: every rank
    builds its step's Batch from the same arrays, rank 0's sent through shared memory)."""

    def up(a):
        return Tensor.from_numpy(a, device)

    rows = h["logits_rows"]
    every_row = len(rows) == h["num_tokens"] and np.array_equal(rows, np.arange(h["num_tokens"]))
    return Batch(
        input_ids=up(h["input_ids"]),
        positions=up(h["positions"]),
        cu_seqlens_q=up(h["cu_seqlens_q"]),
        kv_lens=up(h["kv_lens"]),
        block_tables=up(h["block_tables"]),
        slot_mapping=up(h["slot_mapping"]),
        logits_indices=None if every_row else up(rows),
        num_tokens=h["num_tokens"],
        num_seqs=h["num_seqs"],
        max_q_len=h["max_q_len"],
        max_kv_len=h["max_kv_len"],
        logits_rows=rows,
        logits_per_seq=h["logits_per_seq"],
        state_slots=None if h.get("state_slots") is None else up(h["state_slots"]),
    )
