"""The paged KV cache: per layer a K pool and a V pool of [num_blocks, block_size, kv_heads, head_dim], and a
block allocator handing out blocks to sequences as they grow (free list; blocks come back when a sequence ends)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..tensor import Tensor, bfloat16, float32

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_FRACTION = 0.85
CPU_POOL_BYTES = 512 << 20  # default CPU pool: at most this much (the NumPy backend is for tiny models)


class BlockAllocator:
    """A free list of block ids. Blocks are handed out lowest id first so that small workloads stay compact."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = np.zeros(num_blocks, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        self._used[blocks] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            if not self._used[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._used[b] = False
            self._free.append(b)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def bytes_per_token(self, dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize


class KVCache:
    """K/V pools for every layer (one device allocation) and the allocator of their blocks."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str, dtype=None):
        self.spec = spec
        self.device = device
        self.dtype = np.dtype(dtype) if dtype is not None else (bfloat16 if device == "cuda" else float32)
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.storage = Tensor.zeros(shape, self.dtype, device)
        self.k = [self.storage[i][0] for i in range(spec.num_layers)]
        self.v = [self.storage[i][1] for i in range(spec.num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @classmethod
    def create(cls, spec: KVCacheSpec, device: str, *, num_tokens: int | None = None,
               memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION, reserve_bytes: int = 0,
               min_tokens: int = 0, dtype=None) -> "KVCache":
        """A pool of `num_tokens` tokens, or (when None) sized from memory: on CUDA `memory_fraction` of the free
        device memory less `reserve_bytes` (activations); on CPU at most CPU_POOL_BYTES and at least
        `min_tokens`."""
        dtype = np.dtype(dtype) if dtype is not None else (bfloat16 if device == "cuda" else float32)
        per_token = spec.bytes_per_token(dtype)
        if num_tokens is None:
            if device == "cuda":
                if not 0 < memory_fraction <= 1:
                    raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
                from ..runtime import get_device

                free, _total = get_device().memory_info()
                budget = int(free * memory_fraction) - reserve_bytes
                num_tokens = budget // per_token
                if num_tokens < spec.block_size:
                    raise ValueError(
                        f"not enough device memory for a KV cache: {free / 2**30:.2f} GiB free, "
                        f"{per_token} bytes per token; lower max_model_len or free memory")
            else:
                num_tokens = max(CPU_POOL_BYTES // per_token, min_tokens)
        if num_tokens < 1:
            raise ValueError(f"kv cache tokens must be >= 1, got {num_tokens}")
        num_blocks = max(1, math.ceil(num_tokens / spec.block_size))
        return cls(spec, num_blocks, device, dtype)
