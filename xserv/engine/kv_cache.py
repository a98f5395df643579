"""The paged KV cache: per layer a K pool and a V pool of [num_blocks, block_size, kv_heads, head_dim], in one
device allocation. Which sequence holds which block is the scheduler's business (block_manager.py).

Element type (EngineConfig.kv_cache_dtype): bf16 (the model's dtype, "auto"), or e4m3 ("fp8_e4m3", float8_e4m3fn: 1
byte an element, twice the tokens in the same memory) with one float32 scale per (layer, kv head) for K and one for V
(k_scale / v_scale [num_layers, kv_heads]; value = code * scale; xserv/ops/attention/fp8_kv.py).

How the scales are chosen: all 1.0, fixed (vLLM's default for an FP8 KV cache without calibrated scales), with e4m3's
saturation at +-448. Why that is enough for Qwen3: K is written after the k head RMSNorm, so each K row has RMS equal
to that of k_norm's weight (|k| <= sqrt(head_dim) * max|weight| for any input), and V rows are projections of an
RMS-normalised hidden state; e4m3 keeps 3 mantissa bits over 2^-6 .. 448 (15 binades, subnormals down to 2^-9), which
holds such values with a relative step of 2^-4 without a scale. Fixed scales also keep the cache's bits independent
of which request came first (prefix caching shares blocks between requests) and need no calibration pass. The scales
are real per-head inputs of every FP8 kernel (tested with other values), so a checkpoint's calibrated k_scale /
v_scale can be loaded into them later.

Prefill over an FP8 cache reads a bf16 copy of the blocks the batch attends to (prefill_scratch: one layer's K and V
in bf16, the pool's block count, reused by every layer); on CUDA its memory is counted in the capacity, so the pool
holds 2 L / (L + 2) times the bf16 tokens for L layers (1.87x for Qwen3-0.6B's 28, 1.89x for 8B's 36)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..tensor import Tensor, bfloat16, float8_e4m3fn, float32

from .config import KV_CACHE_DTYPES


def kv_cache_dtype(name: str, model_dtype) -> np.dtype:
    """The element type of an EngineConfig.kv_cache_dtype name: "auto" the model's (bf16), "bfloat16", "fp8_e4m3"
    (float8_e4m3fn)."""
    if name == "auto":
        return np.dtype(model_dtype)
    if name == "bfloat16":
        return bfloat16
    if name == "fp8_e4m3":
        return float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def usable_device_memory() -> int:
    """Bytes a new allocation may take on the device: free memory plus the allocator's cached blocks (freed by a
    closed LLM)."""
    from ..runtime import get_runtime

    runtime = get_runtime()
    free, _total = runtime.device.memory_info()
    return free + runtime.allocator.stats.bytes_cached


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    def bytes_per_token(self, dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize

    def scratch_bytes_per_token(self, dtype) -> int:
        """An FP8 cache's bf16 prefill copy of one layer's K and V (KVCache.prefill_scratch), per pool token; 0 else."""
        return 2 * self.num_kv_heads * self.head_dim * 2 if np.dtype(dtype) == float8_e4m3fn else 0


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
        # FP8: per-layer scales (all 1.0: the module docstring) and, on CUDA, the bf16 copy prefill reads
        self.k_scales: list[Tensor | None] = [None] * spec.num_layers
        self.v_scales: list[Tensor | None] = [None] * spec.num_layers
        self.prefill_scratch: tuple[Tensor, Tensor] | None = None
        if self.fp8:
            ones = np.ones((spec.num_layers, spec.num_kv_heads), np.float32)
            self.k_scale = Tensor.from_numpy(ones, device, float32)
            self.v_scale = Tensor.from_numpy(ones, device, float32)
            self.k_scales = [self.k_scale[i] for i in range(spec.num_layers)]
            self.v_scales = [self.v_scale[i] for i in range(spec.num_layers)]
            if device == "cuda":
                scratch = Tensor.empty((2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim), bfloat16,
                                       device)
                self.prefill_scratch = (scratch[0], scratch[1])

    @property
    def fp8(self) -> bool:
        return self.dtype == float8_e4m3fn

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
        per_token = spec.bytes_per_token(np.dtype(dtype)) + spec.scratch_bytes_per_token(dtype)
        free = usable_device_memory()
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
