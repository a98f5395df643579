import math

import numpy as np
import pytest

from xserv.ops import attention as A
from xserv.tensor import Tensor, bfloat16
from xserv.testing import poisoned, random_array, rel_error

TOL = 1e-2


def make_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size, packed=False):
    """Dense per-sequence K/V scattered into a permuted paged cache (unused slots NaN), and packed queries."""
    ks = [random_array(rng, (n, num_kv_heads, head_dim), bfloat16) for n in kv_lens]
    vs = [random_array(rng, (n, num_kv_heads, head_dim), bfloat16) for n in kv_lens]
    k_cache, v_cache, tables = A.paged_kv_from_dense(rng, ks, vs, block_size)
    heads = num_q_heads + (2 * num_kv_heads if packed else 0)
    q = random_array(rng, (sum(q_lens), heads, head_dim), bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu, kv_lens=np.array(kv_lens, np.int32),
                ks=ks, vs=vs, num_q_heads=num_q_heads, scale=1.0 / math.sqrt(head_dim))


def dense_expected(case):
    """The independent dense float64 formula, sequence by sequence."""
    cu, hq = case["cu"], case["num_q_heads"]
    return np.concatenate([A.attention_reference(case["q"][cu[s]:cu[s + 1], :hq], case["ks"][s], case["vs"][s],
                                                 case["scale"]) for s in range(len(cu) - 1)])


def on(device, case):
    return {k: Tensor.from_numpy(case[n], device) for k, n in
            (("q", "q"), ("k_cache", "k_cache"), ("v_cache", "v_cache"), ("block_tables", "tables"),
             ("cu_seqlens_q", "cu"), ("kv_lens", "kv_lens"))}


MIXED = ([1, 63, 64, 65, 100], [1, 63, 200, 65, 1000])  # q_len <= kv_len, q_len < kv_len for some


# ---------------------------------------------------------------------------------------------------------------
# CPU: references and argument checks
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_prefill_reference_matches_dense(rng, head_dim, hq, hkv):
    case = make_case(rng, *MIXED, hq, hkv, head_dim, block_size=16)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64, q_block=37)
    assert rel_error(ref, dense_expected(case)) < 1e-12


@pytest.mark.parametrize("packed", [False, True])
def test_prefill_cpu_op(rng, packed):
    case = make_case(rng, *MIXED, 8, 2, 64, block_size=32, packed=packed)
    t = on("cpu", case)
    out = A.attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                              case["scale"], max_q_len=100, num_q_heads=8 if packed else None)
    assert out.shape == (sum(MIXED[0]), 8, 64) and out.dtype == bfloat16
    assert rel_error(out.numpy(), dense_expected(case)) < TOL


@pytest.mark.parametrize("packed", [False, True])
def test_decode_cpu_op(rng, packed):
    kv_lens = [1, 63, 64, 65, 1000]
    case = make_case(rng, [1] * 5, kv_lens, 8, 4, 128, block_size=16, packed=packed)
    t = on("cpu", case)
    out = A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                             max_kv_len=1000, num_q_heads=8 if packed else None)
    assert rel_error(out.numpy(), dense_expected(case)) < TOL


def test_write_kv_cpu(rng):
    T, hq, hkv, d, bs, nb = 7, 4, 2, 64, 16, 3
    qkv = random_array(rng, (T, hq + 2 * hkv, d), bfloat16)
    slots = np.array([5, -1, 0, 47, 16, -1, 30], np.int32)
    kc = Tensor.from_numpy(np.zeros((nb, bs, hkv, d), bfloat16), "cpu")
    vc = Tensor.from_numpy(np.zeros((nb, bs, hkv, d), bfloat16), "cpu")
    A.write_kv_packed(Tensor.from_numpy(qkv, "cpu"), hq, kc, vc, Tensor.from_numpy(slots, "cpu"))
    kflat, vflat = kc.numpy().reshape(-1, hkv, d), vc.numpy().reshape(-1, hkv, d)
    for t, s in enumerate(slots):
        if s >= 0:
            assert np.array_equal(kflat[s], qkv[t, hq:hq + hkv]) and np.array_equal(vflat[s], qkv[t, hq + hkv:])
    assert np.count_nonzero(np.abs(kflat.astype(np.float32)).sum(axis=(1, 2))) == 5


