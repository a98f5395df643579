"""Qwen3.5's gated full attention on the attention ops: head_dim 256, partial RoPE (the first 64 dims, pairs
(i, i + 32), a 32-frequency table), the packed qkvg [T, 2 Hq + 2 Hkv, 256] whose trailing Hq gate heads every op
leaves untouched, the GQA groups 4, 6, 8, 16, and the output gate attn * sigmoid(gate). NumPy references against
independent float64 formulas (CPU), every kernel against the references on fresh random inputs with poisoned
outputs (GPU; natively and with XSERV_ARCH=sm_80)."""
import re

import numpy as np
import pytest

from xserv.ops import attention as A
from xserv.ops import rope as R
from xserv.ops.attention import decode as D
from xserv.ops.attention.fp8_kv import dequantize_kv_reference
from xserv.runtime.compiler import kernel_source_dir, startup_families
from xserv.tensor import Tensor, bfloat16, float8_e4m3fn
from xserv.testing import paged_kv_from_dense, poisoned, random_array, rel_error

D256, ROT, THETA, EPS = 256, 64, 1e7, 1e-6
# (Hq, Hkv): 8:2, 16:4, 24:4 (27B), 16:2, 32:2 -> groups 4, 4, 6, 8, 16
HEADS = [(8, 2), (16, 4), (24, 4), (16, 2), (32, 2)]
# bf16 outputs against float64: one bf16 rounding is 2^-9 relative; attention sums keep it near that (measured
# below 4e-3); 1e-2 still fails a wrong head, key, frequency or gate (errors of order 1).
TOL = 1e-2


def cpu(a):
    return Tensor.from_numpy(a, "cpu")


def dev(a):
    return Tensor.from_numpy(a, "cuda")


def inv_freq64(rotary: int, theta: float) -> np.ndarray:
    return theta ** (-np.arange(0, rotary, 2, dtype=np.float64) / rotary)


def partial_rope64(x, pos, rotary=ROT, theta=THETA):
    """float64 partial rotate-half RoPE of x [T, H, D] at positions pos: pairs (i, i + rotary/2), i < rotary/2."""
    x = np.asarray(x, np.float64).copy()
    ang = np.asarray(pos, np.float64)[:, None] * inv_freq64(rotary, theta)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = rotary // 2
    lo, hi = x[..., :h].copy(), x[..., h:rotary].copy()
    x[..., :h], x[..., h:rotary] = lo * c - hi * s, hi * c + lo * s
    return x


def rms64(x, w):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def qkvg_case(rng, t, hq, hkv, max_pos=4096, num_slots=None):
    """A packed qkvg with its head-norm weights (1 + w folded: around 1), positions, a 32-frequency table and slots
    (a few -1: padding tokens), NaN caches."""
    qkvg = random_array(rng, (t, 2 * hq + 2 * hkv, D256), bfloat16, mean=0.2)
    num_slots = num_slots or t + 5
    slots = rng.permutation(num_slots)[:t].astype(np.int32)
    if t > 2:
        slots[rng.choice(t, 2, replace=False)] = -1
    return dict(qkvg=qkvg, hq=hq, hkv=hkv, qw=random_array(rng, (D256,), bfloat16, mean=1.0, std=0.2),
                kw=random_array(rng, (D256,), bfloat16, mean=1.0, std=0.2),
                pos=rng.integers(0, max_pos, t).astype(np.int32), table=R.rope_cos_sin_table(ROT, max_pos, THETA),
                slots=slots, cache=np.full((num_slots, 1, hkv, D256), np.nan, bfloat16))


def qk64(c):
    """float64 expected q and k heads: head RMSNorm (rounded to bf16, as the model's q_norm / k_norm) then RoPE."""
    hq, hkv = c["hq"], c["hkv"]
    q = rms64(c["qkvg"][:, :hq], c["qw"]).astype(np.float32).astype(bfloat16)
    k = rms64(c["qkvg"][:, hq:hq + hkv], c["kw"]).astype(np.float32).astype(bfloat16)
    return partial_rope64(q, c["pos"]), partial_rope64(k, c["pos"])


