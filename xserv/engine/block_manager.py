"""KV-cache blocks: who holds which, and the prefix cache.

A block is free, or held by one or more sequences (a reference count). A *full* block whose K/V have been computed
can be registered under a key: the hash of its parent's key and its own tokens, so that a key names the whole
prefix up to the block's end. A new request walks its prompt block by block and takes every registered block whose
key and tokens match (exact: the tokens are compared, not only the hash). A registered block whose last holder
lets go keeps its contents and its key, and waits in an LRU list; it is evicted (its key forgotten) only when a
block is needed and no never-registered block is free.
"""
from __future__ import annotations

from collections import OrderedDict

NO_PARENT = 0  # the parent key of a sequence's first block


def block_key(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self._plain_free = list(range(num_blocks - 1, -1, -1))  # never registered; popped lowest id first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest first
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, tokens)
        self._block_of: dict[int, int] = {}  # key -> block
        self.query_tokens = 0  # prompt tokens of admitted requests (the scheduler counts them)
        self.hit_tokens = 0  # of which the prefix cache supplied

    # ---- counts -------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never-registered free blocks and evictable cached ones)."""
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- allocation ---------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each held once. Never-registered blocks go first, then the least recently used cached."""
        if n > self.num_free:
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._plain_free:
                b = self._plain_free.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                key, _tokens = self._key_of.pop(b)
                del self._block_of[key]
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Let go of one hold on each block. Blocks nobody holds become free (registered ones stay cached)."""
        for b in reversed(blocks):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if b in self._key_of:
                    self._cached_free[b] = None
                else:
                    self._plain_free.append(b)

    # ---- prefix cache -------------------------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """The registered blocks that hold a prefix of `token_ids` (at most `max_tokens` tokens of it), each now held
        once more (give them back with `free` if unused), and their keys."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks, keys, parent = [], [], NO_PARENT
        for start in range(0, max_tokens - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            key = block_key(parent, tokens)
            b = self._block_of.get(key)
            if b is None or self._key_of[b][1] != tokens:
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        for b in blocks:
            if self.ref_count[b] == 0:
                del self._cached_free[b]
            self.ref_count[b] += 1
        return blocks, keys

    def register(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Record that held, full `block` holds `tokens` after the prefix keyed `parent`; returns its key. When
        another block already holds that prefix, this one stays unregistered (the key still chains)."""
        key = block_key(parent, tokens)
        if self.enable_prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = (key, tokens)
        return key

    def reset_prefix_cache(self) -> None:
        """Forget every registered prefix (held blocks keep their contents; free cached ones become plain free)."""
        for b in self._cached_free:
            self._plain_free.append(b)
        self._cached_free.clear()
        self._key_of.clear()
        self._block_of.clear()