def test_argument_errors(rng):
    case = make_case(rng, [3], [5], 4, 2, 64, block_size=16)
    t = on("cpu", case)
    call = dict(k_cache=t["k_cache"], v_cache=t["v_cache"], cu_seqlens_q=t["cu_seqlens_q"], kv_lens=t["kv_lens"],
                block_tables=t["block_tables"], scale=0.125, max_q_len=3)
    with pytest.raises(ValueError, match="q"):
        A.attention_prefill(Tensor.from_numpy(case["q"].astype(np.float32), "cpu"), **call)
    with pytest.raises(ValueError, match="q"):  # 5 heads: neither 4 nor 4 + 2*2
        A.attention_prefill(Tensor.from_numpy(np.zeros((3, 5, 64), bfloat16), "cpu"), **dict(call), num_q_heads=4)
    with pytest.raises(ValueError, match="num_q_heads"):  # 3 query heads over 2 kv heads
        A.attention_prefill(Tensor.from_numpy(np.zeros((3, 3, 64), bfloat16), "cpu"), **call)
    with pytest.raises(ValueError, match="head_dim"):
        A.attention_prefill(Tensor.from_numpy(np.zeros((3, 4, 32), bfloat16), "cpu"),
                            **dict(call, k_cache=Tensor.from_numpy(np.zeros((2, 16, 2, 32), bfloat16), "cpu"),
                                   v_cache=Tensor.from_numpy(np.zeros((2, 16, 2, 32), bfloat16), "cpu")))
    with pytest.raises(ValueError, match="kv_lens"):
        A.attention_prefill(t["q"], **dict(call, kv_lens=Tensor.from_numpy(np.array([5, 5], np.int32), "cpu")))
    with pytest.raises(ValueError, match="block_tables"):
        A.attention_prefill(t["q"], **dict(call, block_tables=Tensor.from_numpy(np.zeros((2, 1), np.int32), "cpu")))
    with pytest.raises(ValueError, match="v_cache"):
        A.attention_prefill(t["q"], **dict(call, v_cache=Tensor.from_numpy(np.zeros((1, 16, 2, 64), bfloat16), "cpu")))
    with pytest.raises(ValueError, match="out"):
        A.attention_prefill(t["q"], **call, out=Tensor.from_numpy(np.zeros((3, 4, 64), np.float32), "cpu"))
    with pytest.raises(ValueError, match="slot_mapping"):
        A.write_kv(Tensor.from_numpy(np.zeros((3, 2, 64), bfloat16), "cpu"),
                   Tensor.from_numpy(np.zeros((3, 2, 64), bfloat16), "cpu"), t["k_cache"], t["v_cache"],
                   Tensor.from_numpy(np.zeros((4,), np.int32), "cpu"))
    with pytest.raises(ValueError, match="kv_lens"):
        A.attention_decode(t["q"][:1], t["k_cache"], t["v_cache"], t["kv_lens"][:0], t["block_tables"], 0.125, 5)


def test_decode_plan():
    assert A.decode_plan(1, 8, 32768, 132) == (64, 512)  # one long sequence still fills the chip
    splits, chunk = A.decode_plan(64, 8, 4096, 132)
    assert splits * chunk >= 4096 and splits <= 2
    assert A.decode_plan(4, 8, 1, 132) == (1, 64)


# ---------------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------------

def run_prefill_gpu(case, impl="fa2", warps=4, packed=False):
    t = on("cuda", case)
    hq = case["num_q_heads"]
    out = poisoned((case["q"].shape[0], hq, case["q"].shape[2]), bfloat16)
    max_q = int(np.diff(case["cu"]).max())
    A._prefill_cuda(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                    case["scale"], max_q, out, hq, impl, warps)
    return out.numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("impl,warps", [("fa2", 4), ("fa2", 8), ("simple", 4)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 4, 16), (8, 4, 32), (16, 4, 256), (16, 2, 64)])
def test_prefill_gpu(rng, impl, warps, head_dim, hq, hkv, block_size):
    case = make_case(rng, *MIXED, hq, hkv, head_dim, block_size)
    out = run_prefill_gpu(case, impl, warps)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64)
    assert rel_error(out, ref) < TOL


@pytest.mark.gpu
def test_prefill_gpu_packed_and_public(rng):
    case = make_case(rng, [5, 130, 64], [5, 300, 1000], 8, 2, 128, 16, packed=True)
    t = on("cuda", case)
    out = A.attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                              case["scale"], max_q_len=130, num_q_heads=8, out=poisoned((199, 8, 128), bfloat16))
    assert rel_error(out.numpy(), dense_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gpu_noncausal(rng, head_dim):
    case = make_case(rng, [1, 70, 129], [1, 300, 129], 8, 2, head_dim, 16)
    t = on("cuda", case)
    out = A.attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                              case["scale"], max_q_len=129, causal=False)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64, causal=False)
    assert rel_error(out.numpy(), ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["fa2", "v3", "v4", "v5"])