def run_write(c, on, fp8=False):
    qkvg, kc, vc = on(c["qkvg"].copy()), on(c["cache"].copy()), on(c["cache"].copy())
    scales = {}
    if fp8:
        kc, vc = (on(np.zeros(c["cache"].shape, float8_e4m3fn)) for _ in range(2))
        scales = dict(k_scale=on(c["k_scale"]), v_scale=on(c["v_scale"]))
    R.qk_norm_rope_write_kv(qkvg, on(c["qw"]), on(c["kw"]), on(c["pos"]), on(c["table"]), c["hq"], c["hkv"], EPS,
                            kc, vc, on(c["slots"]), **scales)
    return qkvg.numpy(), kc.numpy(), vc.numpy()


def check_write(c, got, tol=TOL):
    """q/k heads normed and rotated, v and gate heads bit for bit as given, the cache holding k and v of kept tokens
    and NaN everywhere else."""
    qkvg, kc, vc = got
    hq, hkv = c["hq"], c["hkv"]
    q, k = qk64(c)
    assert rel_error(qkvg[:, :hq], q) < tol and rel_error(qkvg[:, hq:hq + hkv], k) < tol
    np.testing.assert_array_equal(qkvg[:, hq + hkv:].view(np.uint16), c["qkvg"][:, hq + hkv:].view(np.uint16))
    kept = c["slots"] >= 0
    kc, vc = kc.reshape(-1, hkv, D256), vc.reshape(-1, hkv, D256)
    assert rel_error(kc[c["slots"][kept]], k[kept]) < tol
    np.testing.assert_array_equal(vc[c["slots"][kept]].view(np.uint16),
                                  c["qkvg"][kept, hq + hkv:hq + 2 * hkv].view(np.uint16))
    unused = np.setdiff1d(np.arange(kc.shape[0]), c["slots"][kept])
    assert np.all(np.isnan(kc[unused].astype(np.float32))) and np.all(np.isnan(vc[unused].astype(np.float32)))


def attention_case(rng, q_lens, kv_lens, hq, hkv, block_size):
    """Zero-mean K/V in a permuted paged cache (unused slots NaN) and a gated qkvg of the new tokens."""
    ks = [random_array(rng, (n, hkv, D256), bfloat16, mean=0.0) for n in kv_lens]
    vs = [random_array(rng, (n, hkv, D256), bfloat16, mean=0.0) for n in kv_lens]
    k_cache, v_cache, tables = paged_kv_from_dense(rng, ks, vs, block_size)
    qkvg = random_array(rng, (sum(q_lens), 2 * hq + 2 * hkv, D256), bfloat16, mean=0.0)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    expected = np.concatenate([
        np.zeros((q_lens[s], hq, D256)) if kv_lens[s] == 0 else
        A.attention_reference(qkvg[cu[s]:cu[s + 1], :hq], ks[s], vs[s], 1 / 16) for s in range(len(q_lens))])
    return dict(qkvg=qkvg, k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu,
                kv_lens=np.array(kv_lens, np.int32), hq=hq, expected=expected)


# ---- references (CPU) ----------------------------------------------------------------------------------------------
def test_partial_table_and_rope_reference_vs_float64(rng):
    table = R.rope_cos_sin_table(ROT, 5000, THETA)
    assert table.shape == (5000, ROT)
    pos = np.arange(5000)
    ang = pos[:, None] * inv_freq64(ROT, THETA)[None, :]
    # float32 angles (as transformers): 5000 rad rounded to float32 moves cos/sin by up to ~2.4e-4
    assert np.max(np.abs(table - np.concatenate([np.cos(ang), np.sin(ang)], axis=1))) < 5e-4
    x = random_array(rng, (7, 3, D256), bfloat16)
    p = rng.integers(0, 5000, 7)
    got = R.rope_reference(x, p, table)
    assert rel_error(got, partial_rope64(x, p)) < 1e-5
    np.testing.assert_array_equal(got[..., ROT:], x[..., ROT:].astype(np.float32))  # dims 64..255 pass through


