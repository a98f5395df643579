"""The FP8 (e4m3) KV cache ops: the float -> e4m3 conversion (soft form against ml_dtypes), the quantizing KV write,
decode and prefill over an FP8 cache (NumPy on the CPU; the CUDA kernels against the NumPy path on a GPU), and the
argument checks. Model-level checks: tests/models/test_fp8_kv_model.py."""
import math

import numpy as np
import pytest

from tools.dev import kernels as K
from xserv.ops import attention as A
from xserv.ops.attention import fp8_kv as F
from xserv.ops.rope import (qk_norm_rope, qk_norm_rope_write_kv, qk_norm_rope_write_kv_reference, qk_rope,
                            rope_cos_sin_table)
from xserv.tensor import Tensor, bfloat16, float8_e4m3fn, float32, int32
from xserv.testing import paged_kv_from_dense, random_array

E4M3 = np.dtype(float8_e4m3fn)


def _interesting_floats(rng) -> np.ndarray:
    """Every e4m3 value, the midpoints between neighbours (ties: round to even), one float32 step either side of
    them, log-uniform random magnitudes over 2^-14 .. 2^10 of both signs, and the specials."""
    codes = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    finite = np.unique(codes[np.isfinite(codes)])
    mids = (finite[:-1] + finite[1:]) / 2
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    rand = np.exp2(rng.uniform(-14, 10, 200_000)).astype(np.float32) * rng.choice([-1, 1], 200_000)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 448, -448, 464, -464, 465, 480, 1e30, 2 ** -6, 2 ** -9,
                        2 ** -10, 2 ** -10 * 3, 1e-30, -1e-30], np.float32)
    return np.concatenate([finite, mids, near, rand, special]).astype(np.float32)


def test_soft_e4m3_encoding_matches_ml_dtypes_round_to_nearest_even_with_saturation():
    x = _interesting_floats(np.random.default_rng(0))
    soft = F.float_to_e4m3_soft(x)
    ref = F.quantize_e4m3_reference(x).view(np.uint8)
    bad = np.flatnonzero(soft != ref)
    assert bad.size == 0, f"{bad.size} codes differ, e.g. x={x[bad[:5]]}: soft {soft[bad[:5]]} vs {ref[bad[:5]]}"
    assert F.float_to_e4m3_soft(np.array([np.nan], np.float32))[0] == 0x7F  # NaN stays NaN
    assert F.quantize_e4m3_reference(np.array([1e6, -1e6], np.float32)).astype(np.float32).tolist() == [448, -448]


def test_e4m3_round_trip_error_is_within_half_a_step():
    x = np.random.default_rng(1).uniform(2 ** -6, 448, 100_000).astype(np.float32)
    back = F.quantize_e4m3_reference(x).astype(np.float32)
    assert np.max(np.abs(back - x) / x) <= 2 ** -4  # 3 mantissa bits: half a step is 2^-4 relative at most


def _scales(rng, heads):
    return rng.uniform(0.25, 2.0, heads).astype(np.float32)