def test_prefill_gpu_long(rng, family):
    # a 4096-token prompt from scratch, and a 64-token chunk at the end of a 32768-token context
    case = make_case(rng, [4096, 64], [4096, 32768], 4, 1, 128, 16)
    impl = family if family == "fa2" else prefill_variants(family, 128)[0]
    out = run_prefill_gpu(case, impl)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64)
    assert rel_error(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (16, 4), (40, 8), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("packed", [False, True])
def test_decode_gpu(rng, head_dim, hq, hkv, block_size, packed):
    kv_lens = [1, 63, 64, 65, 1000, 3000]
    case = make_case(rng, [1] * len(kv_lens), kv_lens, hq, hkv, head_dim, block_size, packed=packed)
    t = on("cuda", case)
    out = poisoned((len(kv_lens), hq, head_dim), bfloat16)
    A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                       max_kv_len=4096, out=out, num_q_heads=hq)
    assert rel_error(out.numpy(), dense_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_gpu_long(rng, num_seqs):
    kv_lens = [32768, 5, 20000][:num_seqs]
    case = make_case(rng, [1] * num_seqs, kv_lens, 32, 8, 128, 16)
    t = on("cuda", case)
    out = poisoned((num_seqs, 32, 128), bfloat16)
    A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                       max_kv_len=32768, out=out)
    ref = A.attention_decode_reference(case["q"], case["k_cache"], case["v_cache"], case["kv_lens"], case["tables"],
                                       case["scale"], dtype=np.float64)
    assert rel_error(out.numpy(), ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_write_kv_gpu(rng, packed):
    T, hq, hkv, d, bs, nb = 37, 8, 2, 128, 16, 5
    qkv = random_array(rng, (T, hq + 2 * hkv, d), bfloat16)
    slots = rng.permutation(nb * bs)[:T].astype(np.int32)
    slots[[3, 10]] = -1
    kc0 = np.full((nb, bs, hkv, d), np.nan, bfloat16)
    kref, vref = kc0.copy(), kc0.copy()
    A.write_kv_reference(qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], kref, vref, slots)
    kc, vc = Tensor.from_numpy(kc0), Tensor.from_numpy(kc0)
    if packed:
        A.write_kv_packed(Tensor.from_numpy(qkv), hq, kc, vc, Tensor.from_numpy(slots))
    else:
        A.write_kv(Tensor.from_numpy(np.ascontiguousarray(qkv[:, hq:hq + hkv])),
                   Tensor.from_numpy(np.ascontiguousarray(qkv[:, hq + hkv:])), kc, vc, Tensor.from_numpy(slots))
    np.testing.assert_array_equal(kc.numpy().view(np.uint16), kref.view(np.uint16))
    np.testing.assert_array_equal(vc.numpy().view(np.uint16), vref.view(np.uint16))


# ---------------------------------------------------------------------------------------------------------------
# Decode v3 (tensor cores) next to v2: both must stay correct, whichever is the default
# ---------------------------------------------------------------------------------------------------------------

DECODE_VARIANTS = ["v2", "v3", "v3s3", "v4"]


