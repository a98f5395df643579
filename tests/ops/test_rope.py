import math
import re

import numpy as np
import pytest

from xserv.ops.attention import write_kv_packed, write_kv_reference
from xserv.ops.rope import (qk_norm_rope, qk_norm_rope_reference, qk_norm_rope_write_kv,
                            qk_norm_rope_write_kv_reference, qk_rope, qk_rope_reference, rope, rope_cos_sin_table,
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


# ---- qk_norm_rope_write_kv: qk_norm_rope / qk_rope + write_kv_packed in one op ----------------------------------------
def fused_case(rng, t, hq, hkv, d, block_size=16, max_pos=4096, norm=True):
    """Packed qkv, weights (None for Llama), positions, a slot mapping with -1 padding entries into a cache of spare
    blocks, and NaN-poisoned caches (the slots nobody writes must stay NaN)."""
    num_blocks = -(-t // block_size) + 2
    slots = rng.permutation(num_blocks * block_size)[:t].astype(np.int32)
    slots[::5] = -1
    return dict(qkv=random_array(rng, (t, hq + 2 * hkv, d), bfloat16, mean=0.0),
                qw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                kw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                pos=rng.integers(0, max_pos, t).astype(np.int32), table=rope_cos_sin_table(d, max_pos, 1e6),
                slots=slots, cache=np.full((num_blocks, block_size, hkv, d), np.nan, bfloat16), hq=hq, hkv=hkv)


def fused_expected(c):
    """The composition of the NumPy references: (qkv, k_cache, v_cache)."""
    kc, vc = c["cache"].copy(), c["cache"].copy()
    if c["qw"] is None:
        qkv = qk_rope_reference(c["qkv"], c["pos"], c["table"], c["hq"], c["hkv"])
    else:
        qkv = qk_norm_rope_reference(c["qkv"], c["qw"], c["kw"], c["pos"], c["table"], c["hq"], c["hkv"], EPS)
    hq, hkv = c["hq"], c["hkv"]
    write_kv_reference(qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], kc, vc, c["slots"])
    return qkv, kc, vc


FUSED_STEPS = [1]  # the kernel variants (row groups per warp) the GPU tests check (2 and 4 were measured too)


def run_fused(c, to, pdl=False):
    qkv, kc, vc = to(c["qkv"].copy()), to(c["cache"].copy()), to(c["cache"].copy())
    w = (None, None) if c["qw"] is None else (to(c["qw"]), to(c["kw"]))
    assert qk_norm_rope_write_kv(qkv, *w, to(c["pos"]), to(c["table"]), c["hq"], c["hkv"], EPS, kc, vc,
                                 to(c["slots"]), pdl=pdl) is qkv
    return qkv.numpy(), kc.numpy(), vc.numpy()


def bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_write_kv_cpu(rng, norm):
    c = fused_case(rng, 9, 4, 2, 64, block_size=4, norm=norm)
    got, want = run_fused(c, cpu), fused_expected(c)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))
    qkv, kc, vc = got
    hq, hkv = c["hq"], c["hkv"]
    kept = c["slots"] >= 0
    assert kept.sum() < len(kept)  # padding entries are exercised
    # the cache holds the rotated k and the untouched v of kept tokens, NaN everywhere else
    np.testing.assert_array_equal(bits(kc.reshape(-1, hkv, 64)[c["slots"][kept]]), bits(qkv[kept, hq:hq + hkv]))
    np.testing.assert_array_equal(bits(vc.reshape(-1, hkv, 64)[c["slots"][kept]]), bits(c["qkv"][kept, hq + hkv:]))
    unused = np.setdiff1d(np.arange(kc.shape[0] * kc.shape[1]), c["slots"][kept])
    assert np.all(np.isnan(kc.reshape(-1, hkv, 64)[unused].astype(np.float32)))
    # rotated (and normed) q/k against the float64 formulas
    inv = inv_freq64(64, 1e6)
    q64 = c["qkv"][:, :hq] if not norm else rms64(c["qkv"][:, :hq], c["qw"])
    assert rel_error(qkv[:, :hq], rope64(q64, c["pos"], inv)) < 1e-2


def test_qk_norm_rope_write_kv_kernels_exist():
    """The launcher's kernel names are instantiated in rope.cu (every steps variant the tests run)."""
    from xserv.ops import rope as R
    from xserv.runtime.compiler import kernel_source_dir

    src = (kernel_source_dir() / "rope.cu").read_text()
    made = {f"{kind}_write_kv_d{d}_s{n}" for kind, d, n in
            re.findall(r"^XSERV_(QK_NORM_ROPE|QK_ROPE)_WRITE_KV\((\d+), (\d)\)", src, re.M)}
    made = {m.replace("QK_NORM_ROPE", "qk_norm_rope").replace("QK_ROPE", "qk_rope") for m in made}
    for steps in {R._FUSED_STEPS, *FUSED_STEPS}:
        for d in (64, 128):
            assert {f"qk_norm_rope_write_kv_d{d}_s{steps}", f"qk_rope_write_kv_d{d}_s{steps}"} <= made


