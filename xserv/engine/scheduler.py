"""Which sequences run in the next forward, and with how many tokens. The scheduler is the only owner of KV blocks.

Policy, per step, under a budget of `max_num_batched_tokens` tokens:
1. Every running sequence that has a new token to decode gets one row (decodes never wait for prefills). A
   sequence that needs a new block when none is free preempts the newest running sequence (its blocks are
   freed, it goes back to the front of the queue and is recomputed later; shared prefix blocks stay with their
   other holders).
2. Sequences part-way through their prompt get their next chunk, then waiting requests are admitted in order
   while the budget lasts and fewer than `max_num_seqs` run: the prefix cache supplies the full blocks it holds
   of the prompt; the rest is computed in chunks. A new request is admitted only while a block of headroom per
   running sequence stays free, so that admissions do not cause preemptions at the next decode.
`postprocess` takes the sampled tokens, registers full blocks in the prefix cache, and ends finished sequences.
"""
from __future__ import annotations

from collections import deque

from .block_manager import NO_PARENT, BlockManager
from .sequence import FINISHED, RUNNING, WAITING, Sequence


class KVCacheTooSmall(RuntimeError):
    pass


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    # ---- requests ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (any state) and give back its blocks."""
        if seq.status == FINISHED:
            return
        if seq.status == WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        else:
            self.running.remove(seq)
        self._release(seq)
        seq.status = FINISHED
        seq.finish_reason = reason

    # ---- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for the next forward: decodes first, then prefill chunks."""
        scheduled: list[tuple[Sequence, int]] = []
        capacity = self.blocks.block_size
        for seq in list(self.running):
            n_tokens = len(seq.token_ids)
            if seq.status != RUNNING or n_tokens - seq.num_computed != 1:
                continue
            # the common case, a decode within its last block, costs one comparison
            if n_tokens <= len(seq.block_table) * capacity or self._grow_or_preempt(seq):
                scheduled.append((seq, 1))
        budget = self.max_num_batched_tokens - len(scheduled)
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed
            if budget <= 0:
                break
            if remaining <= 1:
                continue
            n = min(remaining, budget)
            if not self._grow(seq, seq.num_computed + n):
                break
            scheduled.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break
            scheduled.append((self.running[-1], n))
            budget -= n
        if not scheduled and self.waiting and not self.running:
            raise KVCacheTooSmall("the KV cache is too small to make progress on the waiting requests")
        return scheduled

    def postprocess(self, seq: Sequence, num_computed_now: int) -> None:
        """Register the blocks that `seq`'s last step filled (their K/V are now in the cache)."""
        bs = self.blocks.block_size
        full = min(num_computed_now, len(seq.token_ids)) // bs
        keys = seq.block_keys
        if full <= len(keys):
            return
        parent = keys[-1] if keys else NO_PARENT
        for i in range(len(keys), full):
            parent = self.blocks.register(seq.block_table[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            keys.append(parent)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of a running sequence, if free ones exist (no preemption)."""
        return self._grow(seq, num_tokens)

    # ---- blocks -------------------------------------------------------------------------------------------------
    def _admit(self, seq: Sequence, budget: int) -> int:
        """Start `seq` (the head of the queue) if its first chunk fits; returns that chunk's size (0: not now)."""
        blocks = self.blocks
        # Leave at least the last token to compute: its logits give the next token.
        cached, keys = blocks.match_prefix(seq.token_ids, seq.num_tokens - 1)
        num_cached = len(cached) * blocks.block_size
        n = min(seq.num_tokens - num_cached, budget)
        need = blocks.blocks_for(num_cached + n) - len(cached)
        headroom = len(self.running)  # a block per running sequence stays free for its next decode
        if not blocks.can_allocate(need + headroom) and not (not self.running and blocks.can_allocate(need)):
            blocks.free(cached)
            return 0
        self.waiting.popleft()
        blocks.query_tokens += seq.num_tokens
        blocks.hit_tokens += num_cached
        seq.block_table = cached + blocks.allocate(need)
        seq.block_keys = keys
        seq.num_computed = num_cached
        seq.num_cached_tokens = num_cached
        seq.slot = self._free_slots.pop()
        seq.status = RUNNING
        self.running.append(seq)
        return n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_table += self.blocks.allocate(need)
        return True

    def _grow_or_preempt(self, seq: Sequence) -> bool:
        while not self._grow(seq, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed = 0
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1
