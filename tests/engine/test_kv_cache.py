"""engine/kv_cache.py on the CPU: the element type each kv_cache_dtype name gives, the pool's shape and the per-layer
K/V views into its one allocation, the FP8 scales, and the sizing arithmetic (bytes per token, blocks for a token
count, the capacity a memory budget buys, with a stand-in runtime)."""
from types import SimpleNamespace

import numpy as np
import pytest

import xserv.runtime as runtime_module
from xserv.engine.kv_cache import KVCache, KVCacheSpec, kv_cache_dtype
from xserv.tensor import bfloat16, float8_e4m3fn, float32

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


def test_dtype_names():
    """Planted bug seen red: "auto" mapped to bfloat16 whatever the model's dtype (a float32 model's cache in bf16)."""
    assert kv_cache_dtype("auto", bfloat16) == bfloat16
    assert kv_cache_dtype("auto", np.float32) == np.float32
    assert kv_cache_dtype("bfloat16", np.float32) == bfloat16
    assert kv_cache_dtype("fp8_e4m3", bfloat16) == float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8_e4m3"):
        kv_cache_dtype("fp8", bfloat16)


def test_bytes_per_token_counts_k_and_v_of_every_layer_and_the_fp8_scratch():
    """Planted bug seen red: bytes_per_token counting K only (the pool overran the memory it was sized for)."""
    assert SPEC.bytes_per_token(bfloat16) == 2 * 3 * 2 * 8 * 2
    assert SPEC.bytes_per_token(float8_e4m3fn) == 2 * 3 * 2 * 8
    assert SPEC.scratch_bytes_per_token(bfloat16) == 0
    assert SPEC.scratch_bytes_per_token(float8_e4m3fn) == 2 * 2 * 8 * 2  # one layer's K and V in bf16


@pytest.mark.parametrize("dtype", [bfloat16, float8_e4m3fn])
def test_pool_shape_views_and_scales(dtype):
    """Every layer's K and V are disjoint views of the one allocation; FP8 pools carry unit scales per (layer, kv
    head). Planted bug seen red: v[i] taken as storage[i][0] (V written over K)."""
    cache = KVCache.create(SPEC, "cpu", dtype, num_tokens=10)
    assert cache.num_blocks == 3 and cache.num_tokens == 12 and cache.blocks_for(9) == 3 and cache.blocks_for(8) == 2
    assert cache.dtype == np.dtype(dtype) and cache.fp8 == (dtype == float8_e4m3fn)
    assert cache.storage.shape == (3, 2, 3, 4, 2, 8)
    assert len(cache.k) == len(cache.v) == 3
    assert all(t.shape == (3, 4, 2, 8) and t.dtype == np.dtype(dtype) for t in cache.k + cache.v)
    store = cache.storage.numpy()
    for i in range(3):
        assert np.shares_memory(cache.k[i].numpy(), store) and np.shares_memory(cache.v[i].numpy(), store)
        store[i, 0] = np.asarray(1, dtype)
        store[i, 1] = np.asarray(2, dtype)
    for i in range(3):
        assert np.all(cache.k[i].numpy().astype(np.float32) == 1) and np.all(cache.v[i].numpy().astype(np.float32) == 2)
    assert cache.prefill_scratch is None  # the bf16 prefill copy is made on CUDA only
    if dtype == float8_e4m3fn:
        assert cache.k_scale.shape == cache.v_scale.shape == (3, 2) and cache.k_scale.dtype == float32
        assert np.all(cache.k_scale.numpy() == 1) and np.all(cache.v_scale.numpy() == 1)
        assert [s.shape for s in cache.k_scales] == [(2,)] * 3 and len(cache.v_scales) == 3
    else:
        assert cache.k_scales == cache.v_scales == [None] * 3


def test_create_refuses_what_it_cannot_size():
    """Planted bug seen red: create() rounding num_tokens=0 up to one block (an empty cache passed for a working
    one)."""
    with pytest.raises(ValueError, match="CPU KV cache needs num_tokens"):
        KVCache.create(SPEC, "cpu", bfloat16)
    with pytest.raises(ValueError, match="must be >= 1"):
        KVCache.create(SPEC, "cpu", bfloat16, num_tokens=0)
    assert KVCache.create(SPEC, "cpu", bfloat16, num_tokens=1).num_blocks == 1


def fake_runtime(monkeypatch, free, cached=0):
    rt = SimpleNamespace(device=SimpleNamespace(memory_info=lambda: (free, 10 * free)),
                         allocator=SimpleNamespace(stats=SimpleNamespace(bytes_cached=cached)))
    monkeypatch.setattr(runtime_module, "get_runtime", lambda: rt)


def test_capacity_from_a_memory_budget(monkeypatch):
    """The tokens a fraction of free (plus the allocator's cached) memory holds, the FP8 scratch counted.
    Planted bugs seen red: the allocator's cached bytes left out; and the FP8 prefill scratch left out of the per-token
    cost (the pool and its scratch overran the budget)."""
    fake_runtime(monkeypatch, free=1_000_000, cached=200_000)
    bf16 = SPEC.bytes_per_token(bfloat16)
    assert KVCache.capacity_tokens(SPEC, bfloat16, 0.5) == 600_000 // bf16
    fp8 = SPEC.bytes_per_token(float8_e4m3fn) + SPEC.scratch_bytes_per_token(float8_e4m3fn)
    assert KVCache.capacity_tokens(SPEC, float8_e4m3fn, 0.5) == 600_000 // fp8
    with pytest.raises(ValueError, match="memory_fraction"):
        KVCache.capacity_tokens(SPEC, bfloat16, 0.0)
    fake_runtime(monkeypatch, free=bf16 * 3)
    with pytest.raises(ValueError, match="not enough device memory for a KV cache"):
        KVCache.capacity_tokens(SPEC, bfloat16, 1.0)  # 3 tokens: less than one block of 4