@pytest.mark.parametrize("packed", [False, True])
def test_write_kv_fp8_cpu_quantizes_the_slots_it_is_given(packed):
    rng = np.random.default_rng(2)
    hq, hkv, d, bs, blocks, t = 4, 2, 64, 16, 5, 19
    slots = rng.permutation(blocks * bs)[:t].astype(np.int32)
    slots[3] = -1  # a padding token: skipped
    k_scale, v_scale = _scales(rng, hkv), _scales(rng, hkv)
    k_cache = Tensor.from_numpy(np.full((blocks, bs, hkv, d), np.nan, np.float32).astype(E4M3), "cpu")
    v_cache = Tensor.from_numpy(np.full((blocks, bs, hkv, d), np.nan, np.float32).astype(E4M3), "cpu")
    qkv = random_array(rng, (t, hq + 2 * hkv, d), bfloat16, std=3.0)
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    args = (k_cache, v_cache, Tensor.from_numpy(slots, "cpu"), Tensor.from_numpy(k_scale, "cpu"),
            Tensor.from_numpy(v_scale, "cpu"))
    if packed:
        A.write_kv_packed(Tensor.from_numpy(qkv, "cpu"), hq, *args)
    else:
        A.write_kv(Tensor.from_numpy(np.ascontiguousarray(k), "cpu"), Tensor.from_numpy(np.ascontiguousarray(v), "cpu"),
                   *args)
    kc, vc = k_cache.array.reshape(-1, hkv, d), v_cache.array.reshape(-1, hkv, d)
    keep = slots >= 0
    want_k = F.quantize_e4m3_reference(k[keep].astype(np.float32) / k_scale[:, None])
    assert np.array_equal(kc[slots[keep]].view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(vc[slots[keep]].view(np.uint8),
                          F.quantize_e4m3_reference(v[keep].astype(np.float32) / v_scale[:, None]).view(np.uint8))
    untouched = np.setdiff1d(np.arange(blocks * bs), slots[keep])
    assert np.all(np.isnan(kc[untouched].astype(np.float32))) and np.all(np.isnan(vc[untouched].astype(np.float32)))
    # the dequantized values are the inputs to within e4m3's half step (2^-4 relative; values here are normals)
    back = F.dequantize_kv_reference(kc[slots[keep]], k_scale)
    big = np.abs(k[keep].astype(np.float32)) > 2 ** -6 * k_scale.max()
    assert np.max(np.abs(back - k[keep].astype(np.float32))[big] / np.abs(k[keep].astype(np.float32))[big]) <= 2 ** -4


def fp8_case(rng, q_lens, kv_lens, hq, hkv, d, bs, packed=False):
    """Zero-mean K/V quantized with random per-head scales into a permuted paged FP8 cache (unused slots NaN), the
    same values dequantized (what the kernels must attend over), packed queries."""
    k_scale, v_scale = _scales(rng, hkv), _scales(rng, hkv)
    kq = [F.quantize_kv_reference(random_array(rng, (n, hkv, d), np.float32, mean=0.0), k_scale) for n in kv_lens]
    vq = [F.quantize_kv_reference(random_array(rng, (n, hkv, d), np.float32, mean=0.0), v_scale) for n in kv_lens]
    k_cache, v_cache, tables = paged_kv_from_dense(rng, kq, vq, bs)
    heads = hq + (2 * hkv if packed else 0)
    return dict(q=random_array(rng, (sum(q_lens), heads, d), bfloat16, mean=0.0), k_cache=k_cache, v_cache=v_cache,
                tables=tables, cu=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                kv_lens=np.array(kv_lens, np.int32), k_scale=k_scale, v_scale=v_scale, hq=hq,
                ks=[F.dequantize_kv_reference(k, k_scale, np.float64) for k in kq],
                vs=[F.dequantize_kv_reference(v, v_scale, np.float64) for v in vq], scale=1.0 / math.sqrt(d))


def dense_expected(c):
    cu = c["cu"]
    return np.concatenate([A.attention_reference(c["q"][cu[s]:cu[s + 1], :c["hq"]], c["ks"][s], c["vs"][s], c["scale"])
                           for s in range(len(cu) - 1)])


def tensors(c, device):
    t = {k: Tensor.from_numpy(c[k], device) for k in ("q", "k_cache", "v_cache", "k_scale", "v_scale")}
    t.update(cu=Tensor.from_numpy(c["cu"], device), kv_lens=Tensor.from_numpy(c["kv_lens"], device),
             tables=Tensor.from_numpy(c["tables"], device))
    return t


def errors(out, ref) -> tuple[float, float]:
    """(max, mean) relative L2 error of the output rows [Hq * D]."""
    out = np.asarray(out, np.float64).reshape(len(ref), -1)
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    if not np.all(np.isfinite(out)):
        return float("inf"), float("inf")
    e = np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)
    return float(e.max()), float(e.mean())


def run_decode(c, device):
    t = tensors(c, device)
    return A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"],
                              int(c["kv_lens"].max()), num_q_heads=c["hq"], k_scale=t["k_scale"],
                              v_scale=t["v_scale"]).numpy()


def run_prefill(c, device):
    t = tensors(c, device)
    q_lens = np.diff(c["cu"])
    return A.attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu"], t["kv_lens"], t["tables"], c["scale"],
                               int(q_lens.max()), num_q_heads=c["hq"], k_scale=t["k_scale"],
                               v_scale=t["v_scale"]).numpy()


@pytest.mark.parametrize("hq, hkv, d, bs", [(4, 2, 64, 16), (8, 1, 128, 5), (6, 2, 128, 16)])
def test_decode_and_prefill_over_an_fp8_cache_cpu(hq, hkv, d, bs):
    rng = np.random.default_rng(3)
    c = fp8_case(rng, [1, 1, 1], [1, 37, 130], hq, hkv, d, bs)
    assert max(errors(run_decode(c, "cpu"), dense_expected(c))) <= 1e-2
    c = fp8_case(rng, [5, 1, 40], [5, 70, 40], hq, hkv, d, bs, packed=True)  # a chunk after a cached prefix
    assert max(errors(run_prefill(c, "cpu"), dense_expected(c))) <= 1e-2


def test_dequantize_kv_blocks_cpu_fills_the_blocks_the_batch_reads():
    rng = np.random.default_rng(4)
    c = fp8_case(rng, [1, 1], [20, 3], 2, 2, 64, 8)
    t = tensors(c, "cpu")
    k_out, v_out = F.prefill_scratch(t["k_cache"], None)
    k_out.array[...] = v_out.array[...] = np.nan
    F.dequantize_kv_blocks(t["k_cache"], t["v_cache"], t["k_scale"], t["v_scale"], t["kv_lens"], t["tables"], k_out,
                           v_out)
    for s, n in enumerate(c["kv_lens"]):
        k, v = A.gather_kv(k_out.array, v_out.array, c["tables"][s], int(n))
        assert np.array_equal(k.astype(np.float64), c["ks"][s].astype(bfloat16).astype(np.float64))
        assert np.array_equal(v.astype(np.float64), c["vs"][s].astype(bfloat16).astype(np.float64))