@pytest.mark.parametrize("hq, hkv", [(8, 2), (24, 4)])
def test_qk_norm_rope_write_kv_gated_cpu(rng, hq, hkv):
    c = qkvg_case(rng, 9, hq, hkv)
    check_write(c, run_write(c, cpu))


def test_output_gate_cpu(rng):
    attn = random_array(rng, (5, 6, D256), bfloat16)
    qkvg = random_array(rng, (5, 2 * 6 + 2 * 2, D256), bfloat16, std=3.0)
    out = A.attention_output_gate(cpu(attn), cpu(qkvg), 6, 2)
    want = attn.astype(np.float64) * sigmoid64(qkvg[:, 10:])
    assert rel_error(out.numpy(), want) < 4e-3
    t = cpu(attn.copy())
    A.attention_output_gate(t, cpu(qkvg), 6, 2, out=t)  # in place
    np.testing.assert_array_equal(t.numpy().view(np.uint16), out.numpy().view(np.uint16))


def test_attention_cpu_on_qkvg(rng):
    """Prefill and decode on the CPU backend read the queries out of the gated qkvg."""
    c = attention_case(rng, [3, 1], [10, 4], 16, 2, 4)
    t = {k: cpu(c[k]) for k in ("qkvg", "k_cache", "v_cache", "tables", "cu", "kv_lens")}
    out = A.attention_prefill(t["qkvg"], t["k_cache"], t["v_cache"], t["cu"], t["kv_lens"], t["tables"], 1 / 16, 3,
                              num_q_heads=16)
    assert rel_error(out.numpy(), c["expected"]) < TOL


def test_errors_name_the_argument(rng):
    c = qkvg_case(rng, 3, 8, 2)
    args = lambda **kw: {**dict(qkv=cpu(c["qkvg"]), q_weight=cpu(c["qw"]), k_weight=cpu(c["kw"]), positions=cpu(c["pos"]),
                                cos_sin=cpu(c["table"]), num_q_heads=8, num_kv_heads=2, eps=EPS,
                                k_cache=cpu(c["cache"]), v_cache=cpu(c["cache"].copy()),
                                slot_mapping=cpu(c["slots"])), **kw}
    with pytest.raises(ValueError, match="cos_sin"):  # a full-width table at head_dim 256
        R.qk_norm_rope_write_kv(**args(cos_sin=cpu(R.rope_cos_sin_table(D256, 16, THETA))))
    with pytest.raises(ValueError, match="q_weight, k_weight"):  # head_dim 256 has kernels with the norms only
        R.qk_norm_rope_write_kv(**args(q_weight=None, k_weight=None))
    with pytest.raises(ValueError, match="qkv"):  # neither qkv nor qkvg
        R.qk_norm_rope_write_kv(**args(qkv=cpu(c["qkvg"][:, :-1])))
    with pytest.raises(ValueError, match="qkv"):  # the plain ops have no head_dim 256 kernels
        R.qk_norm_rope(cpu(c["qkvg"][:, :12]), cpu(c["qw"]), cpu(c["kw"]), cpu(c["pos"]), cpu(c["table"]), 8, 2, EPS)
    cache = cpu(np.zeros((2, 4, 2, D256), bfloat16))
    q = cpu(np.zeros((1, 10, D256), bfloat16))
    lens, tables = cpu(np.ones(1, np.int32)), cpu(np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="num_q_heads / num_kv_heads = 5"):  # group 5 has no head_dim 256 kernels
        A.attention_decode(q, cache, cache, lens, tables, 1 / 16, 4)
    attn = cpu(np.zeros((2, 8, D256), bfloat16))
    with pytest.raises(ValueError, match="qkvg"):
        A.attention_output_gate(attn, cpu(np.zeros((2, 19, D256), bfloat16)), 8, 2)
    with pytest.raises(ValueError, match="attn"):
        A.attention_output_gate(attn, cpu(np.zeros((2, 20, D256), bfloat16)), 6, 2)


