import math

import numpy as np
import pytest

from xserv.ops.rope import (qk_norm_rope, qk_norm_rope_reference, qk_rope, qk_rope_reference, rope, rope_cos_sin_table,
                            rope_reference)
from xserv.tensor import Tensor, bfloat16, float32
from qwen3_reference import llama3_inv_freq64
from xserv.testing import misaligned, poisoned, random_array, rel_error

EPS = 1e-6
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def cpu(a):
    return Tensor.from_numpy(a, "cpu")


def dev(a):
    return Tensor.from_numpy(a, "cuda")


def rope64(x, positions, inv_freq, scale=1.0):
    """Independent float64 rotate-half RoPE from the inverse frequencies."""
    x = x.astype(np.float64)
    half = x.shape[-1] // 2
    ang = positions.astype(np.float64)[:, None, None] * inv_freq[None, None, :]
    c, s = np.cos(ang) * scale, np.sin(ang) * scale
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * c - hi * s, hi * c + lo * s], -1)


def inv_freq64(d, theta):
    return theta ** (-np.arange(0, d, 2) / d)


def rms64(x, w):
    x = x.astype(np.float64)
    return w.astype(np.float64) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS)


# ---- the table -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_default_table(d):
    table = rope_cos_sin_table(d, 4096, 1e6)
    assert table.shape == (4096, d) and table.dtype == np.float32
    ang = np.arange(4096)[:, None] * inv_freq64(d, 1e6)[None]
    np.testing.assert_allclose(table[:, : d // 2], np.cos(ang), atol=2e-3)
    np.testing.assert_allclose(table[:, d // 2:], np.sin(ang), atol=2e-3)
    np.testing.assert_allclose(table[:64], np.concatenate([np.cos(ang[:64]), np.sin(ang[:64])], 1), atol=1e-5)


def test_yarn_table_qwen3():
    d, theta = 128, 1e6
    table = rope_cos_sin_table(d, 256, theta, QWEN3_YARN)
    mscale = 0.1 * math.log(4.0) + 1.0
    np.testing.assert_allclose(table[0, :64], mscale, rtol=1e-6)  # cos(0) * attention factor
    np.testing.assert_allclose(table[0, 64:], 0.0)
    # Independent float64 YaRN: correction range from the paper's formula, linear ramp between.
    base = inv_freq64(d, theta)
    corr = lambda rot: d * math.log(32768 / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
    assert (low, high) == (23, 40)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    inv = base / 4.0 * ramp + base * (1 - ramp)
    ang = np.arange(256)[:, None] * inv[None]
    np.testing.assert_allclose(table, np.concatenate([np.cos(ang), np.sin(ang)], 1) * mscale, atol=1e-4)


@pytest.mark.parametrize("d, theta, scaling", [(128, 5e5, LLAMA31), (64, 5e5, {**LLAMA31, "factor": 32.0}),
                                               (64, 5e5, {**LLAMA31, "original_max_position_embeddings": 256})])
def test_llama3_table(d, theta, scaling):
    inv = llama3_inv_freq64(d, theta, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                            scaling["original_max_position_embeddings"])
    base = inv_freq64(d, theta)
    # the case must have all three bands, or the test would not see a wrong band
    assert (inv == base).any() and np.isclose(inv, base / scaling["factor"]).any()
    assert ((inv < base) & ~np.isclose(inv, base / scaling["factor"])).any()
    pos = np.array([0, 1, 7, 1000, 8191, 20000])
    table = rope_cos_sin_table(d, 20001, theta, scaling)[pos]
    ang = pos[:, None] * inv[None]
    # the table rounds each angle to float32 as transformers does: up to 1e-3 off at angles near 20000
    np.testing.assert_allclose(table, np.concatenate([np.cos(ang), np.sin(ang)], 1), atol=2e-3)
    np.testing.assert_allclose(table[:3], np.concatenate([np.cos(ang[:3]), np.sin(ang[:3])], 1), atol=1e-6)


def test_yarn_attention_factor_override_and_unknown_type():
    t = rope_cos_sin_table(64, 8, 1e4, {**QWEN3_YARN, "attention_factor": 1.0})
    np.testing.assert_allclose(t[0, :32], 1.0)
    with pytest.raises(ValueError, match="'linear' is not supported"):
        rope_cos_sin_table(64, 8, 1e4, {"rope_type": "linear", "factor": 8.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin_table(64, 8, 1e4, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_cos_sin_table(64, 8, 1e4, {"rope_type": "yarn", "factor": 4.0})
    np.testing.assert_array_equal(rope_cos_sin_table(64, 8, 1e4, {"rope_type": "default"}),
                                  rope_cos_sin_table(64, 8, 1e4))


# ---- CPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_rope_reference_vs_float64(rng, d):
    x = random_array(rng, (9, 3, d), bfloat16, mean=0.2)
    pos = rng.integers(0, 500, 9).astype(np.int32)
    table = rope_cos_sin_table(d, 512, 1e4)
    assert rel_error(rope_reference(x, pos, table), rope64(x, pos, inv_freq64(d, 1e4))) < 1e-4


def test_rope_cpu_dispatch_and_inplace(rng):
    x = random_array(rng, (5, 2, 64), bfloat16, mean=0.2)
    pos = np.array([0, 3, 1, 7, 2], np.int32)
    table = rope_cos_sin_table(64, 16, 1e4)
    xt = cpu(x.copy())
    assert rope(xt, cpu(pos), cpu(table), out=xt) is xt
    np.testing.assert_array_equal(xt.array, rope_reference(x, pos, table).astype(bfloat16))
    np.testing.assert_array_equal(xt.array[0], x[0])  # position 0 is the identity
    with pytest.raises(ValueError, match="positions"):
        rope(cpu(x), cpu(np.array([0, 1, 2, 3, 16], np.int32)), cpu(table))


def test_qk_norm_rope_reference_vs_float64(rng):
    hq, hkv, d = 4, 2, 128
    qkv = random_array(rng, (6, hq + 2 * hkv, d), bfloat16, mean=0.3)
    qw = random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)
    kw = random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)
    pos = rng.integers(0, 100, 6).astype(np.int32)
    table = rope_cos_sin_table(d, 128, 1e6)
    got = qk_norm_rope_reference(qkv, qw, kw, pos, table, hq, hkv, EPS)
    inv = inv_freq64(d, 1e6)
    assert rel_error(got[:, :hq], rope64(rms64(qkv[:, :hq], qw), pos, inv)) < 1e-2
    assert rel_error(got[:, hq:hq + hkv], rope64(rms64(qkv[:, hq:hq + hkv], kw), pos, inv)) < 1e-2
    np.testing.assert_array_equal(got[:, hq + hkv:], qkv[:, hq + hkv:])
    t = cpu(qkv.copy())
    assert qk_norm_rope(t, cpu(qw), cpu(kw), cpu(pos), cpu(table), hq, hkv, EPS) is t
    np.testing.assert_array_equal(t.array, got)


def test_qk_rope_reference_vs_float64(rng):
    hq, hkv, d = 4, 2, 64
    qkv = random_array(rng, (6, hq + 2 * hkv, d), bfloat16)
    pos = rng.integers(0, 100, 6).astype(np.int32)
    table = rope_cos_sin_table(d, 128, 5e5, {**LLAMA31, "original_max_position_embeddings": 256})
    got = qk_rope_reference(qkv, pos, table, hq, hkv)
    inv = llama3_inv_freq64(d, 5e5, 8.0, 1.0, 4.0, 256)
    assert rel_error(got[:, :hq + hkv], rope64(qkv[:, :hq + hkv], pos, inv)) < 1e-2
    np.testing.assert_array_equal(got[:, hq + hkv:], qkv[:, hq + hkv:])
    t = cpu(qkv.copy())
    assert qk_rope(t, cpu(pos), cpu(table), hq, hkv) is t
    np.testing.assert_array_equal(t.array, got)


def test_errors_name_the_argument(rng):
    x = cpu(random_array(rng, (4, 2, 64), bfloat16))
    pos = cpu(np.arange(4, dtype=np.int32))
    table = cpu(rope_cos_sin_table(64, 8, 1e4))
    with pytest.raises(ValueError, match="head_dim"):
        rope(cpu(random_array(rng, (4, 2, 96), bfloat16)), pos, cpu(rope_cos_sin_table(96, 8, 1e4)))
    with pytest.raises(ValueError, match="positions"):
        rope(x, cpu(np.arange(4, dtype=np.int64)), table)
    with pytest.raises(ValueError, match="positions"):
        rope(x, cpu(np.arange(3, dtype=np.int32)), table)
    with pytest.raises(ValueError, match="cos_sin"):
        rope(x, pos, cpu(rope_cos_sin_table(128, 8, 1e4)))
    with pytest.raises(ValueError, match="cos_sin"):
        rope(x, pos, cpu(rope_cos_sin_table(64, 8, 1e4).astype(bfloat16)))
    w = cpu(random_array(rng, (64,), bfloat16))
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope(cpu(random_array(rng, (4, 5, 64), bfloat16)), w, w, pos, table, 2, 2, EPS)
    with pytest.raises(ValueError, match="num_kv_heads"):
        qk_norm_rope(cpu(random_array(rng, (4, 4, 64), bfloat16)), w, w, pos, table, 4, 0, EPS)
    with pytest.raises(ValueError, match="k_weight"):
        qk_norm_rope(cpu(random_array(rng, (4, 4, 64), bfloat16)), w, cpu(random_array(rng, (32,), bfloat16)),
                     pos, table, 2, 1, EPS)
    with pytest.raises(ValueError, match="qkv: 5 heads"):
        qk_rope(cpu(random_array(rng, (4, 5, 64), bfloat16)), pos, table, 2, 2)
    with pytest.raises(ValueError, match="num_q_heads"):
        qk_rope(cpu(random_array(rng, (4, 4, 64), bfloat16)), pos, table, True, 1)
    with pytest.raises(ValueError, match="positions"):
        qk_rope(cpu(random_array(rng, (3, 4, 64), bfloat16)), pos, table, 2, 1)


# ---- CUDA ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 1023])
@pytest.mark.parametrize("heads", [1, 5, 40])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("scaling", [None, QWEN3_YARN])
def test_cuda_rope(rng, t, heads, d, scaling):
    x = random_array(rng, (t, heads, d), bfloat16, mean=0.2)
    table = rope_cos_sin_table(d, 40000, 1e6, scaling)
    pos = rng.integers(0, 40000, t).astype(np.int32)
    pos[0] = 39999
    out = poisoned(x.shape, bfloat16)
    rope(dev(x), dev(pos), dev(table), out=out)
    ref = rope_reference(x, pos, table)
    assert rel_error(out.numpy(), ref.astype(bfloat16)) < 2e-3
    assert rel_error(out.numpy(), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["inplace", "unaligned"])
def test_cuda_rope_layouts(rng, layout):
    x = random_array(rng, (9, 3, 128), bfloat16, mean=0.2)
    table = rope_cos_sin_table(128, 64, 1e6)
    pos = rng.integers(0, 64, 9).astype(np.int32)
    xd = misaligned(x) if layout == "unaligned" else dev(x)
    out = xd if layout == "inplace" else poisoned(x.shape, bfloat16)
    rope(xd, dev(pos), dev(table), out=out)
    assert rel_error(out.numpy(), rope_reference(x, pos, table).astype(bfloat16)) < 2e-3


@pytest.mark.gpu
def test_cuda_rope_bad_position_writes_nan(rng):
    x = random_array(rng, (3, 2, 64), bfloat16)
    table = rope_cos_sin_table(64, 8, 1e4)
    out = rope(dev(x), dev(np.array([1, 8, -1], np.int32)), dev(table)).numpy().astype(np.float32)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 1023])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (16, 8), (14, 2), (1, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_qk_norm_rope(rng, t, hq, hkv, d):
    qkv = random_array(rng, (t, hq + 2 * hkv, d), bfloat16, mean=0.3)
    qw = random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)
    kw = random_array(rng, (d,), bfloat16, mean=1.0, std=0.3)
    table = rope_cos_sin_table(d, 4096, 1e6)
    pos = rng.integers(0, 4096, t).astype(np.int32)
    qkv_dev = dev(qkv)
    qk_norm_rope(qkv_dev, dev(qw), dev(kw), dev(pos), dev(table), hq, hkv, EPS)
    got = qkv_dev.numpy()
    ref = qk_norm_rope_reference(qkv, qw, kw, pos, table, hq, hkv, EPS)
    np.testing.assert_array_equal(got[:, hq + hkv:].view(np.uint16), qkv[:, hq + hkv:].view(np.uint16))
    assert rel_error(got, ref) < 3e-3
    inv = inv_freq64(d, 1e6)
    assert rel_error(got[:, :hq], rope64(rms64(qkv[:, :hq], qw), pos, inv)) < 1e-2
    assert rel_error(got[:, hq:hq + hkv], rope64(rms64(qkv[:, hq:hq + hkv], kw), pos, inv)) < 1e-2


@pytest.mark.gpu
def test_cuda_qk_norm_rope_unaligned(rng):
    hq, hkv, d = 4, 2, 128
    qkv = random_array(rng, (5, hq + 2 * hkv, d), bfloat16, mean=0.3)
    w = random_array(rng, (d,), bfloat16, mean=1.0)
    table = rope_cos_sin_table(d, 64, 1e6)
    pos = np.arange(5, dtype=np.int32)
    qd = misaligned(qkv)
    qk_norm_rope(qd, dev(w), dev(w), dev(pos), dev(table), hq, hkv, EPS)
    assert rel_error(qd.numpy(), qk_norm_rope_reference(qkv, w, w, pos, table, hq, hkv, EPS)) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 1023])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (14, 2), (1, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_qk_rope(rng, t, hq, hkv, d):
    qkv = random_array(rng, (t, hq + 2 * hkv, d), bfloat16)
    table = rope_cos_sin_table(d, 20000, 5e5, LLAMA31)
    pos = rng.integers(0, 20000, t).astype(np.int32)
    qkv_dev = dev(qkv)
    qk_rope(qkv_dev, dev(pos), dev(table), hq, hkv)
    got = qkv_dev.numpy()
    np.testing.assert_array_equal(got[:, hq + hkv:].view(np.uint16), qkv[:, hq + hkv:].view(np.uint16))
    assert rel_error(got, qk_rope_reference(qkv, pos, table, hq, hkv)) < 3e-3
    inv = llama3_inv_freq64(d, 5e5, 8.0, 1.0, 4.0, 8192)
    assert rel_error(got[:, :hq + hkv], rope64(qkv[:, :hq + hkv], pos, inv)) < 1e-2


@pytest.mark.gpu
def test_cuda_qk_rope_unaligned_and_bad_position(rng):
    hq, hkv, d = 4, 2, 128
    qkv = random_array(rng, (5, hq + 2 * hkv, d), bfloat16)
    table = rope_cos_sin_table(d, 64, 5e5)
    pos = np.array([0, 3, 64, 1, -1], np.int32)
    qd = misaligned(qkv)
    qk_rope(qd, dev(pos), dev(table), hq, hkv)
    got = qd.numpy().astype(np.float32)
    ok = [0, 1, 3]
    ref = qk_rope_reference(qkv[ok], pos[ok], table, hq, hkv)
    assert rel_error(got[ok], ref) < 3e-3
    assert np.all(np.isnan(got[[2, 4], :hq + hkv])) and np.all(np.isfinite(got[:, hq + hkv:]))