def test_fp8_cache_arguments_are_checked():
    rng = np.random.default_rng(5)
    c = fp8_case(rng, [1], [9], 2, 2, 64, 8)
    t = tensors(c, "cpu")
    with pytest.raises(ValueError, match="k_cache: a float8_e4m3fn .* needs k_scale and v_scale"):
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], 0.1, 9)
    bad = Tensor.from_numpy(np.ones(3, np.float32), "cpu")
    with pytest.raises(ValueError, match=r"k_scale: shape \[3\], expected \[2\]"):
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], 0.1, 9, k_scale=bad,
                           v_scale=t["v_scale"])
    with pytest.raises(ValueError, match="k_scale: dtype"):
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], 0.1, 9,
                           k_scale=Tensor.from_numpy(np.ones(2, np.int32), "cpu"), v_scale=t["v_scale"])
    bf = Tensor.from_numpy(c["k_cache"].astype(np.float32).astype(bfloat16), "cpu")
    with pytest.raises(ValueError, match="only an FP8 cache takes scales"):
        A.attention_decode(t["q"], bf, bf.clone(), t["kv_lens"], t["tables"], 0.1, 9, k_scale=t["k_scale"],
                           v_scale=t["v_scale"])
    with pytest.raises(ValueError, match="v_cache: dtype bfloat16, expected float8_e4m3fn"):
        A.attention_decode(t["q"], t["k_cache"], bf, t["kv_lens"], t["tables"], 0.1, 9, k_scale=t["k_scale"],
                           v_scale=t["v_scale"])
    scratch = F.prefill_scratch(t["k_cache"], None)
    with pytest.raises(ValueError, match=r"kv_scratch\[0\]: float32"):
        F.prefill_scratch(t["k_cache"], (Tensor.zeros(t["k_cache"].shape, float32, "cpu"), scratch[1]))