def test_plan_and_pieces():
    """Head dim 256 plans v2 (whatever production variant is asked), a group of 16 as 2 subgroups; the kernels load
    from attention_decode_d256's and attention_prefill_d256's pieces, which a start-up of a head-dim-256 model
    compiles on either path (and a head-dim-128 one does not)."""
    for variant in ("v4", "v4w8", "v2"):
        for g, r in D.D256_SUBGROUPS.items():
            k, splits, chunk = D.plan_decode(variant, 64, 4, 4096, 16, D256, g, 132)
            assert (k.generation, k.family, k.subgroups) == (2, "attention_decode_v2", r)
            assert splits * chunk >= 4096 and (splits - 1) * chunk < 4096
    assert D._module("attention_decode_v2", D256, 6) == "attention_decode_d256:d256_g6_k0"
    assert D._module(D.FP8_FAMILY, D256, 16, True) == "attention_decode_d256:d256_g16_k1"
    for target in ("sm_90a", "sm_80@sm_90a"):
        for fp8 in (0, 1):
            pieces = [n for n in startup_families(target, {"head_dim": D256, "group": 6, "kvfp8": fp8})
                      if n.startswith("attention") and ":" in n]
            assert pieces == [f"attention_decode_d256:d256_g6_k{fp8}", "attention_prefill_d256:d256"], target
        assert not any("d256" in n for n in startup_families(target, {"head_dim": 128, "group": 4}))


def test_kernels_exist():
    """Every name the launchers form for head_dim 256 is instantiated where they load it from."""
    src = kernel_source_dir()
    d256 = (src / "attention_decode_d256.cu").read_text()
    made = {("attention_decode_fp8_" if f == "FP8" else "attention_decode_") + f"d{d}_g{g}"
            for f, d, g, _ in re.findall(r"^XSERV_V2_SUBGROUPS_ENTRY\((\w+), (\d+), (\d+), (\d+)\)", d256, re.M)}
    subgroups = {int(g): int(r) for _, _, g, r in
                 re.findall(r"^XSERV_V2_SUBGROUPS_ENTRY\((\w+), (\d+), (\d+), (\d+)\)", d256, re.M)}
    assert subgroups == D.D256_SUBGROUPS
    v2 = D.DECODE_KERNELS["v2"]
    assert made == {n(D256, g) for g in A.GATED_HEAD_DIMS[D256] for n in (v2.name, v2.fp8_name)}
    assert "attention_decode_combine" in d256
    rope = (src / "rope.cu").read_text()
    for fp8 in ("", "_fp8"):
        assert re.search(rf"qk_norm_rope_write_kv{fp8}_d##D##_r##ROT##_s##STEPS", rope)
    assert re.search(rf"^XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL(_FP8)?\({D256}, {ROT}, {R._FUSED_STEPS}\)", rope, re.M)
    prefill = (src / "attention_prefill_d256.cu").read_text()
    v3 = re.findall(r"^XSERV_PREFILL_V3\((\d+), (\d+), (\d+), (\w+), (\w*), (\d+), (\d+), (\w*)\)", prefill, re.M)
    assert {f"attention_prefill_v3_d{d}_m{mt}w{w}{qs}_b{nb}{ks}" for d, mt, w, _, qs, nb, _, ks in v3} == {
        A.PREFILL_KERNELS["v3"][D256].name}
    assert A.PREFILL_KERNELS["simple"][D256].name in prefill
    assert {A.PREFILL_KERNELS[v][D256].family for v in ("v3", "simple")} == {"attention_prefill_d256"}
    assert "d256" not in (src / "attention_prefill.cu").read_text()  # Qwen3 models never compile it
    assert "attention_output_gate_bf16" in (src / "attention_gate.cu").read_text()


# ---- kernels (GPU) -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_cuda_qk_norm_rope_write_kv_gated(rng, t, hq, hkv):
    c = qkvg_case(rng, t, hq, hkv)
    check_write(c, run_write(c, dev))


