"""The paged KV cache: per layer a K pool and a V pool of [num_blocks, block_size, kv_heads, head_dim], in one
device allocation. Which sequence holds which block is the scheduler's business (block_manager.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..tensor import Tensor


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    def bytes_per_token(self, dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize


class KVCache:
    """K/V pools for every layer (one device allocation)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str, dtype):
        self.spec = spec
        self.device = device
        self.dtype = np.dtype(dtype)
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.storage = Tensor.zeros(shape, self.dtype, device)
        self.k = [self.storage[i][0] for i in range(spec.num_layers)]
        self.v = [self.storage[i][1] for i in range(spec.num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @staticmethod
    def capacity_tokens(spec: KVCacheSpec, dtype, memory_fraction: float = 0.85) -> int:
        """The tokens a CUDA pool of `memory_fraction` of the free device memory holds (ValueError below one
        block). Tensor parallelism: every rank computes its own, rank 0 sizes every rank's pool by the smallest."""
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        from ..runtime import get_runtime

        per_token = spec.bytes_per_token(np.dtype(dtype))
        runtime = get_runtime()
        free, _total = runtime.device.memory_info()
        free += runtime.allocator.stats.bytes_cached  # blocks freed by a closed LLM: an allocation may take them
        num_tokens = int(free * memory_fraction) // per_token
        if num_tokens < spec.block_size:
            raise ValueError(
                f"not enough device memory for a KV cache: {free / 2**30:.2f} GiB free, "
                f"{per_token} bytes per token; lower max_model_len or free memory")
        return num_tokens

    @classmethod
    def create(cls, spec: KVCacheSpec, device: str, dtype, *, num_tokens: int | None = None,
               memory_fraction: float = 0.85) -> "KVCache":
        """A pool of `num_tokens` tokens, or (None, CUDA only) `memory_fraction` of the free device memory."""
        dtype = np.dtype(dtype)
        if num_tokens is None:
            if device != "cuda":
                raise ValueError("a CPU KV cache needs num_tokens")
            num_tokens = cls.capacity_tokens(spec, dtype, memory_fraction)
        if num_tokens < 1:
            raise ValueError(f"kv cache tokens must be >= 1, got {num_tokens}")
        num_blocks = max(1, math.ceil(num_tokens / spec.block_size))
        return cls(spec, num_blocks, device, dtype)