def test_decode_rope_over_an_fp8_cache_cpu_is_the_composition():
    rng = np.random.default_rng(6)
    hq, hkv, d, bs = 4, 2, 128, 16
    c = fp8_case(rng, [1, 1], [17, 40], hq, hkv, d, bs, packed=True)
    t = tensors(c, "cpu")
    cos_sin = rope_cos_sin_table(d, 64, 1e6)
    positions = (c["kv_lens"] - 1).astype(np.int32)
    slots = np.array([c["tables"][s, p // bs] * bs + p % bs for s, p in enumerate(positions)], np.int32)
    qw, kw = (random_array(rng, (d,), bfloat16, mean=1.0, std=0.1) for _ in range(2))
    out = A.attention_decode_rope(t["q"], Tensor.from_numpy(qw, "cpu"), Tensor.from_numpy(kw, "cpu"),
                                  Tensor.from_numpy(positions, "cpu"), Tensor.from_numpy(cos_sin, "cpu"), hq, 1e-6,
                                  t["k_cache"], t["v_cache"], Tensor.from_numpy(slots, "cpu"), t["kv_lens"],
                                  t["tables"], c["scale"], 40, k_scale=t["k_scale"], v_scale=t["v_scale"]).numpy()
    kc, vc = c["k_cache"].copy(), c["v_cache"].copy()
    rotated = qk_norm_rope_write_kv_reference(c["q"], qw, kw, positions, cos_sin, hq, hkv, 1e-6, kc, vc, slots,
                                              c["k_scale"], c["v_scale"])
    assert np.array_equal(t["k_cache"].array.view(np.uint8), kc.view(np.uint8))  # the new K quantized in place
    want = A.attention_decode_reference(rotated, kc, vc, c["kv_lens"], c["tables"], c["scale"], hq, np.float64,
                                        k_scale=c["k_scale"], v_scale=c["v_scale"])
    assert max(errors(out, want)) <= 1e-2


def test_qk_norm_rope_write_kv_fp8_kernels_exist():
    """qk_norm_rope_write_kv's FP8 names (rope.cu, the KvE4m3 instantiations) for every head_dim and steps variant."""
    import re

    from xserv.ops import rope as R
    from xserv.runtime.compiler import kernel_source_dir

    src = (kernel_source_dir() / "rope.cu").read_text()
    made = set(re.findall(r"^XSERV_(QK_NORM_ROPE|QK_ROPE)_WRITE_KV_FP8\((\d+), (\d)\)", src, re.M))
    for d in (64, 128):
        assert {("QK_NORM_ROPE", str(d), str(R._FUSED_STEPS)), ("QK_ROPE", str(d), str(R._FUSED_STEPS))} <= made


def rope_fp8_case(rng, t, hq, hkv, d, norm, bs=16, max_pos=4096):
    """Packed qkv over e4m3's range and past it (saturation, subnormals after the scale), head-norm weights (None:
    Llama), positions, slots with -1 padding entries, scales in [0.25, 2] and NaN-poisoned FP8 caches."""
    blocks = -(-t // bs) + 2
    slots = rng.permutation(blocks * bs)[:t].astype(np.int32)
    slots[1::5] = -1  # padding entries (a single token is written)
    qkv = (random_array(rng, (t, hq + 2 * hkv, d), np.float32, mean=0.3)
           * np.exp2(rng.uniform(-10, 9, (t, hq + 2 * hkv, 1)))).astype(bfloat16)
    return dict(qkv=qkv, qw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                kw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                pos=rng.integers(0, max_pos, t).astype(np.int32), table=rope_cos_sin_table(d, max_pos, 1e6),
                slots=slots, cache=np.full((blocks, bs, hkv, d), np.nan, np.float32).astype(E4M3),
                k_scale=_scales(rng, hkv), v_scale=_scales(rng, hkv), hq=hq, hkv=hkv)


def run_rope_fp8(c, device, fused=True):
    """(qkv, k_cache, v_cache) after qk_norm_rope_write_kv over the FP8 cache (fused), or after the two ops it
    replaces (qk_norm_rope / qk_rope in place, then write_kv_packed quantizing)."""
    to = lambda a: Tensor.from_numpy(a, device)
    qkv, kc, vc = to(c["qkv"].copy()), to(c["cache"].copy()), to(c["cache"].copy())
    w = (None, None) if c["qw"] is None else (to(c["qw"]), to(c["kw"]))
    ks, vs = to(c["k_scale"]), to(c["v_scale"])
    if fused:
        qk_norm_rope_write_kv(qkv, *w, to(c["pos"]), to(c["table"]), c["hq"], c["hkv"], 1e-6, kc, vc, to(c["slots"]),
                              k_scale=ks, v_scale=vs)
    else:
        if c["qw"] is None:
            qk_rope(qkv, to(c["pos"]), to(c["table"]), c["hq"], c["hkv"])
        else:
            qk_norm_rope(qkv, *w, to(c["pos"]), to(c["table"]), c["hq"], c["hkv"], 1e-6)
        A.write_kv_packed(qkv, c["hq"], kc, vc, to(c["slots"]), ks, vs)
    return qkv.numpy(), kc.numpy(), vc.numpy()


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_write_kv_fp8_cpu_is_the_composition(norm):
    rng = np.random.default_rng(30 + norm)
    c = rope_fp8_case(rng, 11, 4, 2, 64, norm, bs=4)
    got, want = run_rope_fp8(c, "cpu"), run_rope_fp8(c, "cpu", fused=False)
    np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    kept = c["slots"] >= 0
    vc = got[2].reshape(-1, 2, 64)
    np.testing.assert_array_equal(vc[c["slots"][kept]].view(np.uint8), F.quantize_kv_reference(
        c["qkv"][kept, 6:].astype(np.float32), c["v_scale"]).view(np.uint8))


# ---- GPU: the CUDA kernels against the NumPy path ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("packed, t", [(False, 1), (True, 37), (False, 300)])
def test_write_kv_fp8_cuda_codes_equal_the_reference(packed, t):
    rng = np.random.default_rng(10 + t)
    hq, hkv, d, bs, blocks = 8, 2, 128, 16, 40
    slots = rng.permutation(blocks * bs)[:t].astype(np.int32)
    if t > 1:
        slots[t // 2] = -1
    k_scale, v_scale = _scales(rng, hkv), _scales(rng, hkv)
    # values over e4m3's whole range and past it (saturation), subnormals, ties
    qkv = (random_array(rng, (t, hq + 2 * hkv, d), np.float32) * np.exp2(rng.uniform(-12, 10, (t, 1, d)))
           ).astype(bfloat16)
    nan_cache = np.full((blocks, bs, hkv, d), np.nan, np.float32).astype(E4M3)
    kc, vc = nan_cache.copy(), nan_cache.copy()
    gk, gv = Tensor.from_numpy(nan_cache, "cuda"), Tensor.from_numpy(nan_cache, "cuda")
    ks, vs = Tensor.from_numpy(k_scale, "cuda"), Tensor.from_numpy(v_scale, "cuda")
    slot_t = Tensor.from_numpy(slots, "cuda")
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    if packed:
        A.write_kv_packed(Tensor.from_numpy(qkv, "cuda"), hq, gk, gv, slot_t, ks, vs)
    else:
        A.write_kv(Tensor.from_numpy(np.ascontiguousarray(k), "cuda"), Tensor.from_numpy(np.ascontiguousarray(v), "cuda"),
                   gk, gv, slot_t, ks, vs)
    F.write_kv_fp8_reference(k, v, kc, vc, slots, k_scale, v_scale)
    assert np.array_equal(gk.numpy().view(np.uint8), kc.view(np.uint8))
    assert np.array_equal(gv.numpy().view(np.uint8), vc.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 1023])
@pytest.mark.parametrize("hq, hkv", [(16, 8), (14, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_write_kv_fp8_cuda_equals_the_two_ops(t, hq, hkv, d, norm):
    """The one-launch quantizing kernel (rope.cu, KvE4m3): qkv and both caches bit-identical to the two CUDA ops it
    replaces on the same NaN-poisoned buffers; V codes bit-equal to NumPy's quantization of the input; K and q close
    to the NumPy composition; unwritten slots stay NaN."""
    rng = np.random.default_rng(t * 7 + hq + d + norm)
    c = rope_fp8_case(rng, t, hq, hkv, d, norm)
    got, two = run_rope_fp8(c, "cuda"), run_rope_fp8(c, "cuda", fused=False)
    np.testing.assert_array_equal(got[0].view(np.uint16), two[0].view(np.uint16))
    for g, w in zip(got[1:], two[1:]):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    want = run_rope_fp8(c, "cpu")
    kept = c["slots"] >= 0
    assert 0 < kept.sum() < len(kept) or t == 1
    np.testing.assert_array_equal(got[2].view(np.uint8), want[2].view(np.uint8))  # V: no rounding before the write
    unused = np.setdiff1d(np.arange(got[1].shape[0] * got[1].shape[1]), c["slots"][kept])
    for cache in got[1:]:
        assert np.all(np.isnan(cache.reshape(-1, hkv, d)[unused].astype(np.float32)))
    rows = c["slots"][kept]
    k_got = F.dequantize_kv_reference(got[1].reshape(-1, hkv, d)[rows], c["k_scale"], np.float64)
    k_want = F.dequantize_kv_reference(want[1].reshape(-1, hkv, d)[rows], c["k_scale"], np.float64)
    if len(rows):
        assert np.linalg.norm(k_got - k_want) / np.linalg.norm(k_want) < 3e-2
    q_err = np.linalg.norm(got[0][:, :hq].astype(np.float64) - want[0][:, :hq].astype(np.float64))
    assert q_err / np.linalg.norm(want[0][:, :hq].astype(np.float64)) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (32, 8, 128), (16, 8, 64)])
def test_decode_rope_fp8_cuda_matches_numpy(hq, hkv, d):
    """attention_decode_rope over an FP8 cache (the fused v4 entry: q/k norm, RoPE, the quantizing write and the
    attention in one launch): the new K/V codes equal the NumPy composition's for V, K close; the output close to the
    NumPy composition."""
    rng = np.random.default_rng(40 + hq + d)
    bs = 16
    c = fp8_case(rng, [1, 1, 1], [512, 77, 1], hq, hkv, d, bs, packed=True)
    cos_sin = rope_cos_sin_table(d, 1024, 1e6)
    positions = (c["kv_lens"] - 1).astype(np.int32)
    slots = np.array([c["tables"][s, p // bs] * bs + p % bs for s, p in enumerate(positions)], np.int32)
    qw, kw = (random_array(rng, (d,), bfloat16, mean=1.0, std=0.1) for _ in range(2))
    outs, caches = {}, {}
    for device in ("cuda", "cpu"):
        t = tensors(c, device)
        to = lambda a: Tensor.from_numpy(a, device)
        outs[device] = A.attention_decode_rope(
            t["q"], to(qw), to(kw), to(positions), to(cos_sin), hq, 1e-6, t["k_cache"], t["v_cache"], to(slots),
            t["kv_lens"], t["tables"], c["scale"], 512, k_scale=t["k_scale"], v_scale=t["v_scale"]).numpy()
        caches[device] = (t["k_cache"].numpy(), t["v_cache"].numpy())
    np.testing.assert_array_equal(caches["cuda"][1].view(np.uint8), caches["cpu"][1].view(np.uint8))
    k_diff = caches["cuda"][0].view(np.uint8) != caches["cpu"][0].view(np.uint8)
    assert k_diff.sum() <= 0.05 * len(positions) * hkv * d  # the new K rows only, a few ulps of rounding apart
    mx, mean = errors(outs["cuda"], outs["cpu"].astype(np.float64))
    print(f"decode_rope fp8 {hq}/{hkv} d{d}: max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 2e-2


GPU_SHAPES = [(16, 8, 128), (32, 8, 128), (64, 8, 128), (16, 8, 64), (40, 8, 128)]  # G = 2, 4, 8, 2 (d64), 5


@pytest.mark.gpu
@pytest.mark.parametrize("context", [512, 8192])
@pytest.mark.parametrize("hq, hkv, d", GPU_SHAPES)
def test_decode_fp8_cuda_matches_numpy(context, hq, hkv, d):
    rng = np.random.default_rng(context + hq + d)
    c = fp8_case(rng, [1, 1, 1], [context, context // 2 + 3, 1], hq, hkv, d, 16)
    ref = A.attention_decode_reference(c["q"], c["k_cache"], c["v_cache"], c["kv_lens"], c["tables"], c["scale"],
                                       hq, np.float64, k_scale=c["k_scale"], v_scale=c["v_scale"])
    mx, mean = errors(run_decode(c, "cuda"), ref)
    print(f"decode fp8 ctx {context} {hq}/{hkv} d{d}: max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("context", [512, 8192])
@pytest.mark.parametrize("hq, hkv, d", GPU_SHAPES[:2] + GPU_SHAPES[3:4])
def test_prefill_fp8_cuda_matches_numpy(context, hq, hkv, d):
    rng = np.random.default_rng(context + hq + d + 1)
    chunk = 97  # a chunk after a cached prefix (what chunked prefill and prefix-cache hits read), and a decode row
    c = fp8_case(rng, [chunk, 1], [context, 33], hq, hkv, d, 16, packed=True)
    ref = A.attention_prefill_reference(c["q"], c["k_cache"], c["v_cache"], c["cu"], c["kv_lens"], c["tables"],
                                        c["scale"], hq, np.float64, k_scale=c["k_scale"], v_scale=c["v_scale"])
    mx, mean = errors(run_prefill(c, "cuda"), ref)
    print(f"prefill fp8 ctx {context} {hq}/{hkv} d{d}: max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 1e-2


@pytest.mark.gpu
def test_decode_fp8_cuda_zero_length_rows_are_zero():
    rng = np.random.default_rng(20)
    c = fp8_case(rng, [1, 1], [300, 1], 16, 8, 128, 16)
    c["kv_lens"][1] = 0
    out = run_decode(c, "cuda")
    assert np.all(out[1].astype(np.float32) == 0) and np.all(np.isfinite(out[0].astype(np.float32)))


# ---- v4 on an FP8 cache (attention_decode_fp8.cu: the bf16 kernels' bodies on e4m3 chunks) ------------------------
def _plan_of(c, variant):
    from xserv.ops.attention import decode as D
    from xserv.runtime import get_device

    hq, (_, bs, hkv, d) = c["hq"], c["k_cache"].shape
    return D.plan_decode(K.decode(variant), len(c["kv_lens"]), hkv, int(c["kv_lens"].max()), bs, d, hq // hkv,
                         get_device().multiprocessor_count)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4", "v4w4", "v2"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("context", [512, 8192])
@pytest.mark.parametrize("hq, hkv, d", GPU_SHAPES)
def test_decode_fp8_plans_cuda_match_numpy(variant, batch, context, hq, hkv, d):
    """attention_decode over an FP8 cache with each production plan (v4: the 8-warp CTAs at these few sequences, the
    query-head subgroups for G = 5 and 8; v4w4: 4-warp CTAs; v2: the fallback) at batch 1 (split grids: the folded
    combine) and 5 (ragged lengths, one of 1 key), into a NaN-poisoned output: close to the float64 reference of the
    dequantized cache, and a 2% error in v_scale fails the same check."""
    from xserv.testing import poisoned

    rng = np.random.default_rng(context + hq + d + batch)
    lens = [context] if batch == 1 else [context, context // 2 + 3, 1, 77, context - 5]
    c = fp8_case(rng, [1] * batch, lens, hq, hkv, d, 16)
    kernel, splits, _ = _plan_of(c, variant)
    assert kernel.variant == variant or (variant, kernel.variant) == ("v4", "v4w8")
    if batch == 1:
        assert splits > 1  # the split combine runs (v4: folded into the kernel; v2: attention_decode_combine)
    ref = A.attention_decode_reference(c["q"], c["k_cache"], c["v_cache"], c["kv_lens"], c["tables"], c["scale"],
                                       hq, np.float64, k_scale=c["k_scale"], v_scale=c["v_scale"])
    t = tensors(c, "cuda")
    out = poisoned((batch, hq, d), bfloat16)

    def run(v_scale):
        return A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"],
                                  max(lens), out=out, num_q_heads=hq, variant=K.decode(variant), k_scale=t["k_scale"],
                                  v_scale=v_scale).numpy()

    mx, mean = errors(run(t["v_scale"]), ref)
    print(f"decode fp8 {variant} ({kernel.variant}, {splits} splits) b{batch} ctx {context} {hq}/{hkv} d{d}: "
          f"max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 1e-2
    wrong = Tensor.from_numpy(c["v_scale"] * np.float32(1.02), "cuda")
    assert errors(run(wrong), ref)[0] > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant, lens", [("v4w4", [1000]), ("v4w4", [700, 1, 33, 1200, 15]),
                                           ("v4", "ragged64")])
@pytest.mark.parametrize("hq, hkv", [(32, 8), (24, 8), (16, 8), (8, 8), (64, 8), (40, 8), (32, 4)])  # G 4 3 2 1 8 5 8
def test_decode_fp8_mma_cuda_matches_numpy(monkeypatch, variant, lens, hq, hkv):
    """The 4-warp kernel's tensor-core form (scores and values by mma.sync on f16, the e4m3 codes
    exact, q rounded to f16) over a NaN-poisoned output: close to the float64 reference of the dequantized cache
    (every key of ragged lengths, 1 and 15 keys included, a batch of 64 through the plain v4 plan), and a 2% error in
    v_scale fails the same check. It agrees with the CUDA-core form (the other FP8 kernels' loop, still compiled for
    these shapes) to the same tolerance."""
    from xserv.ops.attention import decode as D
    from xserv.testing import poisoned

    rng = np.random.default_rng(hq + len(str(lens)))
    lens = list(rng.integers(1, 1500, 64)) if lens == "ragged64" else lens
    c = fp8_case(rng, [1] * len(lens), lens, hq, hkv, 128, 16)
    kernel, splits, _ = _plan_of(c, variant)
    assert kernel.variant == variant and kernel.subgroups == 1
    ref = A.attention_decode_reference(c["q"], c["k_cache"], c["v_cache"], c["kv_lens"], c["tables"], c["scale"],
                                       hq, np.float64, k_scale=c["k_scale"], v_scale=c["v_scale"])
    t = tensors(c, "cuda")

    has_mma = D.has_fp8_mma

    def run(v_scale, mma):
        monkeypatch.setattr(D, "has_fp8_mma", has_mma if mma else lambda *shape: False)
        out = poisoned((len(lens), hq, 128), bfloat16)
        return A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"],
                                  max(lens), out=out, num_q_heads=hq, variant=K.decode(variant), k_scale=t["k_scale"],
                                  v_scale=v_scale).numpy()

    got = run(t["v_scale"], True)
    assert not np.isnan(got.astype(np.float32)).any()
    mx, mean = errors(got, ref)
    print(f"decode fp8 mma {variant} ({splits} splits) b{len(lens)} {hq}/{hkv}: max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 1e-2
    assert errors(got, run(t["v_scale"], False))[0] <= 1e-2
    wrong = Tensor.from_numpy(c["v_scale"] * np.float32(1.02), "cuda")
    assert errors(run(wrong, True), ref)[0] > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", [(32, 8), (16, 8)])
def test_decode_rope_fp8_mma_writes_the_same_cache(monkeypatch, hq, hkv):
    """The fused entry's tensor-core form (attention_decode_rope through v4w4 at 5 sequences): the new K/V codes in
    the cache are the CUDA-core form's bytes, qkv is not modified, and the outputs agree within 1e-2."""
    from xserv.ops.attention import decode as D

    rng = np.random.default_rng(hq)
    c = _fp8_rope_case(rng, [700, 1, 33, 1200, 64], hq, hkv, 128)
    results, has_mma = {}, D.has_fp8_mma
    for mma in (False, True):
        monkeypatch.setattr(D, "has_fp8_mma", has_mma if mma else lambda *shape: False)
        results[mma] = _decode_rope_fp8(c, True, True, "v4w4")
    for a, b in zip(results[True][1:], results[False][1:]):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(results[True][0].astype(np.float32)).any()
    assert errors(results[True][0], results[False][0])[0] <= 1e-2


def _fp8_rope_case(rng, lens, hq, hkv, d, bs=16):
    """An FP8 case with the packed qkv of each sequence's new token (positions kv_len - 1, slots where the block
    table puts them), the RoPE table and head-norm weights."""
    c = fp8_case(rng, [1] * len(lens), lens, hq, hkv, d, bs, packed=True)
    c["positions"] = np.maximum(c["kv_lens"] - 1, 0).astype(np.int32)
    c["slots"] = np.array([c["tables"][s, p // bs] * bs + p % bs for s, p in enumerate(c["positions"])], np.int32)
    c["cos_sin"] = rope_cos_sin_table(d, max(lens) + 64, 1e6)
    c["qw"], c["kw"] = (random_array(rng, (d,), bfloat16, mean=1.0, std=0.1) for _ in range(2))
    return c


def _decode_rope_fp8(c, fused, norm, variant=None, device="cuda"):
    """(out, k_cache bytes, v_cache bytes, qkv after): the fused op (fused=True), or the quantizing rope kernel then
    attention_decode (the two ops the fused entry must equal bit for bit)."""
    from xserv.testing import poisoned

    t = tensors(c, device)
    to = lambda a: Tensor.from_numpy(a, device)  # noqa: E731
    hq, d = c["hq"], c["q"].shape[2]
    hkv = c["k_cache"].shape[2]
    qw, kw = (to(c["qw"]), to(c["kw"])) if norm else (None, None)
    out = poisoned((len(c["kv_lens"]), hq, d), bfloat16, device)
    max_kv = max(int(c["kv_lens"].max()), 512)
    if fused:
        A.attention_decode_rope(t["q"], qw, kw, to(c["positions"]), to(c["cos_sin"]), hq, 1e-6, t["k_cache"],
                                t["v_cache"], to(c["slots"]), t["kv_lens"], t["tables"], c["scale"], max_kv, out=out,
                                variant=K.decode(variant), k_scale=t["k_scale"], v_scale=t["v_scale"])
    else:
        qk_norm_rope_write_kv(t["q"], qw, kw, to(c["positions"]), to(c["cos_sin"]), hq, hkv, 1e-6, t["k_cache"],
                              t["v_cache"], to(c["slots"]), k_scale=t["k_scale"], v_scale=t["v_scale"])
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"], max_kv,
                           out=out, num_q_heads=hq, variant=K.decode(variant), k_scale=t["k_scale"], v_scale=t["v_scale"])
    return (out.numpy(), t["k_cache"].numpy().view(np.uint8), t["v_cache"].numpy().view(np.uint8), t["q"].numpy())


def test_decode_rope_fp8_paths_cpu_agree():
    """The GPU comparison's two paths on the CPU backend (both NumPy compositions): the same bits, qkv kept by the
    fused op."""
    c = _fp8_rope_case(np.random.default_rng(3), [70, 1, 300], 16, 8, 64)
    got, want = _decode_rope_fp8(c, True, True, device="cpu"), _decode_rope_fp8(c, False, True, device="cpu")
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    np.testing.assert_array_equal(got[3].view(np.uint16), c["q"].view(np.uint16))
    assert np.all(np.isfinite(got[0].astype(np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("lens", [[512], [1], [8192], [65, 520, 1000, 1, 4097]])
@pytest.mark.parametrize("hq, hkv, d", GPU_SHAPES + [(32, 4, 128)])
def test_decode_rope_fp8_fused_equals_quantizing_write_then_decode(hq, hkv, d, lens, norm):
    """The fused FP8 entry (one launch: the lean entry at short contexts, the full one at 8,192 keys, query-head
    subgroups for G = 5 and 8) against the quantizing rope kernel (qk_norm_rope_write_kv's KvE4m3: write_kv_fp8's
    bits) followed by attention_decode over the FP8 cache: both caches byte-identical (the new K/V codes, nothing
    else written), the output bit-identical, qkv left as it was; and near the NumPy composition."""
    rng = np.random.default_rng(sum(lens) + hq + d + norm)
    c = _fp8_rope_case(rng, lens, hq, hkv, d)
    got = _decode_rope_fp8(c, True, norm)
    want = _decode_rope_fp8(c, False, norm)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[0].view(np.uint16), want[0].view(np.uint16))
    np.testing.assert_array_equal(got[3].view(np.uint16), c["q"].view(np.uint16))  # fused: qkv read only
    cpu = {k: Tensor.from_numpy(c[k].copy(), "cpu") for k in ("q", "positions", "cos_sin", "k_cache", "v_cache",
                                                               "slots", "kv_lens", "tables", "k_scale", "v_scale")}
    qw, kw = (Tensor.from_numpy(c["qw"], "cpu"), Tensor.from_numpy(c["kw"], "cpu")) if norm else (None, None)
    ref = A.attention_decode_rope(cpu["q"], qw, kw, cpu["positions"], cpu["cos_sin"], hq, 1e-6, cpu["k_cache"],
                                  cpu["v_cache"], cpu["slots"], cpu["kv_lens"], cpu["tables"], c["scale"], max(lens),
                                  k_scale=cpu["k_scale"], v_scale=cpu["v_scale"]).numpy()
    mx, mean = errors(got[0], ref.astype(np.float64))
    print(f"decode_rope fp8 fused {hq}/{hkv} d{d} lens {lens}: max rel err {mx:.2e}, mean {mean:.2e}")
    assert mx <= 2e-2


@pytest.mark.gpu
def test_decode_rope_fp8_v2_fallback_is_two_launches_with_the_same_result():
    """variant v2 (the plan's fallback where a split's pages overflow v4's table): the quantizing rope kernel, then
    the FP8 v2 kernel and the combine; equal to running those two ops by hand, near the NumPy composition."""
    rng = np.random.default_rng(7)
    c = _fp8_rope_case(rng, [3000, 5], 16, 8, 128)
    got = _decode_rope_fp8(c, True, True, variant="v2")
    want = _decode_rope_fp8(c, False, True, variant="v2")
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    assert np.all(np.isfinite(got[0].astype(np.float32)))


def test_fp8_cache_takes_the_production_variants_only():
    """Over an FP8 cache the production variants plan as on bf16 (their kernels have e4m3 forms); a dev kernel (the
    dev registry's), which has none, is refused by both ops on every backend."""
    c = _fp8_rope_case(np.random.default_rng(5), [40, 3], 16, 8, 64)
    t = tensors(c, "cpu")
    for variant in ("v4", "v4w4", "v2"):
        out = A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"], 40,
                                 num_q_heads=16, variant=K.decode(variant), k_scale=t["k_scale"], v_scale=t["v_scale"])
        assert np.all(np.isfinite(out.numpy().astype(np.float32)))
    to = lambda a: Tensor.from_numpy(a, "cpu")  # noqa: E731
    for variant in (K.decode("v3"), K.decode("v4s3"), K.decode("v4w16")):
        with pytest.raises(ValueError, match="no FP8-cache kernels"):
            A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], c["scale"], 40,
                               num_q_heads=16, variant=variant, k_scale=t["k_scale"], v_scale=t["v_scale"])
        with pytest.raises(ValueError, match="no FP8-cache kernels"):
            A.attention_decode_rope(t["q"], None, None, to(c["positions"]), to(c["cos_sin"]), 16, 1e-6, t["k_cache"],
                                    t["v_cache"], to(c["slots"]), t["kv_lens"], t["tables"], c["scale"], 40,
                                    variant=variant, k_scale=t["k_scale"], v_scale=t["v_scale"])