@pytest.mark.gpu
def test_cuda_qk_norm_rope_write_kv_gated_bad_position(rng):
    c = qkvg_case(rng, 4, 8, 2, max_pos=64)
    c["pos"][2] = 64  # outside the table: NaN in that token's whole q / k rows, the other tokens as usual
    qkvg = run_write(c, dev)[0].astype(np.float32)
    assert np.all(np.isnan(qkvg[2, :10])) and np.all(np.isfinite(qkvg[[0, 1, 3]])) and np.all(np.isfinite(qkvg[:, 10:]))


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_cuda_prefill_d256(rng, hq, hkv, block_size):
    """Mixed chunks (a fresh prompt, a continuation, single tokens) read from the gated qkvg; the default kernel
    (v3 on every path at head_dim 256) and the simple cross-check."""
    c = attention_case(rng, [70, 1, 33, 1], [70, 200, 133, 1], hq, hkv, block_size)
    t = {k: dev(c[k]) for k in ("qkvg", "k_cache", "v_cache", "tables", "cu", "kv_lens")}
    for variant in (None, "simple"):
        out = poisoned((c["qkvg"].shape[0], hq, D256), bfloat16)
        A.attention_prefill(t["qkvg"], t["k_cache"], t["v_cache"], t["cu"], t["kv_lens"], t["tables"], 1 / 16, 70,
                            out=out, num_q_heads=hq, variant=variant)
        assert rel_error(out.numpy(), c["expected"]) < TOL, variant


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", HEADS)
@pytest.mark.parametrize("lens", [[1, 700, 0, 33], [3000]])
def test_cuda_decode_d256(rng, hq, hkv, lens):
    """One query per sequence from the gated qkvg; split grids (3000 keys) and an empty sequence (zero row)."""
    c = attention_case(rng, [1] * len(lens), lens, hq, hkv, 16)
    t = {k: dev(c[k]) for k in ("qkvg", "k_cache", "v_cache", "tables", "kv_lens")}
    out = poisoned((len(lens), hq, D256), bfloat16)
    A.attention_decode(t["qkvg"], t["k_cache"], t["v_cache"], t["kv_lens"], t["tables"], 1 / 16, max(lens), out=out,
                       num_q_heads=hq)
    assert rel_error(out.numpy(), c["expected"]) < TOL


def decode_rope_case(rng, lens, hq, hkv, block_size=16):
    """A decode batch of the gated layer: cached K/V (post-RoPE), the new tokens' raw qkvg, and what the fused op must
    give: the composition of the CPU references (norm, partial RoPE, cache write, attention)."""
    ks = [random_array(rng, (n, hkv, D256), bfloat16, mean=0.0) for n in lens]
    vs = [random_array(rng, (n, hkv, D256), bfloat16, mean=0.0) for n in lens]
    k_cache, v_cache, tables = paged_kv_from_dense(rng, ks, vs, block_size, fill=0.0)
    c = qkvg_case(rng, len(lens), hq, hkv)
    c["pos"] = np.array(lens, np.int32) - 1
    c["slots"] = np.array([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                           for s, n in enumerate(lens)], np.int32)
    c.update(k_cache=k_cache, v_cache=v_cache, tables=tables, kv_lens=np.array(lens, np.int32))
    return c


def run_decode_rope(c, on, fp8=False):
    scales = {}
    kc, vc = on(c["k_cache"].copy()), on(c["v_cache"].copy())
    if fp8:
        scales = dict(k_scale=on(c["k_scale"]), v_scale=on(c["v_scale"]))
    out = poisoned((len(c["kv_lens"]), c["hq"], D256), bfloat16, "cuda" if on is dev else "cpu")
    qkvg = on(c["qkvg"].copy())
    A.attention_decode_rope(qkvg, on(c["qw"]), on(c["kw"]), on(c["pos"]), on(c["table"]), c["hq"], EPS, kc, vc,
                            on(c["slots"]), on(c["kv_lens"]), on(c["tables"]), 1 / 16, int(c["kv_lens"].max()),
                            out=out, **scales)
    gate = qkvg.numpy()[:, c["hq"] + 2 * c["hkv"]:]
    return out.numpy(), kc.numpy(), vc.numpy(), gate