def test_decode_plan_v3():
    # one long sequence: one full wave of resident CTAs (3 per SM), chunk a multiple of 64
    splits, chunk = A.decode_plan(1, 8, 32768, 132, 3, True)
    assert chunk % 64 == 0 and splits * chunk >= 32768 and 0.9 * 396 <= 8 * splits <= 396
    # a big batch: the last wave well filled
    splits, chunk = A.decode_plan(64, 8, 4096, 132, 3, True)
    ctas = 512 * splits
    assert ctas / (-(-ctas // 396) * 396) > 0.9 and splits * chunk >= 4096
    assert A.decode_plan(4, 8, 1, 132, 3, True) == (1, 64)
    for b, hkv, n in [(1, 1, 100), (3, 4, 20000), (200, 8, 700)]:
        splits, chunk = A.decode_plan(b, hkv, n, 132, 2, True)
        assert chunk % 64 == 0 and (splits - 1) * chunk < n <= splits * chunk


def test_fast_div():
    n = np.concatenate([np.arange(0, 1 << 16), np.arange((1 << 31) - 4096, 1 << 31)]).astype(np.uint64)
    for d in list(range(1, 257)) + [1000, 4096]:
        magic, shift = A._fast_div(d)
        assert 0 < magic < 1 << 32
        q = (((n * np.uint64(magic)) >> np.uint64(32)) + n) >> np.uint64(shift)
        assert np.array_equal(q, n // np.uint64(d)), d


def test_decode_plan_v4():
    # the split's pages fit v4's shared page table (ceil(chunk / block) + 1 entries) wherever 256 splits allow
    for b, n, block in [(1, 32768, 16), (64, 4096, 16), (64, 32768, 8), (2, 131072, 8), (3, 20000, 48)]:
        cap = (A._V4_TAB_CAP - 1) * block // 64 * 64
        splits, chunk = A.decode_plan(b, 8, n, 132, A._v4_resident(4, 2), True, max_chunk=cap)
        assert chunk % 64 == 0 and (splits - 1) * chunk < n <= splits * chunk
        assert -(-chunk // block) + 1 <= A._V4_TAB_CAP
    assert A.decode_plan(1, 8, 32768, 132, 4, True, max_chunk=4032) == (64, 512)


def test_decode_variant_error(rng):
    case = make_case(rng, [1], [5], 4, 2, 64, block_size=16)
    t = on("cpu", case)
    with pytest.raises(ValueError, match="variant"):
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], 0.125, 5,
                           variant="v9")


def decode_expected(case):
    """dense_expected, with zero rows for kv_len == 0."""
    hq, d = case["num_q_heads"], case["q"].shape[2]
    rows = [np.zeros((1, hq, d)) if n == 0 else
            A.attention_reference(case["q"][s:s + 1, :hq], case["ks"][s], case["vs"][s], case["scale"])
            for s, n in enumerate(case["kv_lens"])]
    return np.concatenate(rows)


def run_decode_gpu(case, variant, max_kv_len, out=None):
    t = on("cuda", case)
    hq = case["num_q_heads"]
    out = poisoned((case["q"].shape[0], hq, case["q"].shape[2]), bfloat16) if out is None else out
    A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                       max_kv_len=max_kv_len, out=out, num_q_heads=hq, variant=variant)
    return out.numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size,packed", [(4, 4, 16, False), (8, 4, 32, True), (16, 4, 256, False),
                                                      (40, 8, 64, True), (16, 2, 16, False), (12, 4, 48, True),
                                                      (24, 4, 128, False), (28, 4, 16, True), (8, 8, 8, False)])