def test_qk_norm_rope_write_kv_errors(rng):
    c = fused_case(rng, 4, 2, 1, 64)
    qkv, pos, table, slots = cpu(c["qkv"]), cpu(c["pos"]), cpu(c["table"]), cpu(c["slots"])
    kc, vc, w = cpu(c["cache"]), cpu(c["cache"].copy()), cpu(c["qw"])
    with pytest.raises(ValueError, match="q_weight, k_weight"):
        qk_norm_rope_write_kv(qkv, w, None, pos, table, 2, 1, EPS, kc, vc, slots)
    with pytest.raises(ValueError, match="k_cache"):
        big = cpu(np.zeros((2, 16, 2, 64), bfloat16))
        qk_norm_rope_write_kv(qkv, w, w, pos, table, 2, 1, EPS, big, cpu(np.zeros((2, 16, 2, 64), bfloat16)), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_write_kv(qkv, w, w, pos, table, 2, 1, EPS, kc, vc, cpu(c["slots"][:3]))
    with pytest.raises(ValueError, match="v_cache"):
        qk_norm_rope_write_kv(qkv, w, w, pos, table, 2, 1, EPS, kc, kc, slots)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_write_kv(qkv, w, w, cpu(c["pos"][:3]), table, 2, 1, EPS, kc, vc, slots)


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


@pytest.mark.gpu
@pytest.mark.parametrize("steps", FUSED_STEPS)
@pytest.mark.parametrize("t", [1, 7, 1023])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (16, 8), (14, 2), (1, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("norm", [True, False])
def test_cuda_qk_norm_rope_write_kv(rng, monkeypatch, steps, t, hq, hkv, d, norm):
    from xserv.ops import rope as R

    monkeypatch.setattr(R, "_FUSED_STEPS", steps)
    c = fused_case(rng, t, hq, hkv, d, norm=norm)
    got = run_fused(c, dev)
    # bit-identical to the two CUDA ops run one after the other on the same (poisoned) buffers
    qkv, kc, vc = dev(c["qkv"].copy()), dev(c["cache"].copy()), dev(c["cache"].copy())
    if norm:
        qk_norm_rope(qkv, dev(c["qw"]), dev(c["kw"]), dev(c["pos"]), dev(c["table"]), hq, hkv, EPS)
    else:
        qk_rope(qkv, dev(c["pos"]), dev(c["table"]), hq, hkv)
    write_kv_packed(qkv, hq, kc, vc, dev(c["slots"]))
    for g, w in zip(got, (qkv.numpy(), kc.numpy(), vc.numpy())):
        np.testing.assert_array_equal(bits(g), bits(w))
    # and close to the composition of the NumPy references, with every unwritten slot still NaN
    want = fused_expected(c)
    assert rel_error(got[0], want[0]) < 3e-3
    for g, w in zip(got[1:], want[1:]):
        written = ~np.isnan(w.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(g.astype(np.float32)), ~written)
        assert rel_error(g[written], w[written]) < 3e-3
    np.testing.assert_array_equal(bits(got[2][~np.isnan(want[2].astype(np.float32))]),
                                  bits(want[2][~np.isnan(want[2].astype(np.float32))]))  # v: copied bit for bit


@pytest.mark.gpu
def test_cuda_qk_norm_rope_write_kv_pdl_and_bad_positions(rng):
    c = fused_case(rng, 6, 4, 2, 128, max_pos=64)
    c["pos"][[1, 4]] = [64, -1]  # outside the table: NaN in those q/k rows, and in the cache (as the two ops do)
    c["slots"][:] = np.arange(6, dtype=np.int32)
    plain, with_pdl = run_fused(c, dev), run_fused(c, dev, pdl=True)
    for a, b in zip(plain, with_pdl):
        np.testing.assert_array_equal(bits(a), bits(b))
    qkv, kc = plain[0].astype(np.float32), plain[1].astype(np.float32).reshape(-1, 2, 128)
    assert np.all(np.isnan(qkv[[1, 4], :6])) and np.all(np.isfinite(qkv[[0, 2, 3, 5]])) and np.all(np.isfinite(qkv[:, 6:]))
    assert np.all(np.isnan(kc[[1, 4]])) and np.all(np.isfinite(kc[[0, 2, 3, 5]]))
    ok = [0, 2, 3, 5]
    ref = qk_norm_rope_reference(c["qkv"][ok], c["qw"], c["kw"], c["pos"][ok], c["table"], 4, 2, EPS)
    assert rel_error(plain[0][ok], ref) < 3e-3