def test_decode_rope_cpu_vs_float64(rng):
    """The CPU composition the GPU op is checked by, against float64: the new token's normed, rotated q over the
    cached keys and its own normed, rotated k (written at its slot), the gate heads untouched; FP8 runs too."""
    c = decode_rope_case(rng, [1, 37, 40], 16, 2)
    out, kc, vc, gate = run_decode_rope(c, cpu)
    q, k = qk64(c)
    v = c["qkvg"][:, 18:20]
    for s, n in enumerate(c["kv_lens"]):
        rows = [(int(b), i) for i, b in enumerate(c["tables"][s][: -(-n // 16)])]
        keys = np.concatenate([c["k_cache"][b] for b, _ in rows])[: n - 1]
        vals = np.concatenate([c["v_cache"][b] for b, _ in rows])[: n - 1]
        want = A.attention_reference(q[s:s + 1], np.concatenate([keys, k[s:s + 1]]),
                                     np.concatenate([vals, v[s:s + 1]]), 1 / 16)
        assert rel_error(out[s:s + 1], want) < TOL
    assert rel_error(kc.reshape(-1, 2, D256)[c["slots"]], k) < TOL
    np.testing.assert_array_equal(gate.view(np.uint16), c["qkvg"][:, 20:].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", HEADS)
@pytest.mark.parametrize("lens", [[1, 37, 600], [2500]])
def test_cuda_decode_rope_d256(rng, hq, hkv, lens):
    """The fused decode op at head_dim 256 (norm, partial RoPE and KV write, then v2) against the CPU composition of
    the references; the gate heads come out untouched."""
    c = decode_rope_case(rng, lens, hq, hkv)
    got, want = run_decode_rope(c, dev), run_decode_rope(c, cpu)
    assert rel_error(got[0], want[0]) < TOL
    for g, w in zip(got[1:3], want[1:3]):
        assert rel_error(g.astype(np.float32), w.astype(np.float32)) < 3e-3
    np.testing.assert_array_equal(got[3].view(np.uint16), c["qkvg"][:, hq + 2 * hkv:].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv", [(24, 4), (32, 2)])
def test_cuda_fp8_kv_d256(rng, hq, hkv):
    """The FP8 (e4m3) cache at head_dim 256: the quantizing fused write and v2's e4m3 kernel (decode) against the
    CPU op, which quantizes and dequantizes with the references."""
    from xserv.ops.attention.fp8_kv import quantize_kv_reference

    c = decode_rope_case(rng, [5, 900, 64], hq, hkv)
    c["k_scale"] = (0.04 * (1 + np.arange(hkv))).astype(np.float32)
    c["v_scale"] = np.full(hkv, 0.03, np.float32)
    c["k_cache"] = quantize_kv_reference(c["k_cache"], c["k_scale"]).astype(float8_e4m3fn)
    c["v_cache"] = quantize_kv_reference(c["v_cache"], c["v_scale"]).astype(float8_e4m3fn)
    got, want = run_decode_rope(c, dev, fp8=True), run_decode_rope(c, cpu, fp8=True)
    assert rel_error(got[0], want[0]) < TOL
    for g, w, s in zip(got[1:3], want[1:3], (c["k_scale"], c["v_scale"])):
        gd, wd = dequantize_kv_reference(g, s), dequantize_kv_reference(w, s)
        assert rel_error(gd, wd) < 2e-2  # a code may round the other way where RoPE's last bit differs


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 513])
@pytest.mark.parametrize("hq, hkv", [(8, 2), (24, 4), (32, 2)])
def test_cuda_output_gate(rng, t, hq, hkv):
    attn = random_array(rng, (t, hq, D256), bfloat16)
    qkvg = random_array(rng, (t, 2 * hq + 2 * hkv, D256), bfloat16, std=3.0)
    want = attn.astype(np.float64) * sigmoid64(qkvg[:, hq + 2 * hkv:])
    out = poisoned((t, hq, D256), bfloat16)
    A.attention_output_gate(dev(attn), dev(qkvg), hq, hkv, out=out)
    assert rel_error(out.numpy(), want) < 4e-3  # one bf16 rounding (2^-9) of each product, and __expf
    inplace = dev(attn)
    A.attention_output_gate(inplace, dev(qkvg), hq, hkv, out=inplace)
    np.testing.assert_array_equal(inplace.numpy().view(np.uint16), out.numpy().view(np.uint16))