def test_decode_gpu_variants(rng, variant, head_dim, hq, hkv, block_size, packed):
    # lengths around the 16-key block and 64-key chunk edges, an empty (padding) row, and long ones
    kv_lens = [0, 1, 15, 16, 17, 63, 65, 200, 1000, 3000, 4096]
    case = make_case(rng, [1] * len(kv_lens), kv_lens, hq, hkv, head_dim, block_size, packed=packed)
    out = run_decode_gpu(case, variant, 4096)
    assert rel_error(out, decode_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_gpu_long_variants(rng, variant, num_seqs):
    kv_lens = [32768, 5, 20000][:num_seqs]
    case = make_case(rng, [1] * num_seqs, kv_lens, 32, 8, 128, 16)
    out = run_decode_gpu(case, variant, 32768)
    ref = A.attention_decode_reference(case["q"], case["k_cache"], case["v_cache"], case["kv_lens"], case["tables"],
                                       case["scale"], dtype=np.float64)
    assert rel_error(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4s3", "v4s4", "v4n"])
@pytest.mark.parametrize("head_dim,hq,hkv,block_size", [(128, 32, 8, 16), (128, 16, 8, 48), (64, 16, 8, 8)])
def test_decode_gpu_v4_experiments(rng, variant, head_dim, hq, hkv, block_size):
    # the v4 experiment kernels exist for the benchmark's (head_dim, group) shapes only
    kv_lens = [0, 1, 15, 17, 65, 1000, 4096]
    case = make_case(rng, [1] * len(kv_lens), kv_lens, hq, hkv, head_dim, block_size)
    out = run_decode_gpu(case, variant, 4096)
    assert rel_error(out, decode_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v3", "v3s3", "v4"])
def test_decode_gpu_graph_replays(rng, variant):
    """Split counters reset themselves: eager calls and graph replays give the same rows, call after call."""
    from xserv.runtime.graphs import CUDAGraph

    kv_lens = [5000, 0, 77, 1]
    case = make_case(rng, [1] * 4, kv_lens, 16, 4, 128, 16)
    t = on("cuda", case)
    expected = decode_expected(case)
    out = poisoned((4, 16, 128), bfloat16)

    def step():
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                           max_kv_len=8192, out=out, variant=variant)

    step()
    first = out.numpy()
    assert rel_error(first, expected) < TOL
    step()
    assert np.array_equal(out.numpy().view(np.uint16), first.view(np.uint16))
    graph = CUDAGraph()
    with graph.capture():
        step()
    for _ in range(3):
        out.copy_(np.full((4, 16, 128), np.nan, bfloat16))
        graph.replay()
        assert np.array_equal(out.numpy().view(np.uint16), first.view(np.uint16))
    graph.close()


# ---------------------------------------------------------------------------------------------------------------
# v3 (mma.sync) and v4 (wgmma, sm_90a) prefill variants: every compiled variant; block sizes that split a thread's
# rows across pages included
# ---------------------------------------------------------------------------------------------------------------

def test_v3_variant_names():
    for d, variants in A.V3_VARIANTS.items():
        assert A.V3_DEFAULT[d] in variants
        for v in variants:
            mt, w, bkv = A._v3_shape(v)
            assert mt in (1, 2) and w in (4, 8) and bkv in (32, 64)
    with pytest.raises(ValueError):
        A._v3_shape("m3")


def test_v4_variant_names():
    for d, variants in A.V4_VARIANTS.items():
        assert A.V4_DEFAULT[d] in variants
        for v in variants:
            warpgroups, bkv = A._v4_shape(v)
            assert warpgroups in (1, 2, 3) and bkv in (64, 128)
    with pytest.raises(ValueError):
        A._v4_shape("m2w4")


def test_v5_variant_names():
    for d, variants in A.V5_VARIANTS.items():
        assert A.V5_DEFAULT[d] in variants
        for v in variants:
            warpgroups, bkv, stages = A._v5_shape(v)
            assert warpgroups in (2, 3) and bkv in (64, 128) and 2 <= stages <= 4
    with pytest.raises(ValueError):
        A._v5_shape("w2_k128")


def prefill_variants(family: str, head_dim: int) -> list[str]:
    """Every compiled variant of a kernel family ("v3", "v4", "v5") for head_dim, as _prefill_cuda impl names
    (v5 falls back to v4 where the block size rules out the TMA)."""
    if family in ("v4", "v5"):
        from xserv.runtime import get_device

        if get_device().arch != "sm_90a":
            pytest.skip(f"{family} prefill needs sm_90a")
        variants = A.V4_VARIANTS if family == "v4" else A.V5_VARIANTS
        return [f"{family}_{v}" for v in variants[head_dim]]
    return [f"v3_{v}" for v in A.V3_VARIANTS[head_dim]]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v3", "v4", "v5"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 4, 16), (8, 4, 20), (16, 4, 256), (16, 2, 64), (8, 1, 48)])
def test_prefill_gpu_variants(rng, family, head_dim, hq, hkv, block_size):
    case = make_case(rng, *MIXED, hq, hkv, head_dim, block_size)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64)
    for impl in prefill_variants(family, head_dim):
        out = run_prefill_gpu(case, impl)
        assert rel_error(out, ref) < TOL, impl


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_size", [8, 16, 128, 256])
def test_prefill_gpu_v4_copy_paths(rng, monkeypatch, tma, block_size):
    # v4 with and without TMA copies: lengths that end mid-page and mid-tile, NaN in every unused cache slot
    case = make_case(rng, [1, 37, 300, 129], [1, 300, 1000, 129], 8, 2, 128, block_size)
    monkeypatch.setattr(A, "PREFILL_TMA", tma)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64)
    for impl in prefill_variants("v4", 128) + prefill_variants("v5", 128):
        assert rel_error(run_prefill_gpu(case, impl), ref) < TOL, impl


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v3", "v4", "v5"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gpu_noncausal_chunked(rng, family, head_dim):
    # non-causal with tails, and causal chunks at the end of longer contexts (offset kv_len - q_len)
    case = make_case(rng, [1, 70, 129, 200], [1, 300, 129, 1111], 8, 2, head_dim, 32)
    t = on("cuda", case)
    max_q = int(np.diff(case["cu"]).max())
    for causal in (False, True):
        ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"],
                                            case["kv_lens"], case["tables"], case["scale"], dtype=np.float64,
                                            causal=causal)
        for variant in prefill_variants(family, head_dim):
            out = poisoned((case["q"].shape[0], 8, head_dim), bfloat16)
            A._prefill_cuda(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                            case["scale"], max_q, out, 8, variant, 0, causal)
            assert rel_error(out.numpy(), ref) < TOL, (variant, causal)
