import dataclasses
import functools
import math
import os
import re

import numpy as np
import pytest

from tools.dev import kernels as K
from xserv.ops import attention as A
from xserv.ops.attention import decode as D
from xserv.ops.attention import prefill as P
from xserv.ops.rope import rope_cos_sin_table
from xserv.runtime.compiler import family_shapes, kernel_source_dir
from xserv.tensor import Tensor, bfloat16
from xserv.testing import paged_kv_from_dense, poisoned, random_array, rel_error

TOL = 1e-2
V4W4 = K.DEV_DECODE["v4w4"]  # v4's 4-warp CTAs at every grid (the dev registry's A/B form)
# Long contexts: zero-mean data, the error of the worst output row (row_error), and a tolerance that a misplaced KV page or a 2% softmax-scale error exceeds (both
# are planted below, on the CPU path and in the GPU kernels' inputs, to show it). Measured error of the kernels:
# docs/kernels/attention.md ("Tests").
TOL_LONG = 4e-3

# Development kernels (cuda_src/dev/, named by tools/dev/kernels.py) are tested on the GPU on request:
# XSERV_DEV_TESTS=1 python -m pytest -m "gpu and dev" ...
def dev(test):
    skip = pytest.mark.skipif(not os.environ.get("XSERV_DEV_TESTS"), reason="dev kernels: set XSERV_DEV_TESTS=1")
    return pytest.mark.dev(skip(test))


def row_error(out, ref) -> float:
    """The largest relative error of one token's output row [Hq, D]: a batch-wide norm would let the large rows of
    short contexts hide an error in the small ones of a long context (an average over many keys)."""
    out = np.asarray(out, np.float64).reshape(len(ref), -1)
    ref = np.asarray(ref, np.float64).reshape(len(ref), -1)
    if not np.all(np.isfinite(out)):
        return float("inf")
    norms = np.linalg.norm(ref, axis=1)
    return float(np.max(np.linalg.norm(out - ref, axis=1) / np.where(norms > 0, norms, 1.0)))


def make_case(rng, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size, packed=False):
    """Dense per-sequence zero-mean K/V scattered into a permuted paged cache (unused slots NaN), packed queries."""
    ks = [random_array(rng, (n, num_kv_heads, head_dim), bfloat16, mean=0.0) for n in kv_lens]
    vs = [random_array(rng, (n, num_kv_heads, head_dim), bfloat16, mean=0.0) for n in kv_lens]
    k_cache, v_cache, tables = paged_kv_from_dense(rng, ks, vs, block_size)
    heads = num_q_heads + (2 * num_kv_heads if packed else 0)
    q = random_array(rng, (sum(q_lens), heads, head_dim), bfloat16, mean=0.0)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, cu=cu, kv_lens=np.array(kv_lens, np.int32),
                ks=ks, vs=vs, num_q_heads=num_q_heads, scale=1.0 / math.sqrt(head_dim))


def dense_expected(case):
    """The independent dense float64 formula, sequence by sequence (zero rows for kv_len == 0)."""
    cu, hq, d = case["cu"], case["num_q_heads"], case["q"].shape[2]
    return np.concatenate([
        np.zeros((cu[s + 1] - cu[s], hq, d)) if case["kv_lens"][s] == 0 else
        A.attention_reference(case["q"][cu[s]:cu[s + 1], :hq], case["ks"][s], case["vs"][s], case["scale"])
        for s in range(len(cu) - 1)])


def on(device, case, tables=None):
    t = {k: Tensor.from_numpy(case[n], device) for k, n in
         (("q", "q"), ("k_cache", "k_cache"), ("v_cache", "v_cache"), ("cu_seqlens_q", "cu"), ("kv_lens", "kv_lens"))}
    t["block_tables"] = Tensor.from_numpy(case["tables"] if tables is None else tables, device)
    return t


def run_prefill(case, device="cuda", variant=None, causal=True, use_tma=True, tables=None, scale=None):
    t = on(device, case, tables)
    hq = case["num_q_heads"]
    out = poisoned((case["q"].shape[0], hq, case["q"].shape[2]), bfloat16, device)
    A.attention_prefill(t["q"], t["k_cache"], t["v_cache"], t["cu_seqlens_q"], t["kv_lens"], t["block_tables"],
                        case["scale"] if scale is None else scale, int(np.diff(case["cu"]).max()), out=out,
                        num_q_heads=hq, causal=causal, variant=variant, use_tma=use_tma)
    return out.numpy()


def run_decode(case, max_kv_len, device="cuda", variant=None, tables=None, scale=None):
    t = on(device, case, tables)
    hq = case["num_q_heads"]
    out = poisoned((case["q"].shape[0], hq, case["q"].shape[2]), bfloat16, device)
    A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"],
                       case["scale"] if scale is None else scale, max_kv_len=max_kv_len, out=out, num_q_heads=hq,
                       variant=K.decode(variant))
    return out.numpy()


def misplace_page(case, seq, a, b):
    """The block table with page a of sequence `seq` read from page b's block: page a's keys are lost and page b's
    counted twice (a kernel that looked up the wrong page, or dropped one and re-read another)."""
    tables = case["tables"].copy()
    tables[seq, a] = tables[seq, b]
    return tables


MIXED = ([1, 63, 64, 65, 100], [1, 63, 200, 65, 1000])  # q_len <= kv_len, q_len < kv_len for some
LONG_PREFILL = ([4096, 64], [4096, 32768])  # a prompt from scratch, and a chunk at the end of a long context
LONG_DECODE = [32768, 5, 20000]


# ---------------------------------------------------------------------------------------------------------------
# CPU: references, argument checks, launch tables
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
    out = run_prefill(case, "cpu")
    assert out.shape == (sum(MIXED[0]), 8, 64) and out.dtype == bfloat16
    assert rel_error(out, dense_expected(case)) < TOL


@pytest.mark.parametrize("packed", [False, True])
def test_decode_cpu_op(rng, packed):
    case = make_case(rng, [1] * 5, [1, 63, 64, 65, 1000], 8, 4, 128, block_size=16, packed=packed)
    assert rel_error(run_decode(case, 1000, "cpu"), dense_expected(case)) < TOL


def test_long_context_tolerance_catches_planted_bugs_cpu(rng):
    """The long-context checks, run on the CPU backend (float32, bf16 output): the correct op passes TOL_LONG; a
    misplaced page (page a read from page b's block) or a 2% softmax-scale error fails it, for decode and prefill."""
    case = make_case(rng, [1] * 2, [16384, 5], 8, 2, 128, 16)
    expected = dense_expected(case)
    assert row_error(run_decode(case, 16384, "cpu"), expected) < TOL_LONG
    assert row_error(run_decode(case, 16384, "cpu", tables=misplace_page(case, 0, 300, 700)), expected) > TOL_LONG
    assert row_error(run_decode(case, 16384, "cpu", scale=case["scale"] * 1.02), expected) > TOL_LONG
    case = make_case(rng, [256, 64], [256, 8192], 4, 1, 128, 16)
    expected = dense_expected(case)
    assert row_error(run_prefill(case, "cpu"), expected) < TOL_LONG
    assert row_error(run_prefill(case, "cpu", tables=misplace_page(case, 1, 100, 300)), expected) > TOL_LONG
    assert row_error(run_prefill(case, "cpu", scale=case["scale"] * 1.02), expected) > TOL_LONG


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
    with pytest.raises(ValueError, match="variant"):
        A.attention_decode(t["q"][:1], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], 0.125, 5,
                           variant="v9")
    with pytest.raises(ValueError, match="variant"):
        P.select_prefill_kernel("v9", 128, 16)
    with pytest.raises(ValueError, match="variant"):  # the production table lists no dev kernel
        P.select_prefill_kernel("fa2_w4", 128, 16)
    with pytest.raises(ValueError, match="variant"):  # a dev kernel exists for its own head_dim only
        K.prefill("v4_w3_k64", 64)
    with pytest.raises(ValueError, match="variant"):
        P.select_prefill_kernel(K.DEV_PREFILL["v4_w3_k64"][128], 64, 16)
    with pytest.raises(ValueError, match="variant"):
        D.plan_decode("v3", 1, 8, 100, 16, 64, 4, 132)
    with pytest.raises(ValueError, match="variant"):
        D.plan_decode(K.DEV_DECODE["v4s3"], 1, 8, 100, 16, 64, 4, 132)  # experiments: the benchmark's shapes only


def test_decode_plan():
    assert A.decode_plan(1, 8, 32768, 132) == (64, 512)  # one long sequence still fills the chip
    splits, chunk = A.decode_plan(64, 8, 4096, 132)
    assert splits * chunk >= 4096 and splits <= 2
    assert A.decode_plan(4, 8, 1, 132) == (1, 64)
    # balanced (v3/v4): one long sequence fills one wave of resident CTAs (3 per SM), chunk a multiple of 64
    splits, chunk = A.decode_plan(1, 8, 32768, 132, 3, True)
    assert chunk % 64 == 0 and splits * chunk >= 32768 and 0.9 * 396 <= 8 * splits <= 396
    splits, chunk = A.decode_plan(64, 8, 4096, 132, 3, True)  # a big batch: the last wave well filled
    ctas = 512 * splits
    assert ctas / (-(-ctas // 396) * 396) > 0.9 and splits * chunk >= 4096
    for b, hkv, n in [(1, 1, 100), (3, 4, 20000), (200, 8, 700)]:
        splits, chunk = A.decode_plan(b, hkv, n, 132, 2, True)
        assert chunk % 64 == 0 and (splits - 1) * chunk < n <= splits * chunk


def test_plan_decode_v4_page_table_and_fallbacks():
    for b, n, block in [(1, 32768, 16), (64, 4096, 16), (64, 32768, 8), (2, 131072, 8), (3, 20000, 48)]:
        k, splits, chunk = D.plan_decode("v4", b, 8, n, block, 128, 4, 132)
        assert k.variant in ("v4", "v4w8") and chunk % 64 == 0 and (splits - 1) * chunk < n <= splits * chunk
        assert -(-chunk // block) + 1 <= D.V4_TABLE_CAP  # the split's pages fit v4's shared page table
    k, splits, chunk = D.plan_decode("v4", 1, 8, 1 << 20, 1, 128, 4, 132)  # block size 1: the pages cannot fit
    assert k.variant == "v2" and splits * chunk >= 1 << 20
    # the dev v3 needs block_size % 16 == 0
    assert D.plan_decode(K.DEV_DECODE["v3"], 4, 8, 4096, 20, 128, 4, 132)[0].variant == "v2"


def test_v4_plan_few_sequences():
    """What the v4 plan guarantees: every split non-empty, chunk a multiple of 64 within v4's shared page table and
    the combine's split limit; a grid that covers every SM (more CTAs than SMs) wherever the context allows it, with
    the keys balanced over the SMs (on 132 SMs, the busiest within 15% + 256 keys of the average for long contexts)."""
    for sms in (132, 114, 78):
        for b in (1, 2, 3, 4, 8):
            for hkv in (1, 2, 4, 8):
                for n in (1, 63, 64, 65, 512, 1000, 4096, 20000, 32768, 100000, 131072):
                    for block in (16, 256, 8):
                        k, splits, chunk = D.plan_decode("v4", b, hkv, n, block, 128, 4, sms)
                        ctas = b * hkv * splits
                        assert chunk % 64 == 0, (b, hkv, n, block)
                        assert k.variant == ("v4w8" if ctas <= 2 * sms else "v4"), (sms, b, hkv, n, block)
                        assert D.plan_decode(V4W4, b, hkv, n, block, 128, 4, sms) == (V4W4, splits, chunk)
                        assert (splits - 1) * chunk < n <= splits * chunk  # every split holds keys
                        assert splits <= D.V4_MAX_SPLITS and -(-chunk // block) + 1 <= D.V4_TABLE_CAP
                        most = b * hkv * min(D.V4_MAX_SPLITS, -(-n // 64))  # CTAs with 64-key splits
                        if most > sms:
                            assert ctas > sms, (sms, b, hkv, n, splits)  # every SM gets a CTA
                        else:
                            assert ctas == most  # fewer CTAs than SMs: as many as the context allows
                        if n >= 20000 and sms == 132:  # (other SM counts can be unlucky for 8 x 8 pairs)
                            per_sm = -(-ctas // sms) * chunk  # keys on the busiest SM
                            assert per_sm <= 1.15 * b * hkv * n / sms + 256, (sms, b, hkv, n, splits)
    # the measured points (H100, docs/kernels/history/attention.md, "Decode for few sequences")
    assert D.plan_decode("v4", 1, 8, 32768, 16, 128, 4, 132) == (D.DECODE_KERNELS["v4w8"], 32, 1024)
    assert D.plan_decode("v4", 1, 8, 512, 16, 128, 4, 132) == (D.DECODE_KERNELS["v4w8"], 8, 64)
    assert D.plan_decode("v4", 64, 8, 4096, 16, 128, 4, 132) == (D.DECODE_KERNELS["v4"], 1, 4096)


def test_v4_plan_wide_ctas():
    """v4 runs its 8-warp CTAs exactly where the 4-warp plan's grid is one wave of them (2 per SM) and the group is
    at most 4 (their launch bound 16 / 8 CTAs per SM holds there), with that plan's splits; the forced forms keep
    their own."""
    wide, narrow = D.DECODE_KERNELS["v4w8"], D.DECODE_KERNELS["v4"]
    assert (wide.warps, wide.resident(128, 4), narrow.resident(128, 4)) == (8, 2, 4)
    assert wide.smem(128) - narrow.smem(128) == 2 * D.V4_RING_STAGE_BYTES  # a ring stage per warp
    for group, d in [(1, 64), (2, 128), (3, 128), (4, 64), (4, 128)]:
        assert D.plan_decode("v4", 1, 8, 512, 16, d, group, 132)[0] is wide
        assert D.plan_decode("v4", 1, 8, 32768, 16, d, group, 132)[0] is wide  # 8 x 32 CTAs <= 2 x 132
        assert D.plan_decode("v4", 64, 8, 512, 16, d, group, 132)[0] is narrow  # 512 CTAs
    # G > 4 needs 167-246 registers: two 8-warp CTAs would not fit an SM; not compiled (7: nor split in subgroups)
    assert D.plan_decode("v4", 1, 8, 512, 16, 128, 7, 132)[0] is narrow
    assert D.plan_decode("v4w8", 64, 8, 4096, 16, 128, 2, 132)[0] is wide  # asked for: at any grid
    with pytest.raises(ValueError, match="v4w8 is compiled"):
        D.plan_decode("v4w8", 1, 8, 512, 16, 128, 8, 132)


def test_v4_plan_subgroups():
    """Groups of 6 and 8 query heads run as 2 subgroups of 3 and 4, groups of 5 as 5 of one, in 8-warp CTAs where
    that grid (R times the heads) is one wave of them and its splits are short (<= SUBGROUP_MAX_CHUNK keys), planned
    as for R times the kv heads; elsewhere (long splits, batch 64) the whole group in 4-warp CTAs; the kernel names
    and the forced variants follow."""
    narrow = D.DECODE_KERNELS["v4"]
    assert D.SUBGROUP_MAX_CHUNK == 512
    for group, r, shapes in ((6, 2, [(1, 512), (1, 8192), (2, 4096), (4, 512)]),
                             (8, 2, [(1, 512), (1, 8192), (2, 4096), (4, 512)]),
                             (5, 5, [(1, 512), (1, 2048), (3, 1000)])):
        for b, n in shapes:
            k, splits, chunk = D.plan_decode("v4", b, 8, n, 16, 128, group, 132)
            assert (k.variant, k.subgroups, k.warps) == ("v4w8", r, 8), (group, b, n)
            assert (splits, chunk) == D.v4_plan(b, 8 * r, n, 132, narrow.resident(128, group // r),
                                                (D.V4_TABLE_CAP - 1) * 16 // 64 * 64)
            assert b * 8 * r * splits <= 2 * 132 and chunk <= 512  # one wave of 8-warp CTAs, short splits
            assert k.name(128, group) == f"attention_decode_v4_d128_g{group // r}_s2_w8_r{r}"
        for b, n in ((1, 16384), (1, 32768), (4, 8192), (64, 4096)):  # splits of 1024+ keys, or too many CTAs
            assert D.plan_decode("v4", b, 8, n, 16, 128, group, 132)[0] is narrow, (b, n)
        assert narrow.name(128, group) == f"attention_decode_v4_d128_g{group}_s2"
        assert D.plan_decode(V4W4, 1, 8, 32768, 16, 128, group, 132)[0] is V4W4
    assert D.plan_decode("v4", 1, 8, 8192, 16, 128, 8, 132)[1:] == (16, 512)  # a measured point
    assert D.plan_decode("v4", 1, 8, 8192, 16, 64, 8, 132)[0].subgroups == 2  # head_dim 64 as well
    assert D.plan_decode("v4", 1, 8, 512, 16, 64, 5, 132)[0].subgroups == 5
    for group in (1, 2, 3, 4, 7):
        assert D.plan_decode("v4", 1, 8, 32768, 16, 128, group, 132)[0].subgroups == 1


def test_spread_smem():
    """The fused entry's placement cap: with the shared memory asked, an SM (228 KB, 1 KB reserved per CTA) holds at
    most ceil(CTAs / SMs) of the grid's CTAs, and never less than the kernel's own layout."""
    need = D.DECODE_KERNELS["v4"].smem(128)
    for sms in (132, 114, 78):
        for ctas in (1, 50, sms, sms + 1, 2 * sms, 2 * sms + 1, 3 * sms, 4 * sms, 10 * sms):
            smem = D.spread_smem(need, ctas, sms)
            cap = -(-ctas // sms)
            assert need <= smem <= 227 * 1024 and smem % 16 == 0, (sms, ctas, smem)
            per_sm = (228 * 1024) // (smem + 1024)
            assert per_sm == cap or (smem == need and per_sm < cap), (sms, ctas, smem, per_sm)


def test_fast_div():
    n = np.concatenate([np.arange(0, 1 << 16), np.arange((1 << 31) - 4096, 1 << 31)]).astype(np.uint64)
    for d in list(range(1, 257)) + [1000, 4096]:
        magic, shift = D.fast_div(d)
        assert 0 < magic < 1 << 32
        q = (((n * np.uint64(magic)) >> np.uint64(32)) + n) >> np.uint64(shift)
        assert np.array_equal(q, n // np.uint64(d)), d


def _source(family: str) -> str:
    """A family's source with the bodies it includes inlined (attention_decode_v4.cuh / _v2.cuh: the bodies,
    constants and entries the bf16 files share with attention_decode_fp8.cu; attention_prefill.cuh: the prefill
    templates of attention_prefill.cu and attention_prefill_d256.cu)."""
    src = (kernel_source_dir() / f"{family}.cu").read_text()
    return re.sub(r'^#include "(attention_decode_v\d\.cuh|attention_prefill\.cuh)"$',
                  lambda m: (kernel_source_dir() / m.group(1)).read_text(), src, flags=re.M)


# The decode entry macros of attention_decode_v4.cuh / _v2.cuh -> the name after the format's prefix
_DECODE_ENTRIES = {"V4": "v4_d{0}_g{1}_s{2}", "V4_WIDE": "v4_d{0}_g{1}_s{2}_w{3}",
                   "V4_WIDE_SUBGROUPS": "v4_d{0}_g{1}_s{2}_w{3}_r{4}", "V4_LEAN": "v4_d{0}_g{1}_s2_w8_lean",
                   "V4_LEAN_SUBGROUPS": "v4_d{0}_g{1}_s2_w8_r{2}_lean", "V4_MMA": "v4_d{0}_g{1}_s2_mma",
                   "V2": "d{0}_g{1}"}


def _kernel_names(family: str) -> set[str]:
    """extern "C" kernel names a family's source instantiates (macros expanded by their instantiation lines)."""
    src = _source(family)
    if family.startswith("dev/"):
        src += _source(re.search(r'#include "\.\./(\w+)\.cu"', src).group(1))
    names = set(re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*(?:\([^)]*\))?[^)]*\) )?(\w+)\(',
                           src))
    names = {n for n in names if not n.startswith(("XSERV_", "__"))}  # the entry macros' own bodies
    fmt = re.search(r"^#define XSERV_KV_FMT (\w+)", src, re.M)
    if fmt:  # the decode entries of the file's KV format (BF16, FP8), named with that format's prefix
        prefix = re.search(rf"^#define XSERV_KV_PREFIX_{fmt.group(1)} (\w+)$",
                           (kernel_source_dir() / "attention_decode.cuh").read_text(), re.M).group(1)
        for kind, args in re.findall(rf"^XSERV_({'|'.join(_DECODE_ENTRIES)})_ENTRY\(XSERV_KV_FMT, ([\d, ]+)\)$", src,
                                     re.M):
            names.add(prefix + _DECODE_ENTRIES[kind].format(*args.split(", ")))
    for d, g, s in re.findall(r"^\s*XSERV_DECODE_V4_KERNEL\((\w+), (\w+), (\d)\)", src, re.M):
        names.add(f"attention_decode_v4_d{d}_g{g}_s{s}")
    for d, g in re.findall(r"^XSERV_DECODE_V4_EXPERIMENTS\((\d+), (\d)\)", src, re.M):
        names.update(f"attention_decode_v4_d{d}_g{g}_{x}" for x in ("s3", "s4", "s2_w16"))
    for d, g, s, w in re.findall(r"^XSERV_DECODE_V4_WIDE_KERNEL\((\d+), (\d), (\d), (\d+)\)", src, re.M):
        names.add(f"attention_decode_v4_d{d}_g{g}_s{s}_w{w}")
    for d, g in re.findall(r"^XSERV_DECODE_V4_LEAN_KERNEL\((\d+), (\d)\)", src, re.M):
        names.add(f"attention_decode_v4_d{d}_g{g}_s2_w8_lean")
    for d, g, r in re.findall(r"^XSERV_DECODE_V4_LEAN_SUBGROUPS_KERNEL\((\d+), (\d), (\d)\)", src, re.M):
        names.add(f"attention_decode_v4_d{d}_g{g}_s2_w8_r{r}_lean")
    for d, g, s, w, r in re.findall(r"^XSERV_DECODE_V4_WIDE_SUBGROUPS_KERNEL\((\d+), (\d), (\d), (\d+), (\d)\)", src,
                                    re.M):
        names.add(f"attention_decode_v4_d{d}_g{g}_s{s}_w{w}_r{r}")
    for d, g in re.findall(r"^XSERV_DECODE_V3_STAGES\((\d+), (\d)\)", src, re.M):
        names.update(f"attention_decode_v3_d{d}_g{g}_s{s}" for s in (2, 3))
    for d, mt, w, qs, nbuf, ks in re.findall(
            r"^XSERV_PREFILL_V3\((\d+), (\d), (\d), \w+, (q?), (\d), \d+, (_k32)?\)", src, re.M):
        names.add(f"attention_prefill_v3_d{d}_m{mt}w{w}{qs}_b{nbuf}{ks}")
    for d, w, k in re.findall(r"^XSERV_PREFILL_V4\((\d+), (\d), (\d+)\)", src, re.M):
        names.add(f"attention_prefill_v4_d{d}_w{w}_k{k}")
    for d, w, k, s in re.findall(r"^XSERV_PREFILL_V5\((\d+), (\d), (\d+), (\d)\)", src, re.M):
        names.add(f"attention_prefill_v5_d{d}_w{w}_k{k}_s{s}")
    return names


def test_launch_tables_name_instantiated_kernels():
    """Every kernel the prefill and decode tables (production and the dev registry's) can launch is instantiated in
    the family they name; the production tables name production families (cuda_src/) only, the dev registry
    cuda_src/dev/ only, and no name is in both."""
    for table, dev in ((A.PREFILL_KERNELS, False), (K.DEV_PREFILL, True)):
        for variant, by_dim in table.items():
            for d, k in by_dim.items():
                assert k.name in _kernel_names(k.family), (variant, d, k.name, k.family)
                assert k.dev == dev and k.variant == variant, variant
                assert k.smem <= 227 * 1024 and k.rows % (64 if k.tma != "none" else 4) == 0
    assert not set(A.PREFILL_KERNELS) & set(K.DEV_PREFILL)
    assert not set(A.DECODE_KERNELS) & set(K.DEV_DECODE)
    for variant, k in K.DEV_DECODE.items():  # v4w4: the production 4-warp kernel at every grid (an A/B form)
        assert (k.dev or variant == "v4w4") and k.variant == variant and k.has_fp8 == (variant == "v4w4"), variant
        for d, g in k.shapes or {(d, g) for d in A.HEAD_DIMS for g in range(1, A.MAX_GQA_GROUP + 1)}:
            assert k.name(d, g) in _kernel_names(k.family), (variant, k.name(d, g))
    for variant, k in A.DECODE_KERNELS.items():
        shapes = k.shapes or {(d, g) for d in A.HEAD_DIMS for g in range(1, A.MAX_GQA_GROUP + 1)}
        for d, g in shapes:
            assert k.name(d, g) in _kernel_names(k.family), (variant, k.name(d, g))
        for d, g, r in k.lean:  # the fused op's _lean entries (lean_entry), whole groups and subgroups
            sub = dataclasses.replace(k, subgroups=r)
            assert sub.has_lean(d, g * r) and sub.name(d, g * r) + "_lean" in _kernel_names(k.family), (variant, d, g, r)
        assert not k.dev, variant
    wide = A.DECODE_KERNELS["v4w8"]
    for d in A.HEAD_DIMS:  # the query-head subgroup kernels the plan can pick
        for group in range(1, A.MAX_GQA_GROUP + 1):
            for r in D._subgroup_counts(group, d, wide)[:-1]:  # (the last is 1: the whole group)
                name = dataclasses.replace(wide, subgroups=r).name(d, group)
                assert name in _kernel_names(wide.family), name
    assert "attention_decode_combine" in _kernel_names(A.DECODE_KERNELS["v2"].family)


def test_fp8_cache_instantiates_every_production_decode_kernel():
    """attention_decode_fp8.cu (the FP8-cache piece, compiled only for a kvfp8=1 model) instantiates the e4m3 form of
    every kernel the production variants' plans can launch on a bf16 cache: v4, v4w8 with its query-head subgroups
    and _lean entries, and the v2 fallback; the dev variants have none (attention_decode raises for them)."""
    fp8 = _kernel_names(D.FP8_FAMILY)
    bf16 = _kernel_names("attention_decode") | _kernel_names("attention_decode_v2")
    assert {n for n in fp8 if n.startswith("attention_decode_fp8_")} == fp8
    assert {D.DecodeKernel("v4", 4, "attention_decode").fp8_name(128, 2)} == {"attention_decode_fp8_v4_d128_g2_s2"}
    mma = {D.DecodeKernel("v4", 4, "attention_decode", suffix="_mma").fp8_name(128, g) for g in range(1, 9)}
    assert mma <= fp8  # the FP8 cache's own tensor-core form of the 4-warp kernel
    assert ({"attention_decode_" + n[len("attention_decode_fp8_"):] for n in fp8 - mma}
            == bf16 - {"attention_decode_combine"})
    for variant, k in A.DECODE_KERNELS.items():
        assert k.has_fp8 == (variant in ("v4", "v4w8", "v2")), variant
        if not k.has_fp8:
            continue
        for d, g in k.shapes or {(d, g) for d in A.HEAD_DIMS for g in range(1, A.MAX_GQA_GROUP + 1)}:
            assert k.fp8_name(d, g) in fp8, (variant, d, g)
        for d, g, r in k.lean:
            assert dataclasses.replace(k, subgroups=r).fp8_name(d, g * r) + "_lean" in fp8, (variant, d, g, r)
    wide = A.DECODE_KERNELS["v4w8"]
    for d in A.HEAD_DIMS:  # the query-head subgroup kernels the plan can pick
        for group in range(1, A.MAX_GQA_GROUP + 1):
            for r in D._subgroup_counts(group, d, wide)[:-1]:
                assert dataclasses.replace(wide, subgroups=r).fp8_name(d, group) in fp8, (d, group, r)
    assert family_shapes(D.FP8_FAMILY) == {"head_dim": (64, 128), "group": tuple(range(1, 9)), "kvfp8": (1,)}


def test_host_mirrors_match_device_constants():
    """The launchers' copies of device constants, read back from the kernel sources."""
    v4 = _source("attention_decode")
    assert int(re.search(r"constexpr int kV4TabCap = (\d+);", v4).group(1)) == D.V4_TABLE_CAP
    assert int(re.search(r"constexpr int kV4MaxSplits = (\d+);", v4).group(1)) == D.V4_MAX_SPLITS
    row_bytes = re.search(r"constexpr int kV4RowBytes = ([\d ()*+]+);", v4).group(1)
    assert eval(row_bytes) == D.V4_ROW_BYTES  # a product of literals  # noqa: S307
    warps = int(re.search(r"constexpr int kV4Warps = (\d+);", v4).group(1))
    unroll = int(re.search(r"constexpr int kV4Unroll = (\d+);", v4).group(1))
    assert warps * (2 * unroll) * 32 * 16 == D.V4_RING_STAGE_BYTES and warps == D.DECODE_KERNELS["v4"].warps
    minb = re.search(r"#define XSERV_V4_MINB\(G\) \(\(G\) <= (\d+) \? (\d+) : (\d+)\)", v4).groups()
    for g in range(1, 9):
        assert D.v4_min_blocks(g) == (int(minb[1]) if g <= int(minb[0]) else int(minb[2]))
    v3 = _source("dev/attention_decode_dev")
    for d, s, n in re.findall(r"#define XSERV_V3_MINB_(\d+)_(\d) (\d+)", v3):
        assert K.v3_min_blocks(int(d), int(s)) == int(n)
    # the shared-memory sizes: every kernel that takes dynamic shared memory checks it gets enough (require_smem)
    for family in ("attention_prefill", "attention_prefill_d256", "attention_prefill_sm90", "attention_decode"):
        assert "require_dynamic_smem(" in _source(family), family


def test_default_variants_are_the_shipped_ones(monkeypatch):
    class Dev:
        arch = "sm_90a"

    monkeypatch.setattr(P, "get_device", lambda: Dev)
    assert P.default_prefill_variant() == "v5"
    assert P.select_prefill_kernel("v5", 128, 16).variant == "v5"
    assert P.select_prefill_kernel("v5", 128, 20).variant == "v4"  # block size 20: no TMA copies
    assert P.select_prefill_kernel("v5", 64, 16, use_tma=False).variant == "v4"
    Dev.arch = "sm_80"
    assert P.default_prefill_variant() == "v3"
    with pytest.raises(ValueError, match="sm_90a"):
        P.select_prefill_kernel("v4", 128, 16)
    assert D.DEFAULT_DECODE == "v4"


# ---------------------------------------------------------------------------------------------------------------
# attention_decode_rope: qk_norm_rope_write_kv + attention_decode in one op (one launch on the GPU)
# ---------------------------------------------------------------------------------------------------------------
ROPE_EPS = 1e-6


def rope_case(rng, kv_lens, hq, hkv, d, block_size, norm=True, kinds=None):
    """A decode batch as xserv builds it: sequence s has kv_lens[s] tokens, the last one new (position kv_len - 1,
    its raw q/k/v in the packed qkv); the cache holds the others (zero-mean random, blocks permuted, unused slots
    NaN) and NaN in the new token's slot, which slot_mapping names. kinds[s] (default "new") may also be "pad" (a
    padding row: slot -1, its key already in the cache), "elsewhere" (the new K/V go to a spare slot, not where the
    table puts position kv_len - 1, whose old key stays) or "zero" (kv_len 0: no key, the new K/V still go to a
    spare slot)."""
    kinds = list(kinds or ["new"] * len(kv_lens))
    ks = [random_array(rng, (n, hkv, d), bfloat16, mean=0.0) for n in kv_lens]
    vs = [random_array(rng, (n, hkv, d), bfloat16, mean=0.0) for n in kv_lens]
    k_cache, v_cache, tables = paged_kv_from_dense(rng, ks, vs, block_size, spare_blocks=2)
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    owned = {int(b) for b in tables.ravel() if b >= 0}
    spare = [b * block_size + i for b in range(k_cache.shape[0]) if b not in owned for i in range(block_size)]
    spare = list(rng.permutation(spare))
    slots = np.full(len(kv_lens), -1, np.int32)
    for s, (n, kind) in enumerate(zip(kv_lens, kinds)):
        if kind == "new":
            slot = tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
            flat_k[slot] = flat_v[slot] = np.nan  # the new token's K/V are not in the cache yet
            slots[s] = slot
        elif kind in ("elsewhere", "zero"):
            slots[s] = spare.pop()
        assert (kind == "zero") == (n == 0), (kind, n)
    table = rope_cos_sin_table(d, max(max(kv_lens), 1) + 8, 1e6)
    return dict(qkv=random_array(rng, (len(kv_lens), hq + 2 * hkv, d), bfloat16, mean=0.0),
                qw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                kw=random_array(rng, (d,), bfloat16, mean=1.0, std=0.3) if norm else None,
                pos=np.maximum(np.array(kv_lens, np.int32) - 1, 0), cos_sin=table, slots=slots,
                k_cache=k_cache, v_cache=v_cache, tables=tables, kv_lens=np.array(kv_lens, np.int32), hq=hq,
                hkv=hkv, scale=1.0 / math.sqrt(d), kinds=kinds)


def rope_expected(c):
    """The composition of the NumPy references: out (float64; zero rows for kv_len 0) and the written caches."""
    from xserv.ops.rope import qk_norm_rope_write_kv_reference

    kc, vc = c["k_cache"].copy(), c["v_cache"].copy()
    rotated = qk_norm_rope_write_kv_reference(c["qkv"], c["qw"], c["kw"], c["pos"], c["cos_sin"], c["hq"], c["hkv"],
                                              ROPE_EPS, kc, vc, c["slots"])
    d = c["qkv"].shape[2]
    out = np.zeros((len(c["kv_lens"]), c["hq"], d))
    keep = np.flatnonzero(c["kv_lens"] > 0)
    out[keep] = A.attention_decode_reference(rotated[keep], kc, vc, c["kv_lens"][keep], c["tables"][keep],
                                             c["scale"], c["hq"], dtype=np.float64)
    return out, kc, vc


def run_decode_rope(c, device="cuda", variant=None, max_kv_len=None):
    """The fused op on fresh copies (NaN-poisoned output): (out, k_cache, v_cache, qkv afterwards)."""
    to = functools.partial(Tensor.from_numpy, device=device)
    qkv, kc, vc = to(c["qkv"].copy()), to(c["k_cache"].copy()), to(c["v_cache"].copy())
    w = (None, None) if c["qw"] is None else (to(c["qw"]), to(c["kw"]))
    out = poisoned((len(c["kv_lens"]), c["hq"], c["qkv"].shape[2]), bfloat16, device)
    got = A.attention_decode_rope(qkv, *w, to(c["pos"]), to(c["cos_sin"]), c["hq"], ROPE_EPS, kc, vc,
                                  to(c["slots"]), to(c["kv_lens"]), to(c["tables"]), c["scale"],
                                  max_kv_len or max(int(c["kv_lens"].max()), 1), out=out, variant=K.decode(variant))
    assert got is out
    return out.numpy(), kc.numpy(), vc.numpy(), qkv.numpy()


def run_rope_then_decode(c, variant=None, max_kv_len=None):
    """qk_norm_rope_write_kv then attention_decode, the two CUDA ops: (out, k_cache, v_cache)."""
    from xserv.ops.rope import qk_norm_rope_write_kv

    qkv, kc, vc = (Tensor.from_numpy(c[n].copy()) for n in ("qkv", "k_cache", "v_cache"))
    w = (None, None) if c["qw"] is None else (Tensor.from_numpy(c["qw"]), Tensor.from_numpy(c["kw"]))
    qk_norm_rope_write_kv(qkv, *w, Tensor.from_numpy(c["pos"]), Tensor.from_numpy(c["cos_sin"]), c["hq"], c["hkv"],
                          ROPE_EPS, kc, vc, Tensor.from_numpy(c["slots"]))
    out = poisoned((len(c["kv_lens"]), c["hq"], c["qkv"].shape[2]), bfloat16)
    A.attention_decode(qkv, kc, vc, Tensor.from_numpy(c["kv_lens"]), Tensor.from_numpy(c["tables"]), c["scale"],
                       max_kv_len or max(int(c["kv_lens"].max()), 1), out=out, num_q_heads=c["hq"], variant=K.decode(variant))
    return out.numpy(), kc.numpy(), vc.numpy()


def u16(a):
    return np.asarray(a).view(np.uint16)


def _rms64(x, w):
    x = x.astype(np.float64)
    return w.astype(np.float64) * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + ROPE_EPS)


def _rope64(x, positions, d):
    x = x.astype(np.float64)
    ang = positions.astype(np.float64)[:, None, None] * (1e6 ** (-np.arange(0, d, 2) / d))[None, None, :]
    lo, hi = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([lo * np.cos(ang) - hi * np.sin(ang), hi * np.cos(ang) + lo * np.sin(ang)], -1)


@pytest.mark.parametrize("norm", [True, False])
def test_decode_rope_cpu_against_float64(rng, norm):
    """The CPU op (the composition of the references) against an independent float64 formula: q/k head norm and
    RoPE from the inverse frequencies, the dense attention of each sequence over its keys and the new one; the new
    K/V in the cache at their slots (v bit for bit), qkv itself untouched, unwritten slots still NaN."""
    hq, hkv, d = 8, 2, 64
    kinds = ["new", "new", "pad", "new", "elsewhere"]
    c = rope_case(rng, [1, 17, 1, 64, 40], hq, hkv, d, block_size=16, norm=norm, kinds=kinds)
    out, kc, vc, qkv = run_decode_rope(c, "cpu")
    np.testing.assert_array_equal(u16(qkv), u16(c["qkv"]))
    q, k, v = c["qkv"][:, :hq], c["qkv"][:, hq:hq + hkv], c["qkv"][:, hq + hkv:]
    if norm:
        q, k = _rms64(q, c["qw"]), _rms64(k, c["kw"])
    q, k = _rope64(q, c["pos"], d), _rope64(k, c["pos"], d)
    kflat, vflat = kc.reshape(-1, hkv, d), vc.reshape(-1, hkv, d)
    for s, kind in enumerate(kinds):
        n = int(c["kv_lens"][s])
        ks, vs = A.gather_kv(c["k_cache"], c["v_cache"], c["tables"][s], n)
        ks, vs = ks.astype(np.float64), vs.astype(np.float64)
        if kind == "new":
            ks[n - 1], vs[n - 1] = k[s], v[s]
        want = A.attention_reference(q[s:s + 1], ks, vs, c["scale"])
        assert rel_error(out[s:s + 1], want) < TOL, (s, kind)
        if kind != "pad":
            assert rel_error(kflat[c["slots"][s]], k[s]) < 1e-2
            np.testing.assert_array_equal(u16(vflat[c["slots"][s]]), u16(c["qkv"][s, hq + hkv:]))
    written = set(c["slots"][c["slots"] >= 0].tolist())
    old = np.isnan(c["k_cache"].reshape(-1, hkv, d)[:, 0, 0].astype(np.float32))
    for slot in np.flatnonzero(old):
        if slot not in written:
            assert np.all(np.isnan(kflat[slot].astype(np.float32))) and np.all(np.isnan(vflat[slot].astype(np.float32)))


def test_decode_rope_argument_errors(rng):
    c = rope_case(rng, [5, 9], 4, 2, 64, block_size=16)
    to = functools.partial(Tensor.from_numpy, device="cpu")
    qkv, kc, vc, qw, kw = to(c["qkv"]), to(c["k_cache"]), to(c["v_cache"]), to(c["qw"]), to(c["kw"])
    call = dict(q_weight=qw, k_weight=kw, positions=to(c["pos"]), cos_sin=to(c["cos_sin"]), num_q_heads=4,
                eps=ROPE_EPS, k_cache=kc, v_cache=vc, slot_mapping=to(c["slots"]), kv_lens=to(c["kv_lens"]),
                block_tables=to(c["tables"]), scale=0.125, max_kv_len=9)
    A.attention_decode_rope(qkv, **call)  # the good call
    with pytest.raises(ValueError, match="qkv"):  # q alone: the fused op needs the packed qkv
        A.attention_decode_rope(to(np.ascontiguousarray(c["qkv"][:, :4])), **call)
    with pytest.raises(ValueError, match="q_weight, k_weight"):
        A.attention_decode_rope(qkv, **dict(call, k_weight=None))
    with pytest.raises(ValueError, match="k_weight"):
        A.attention_decode_rope(qkv, **dict(call, k_weight=to(np.zeros(32, bfloat16))))
    with pytest.raises(ValueError, match="positions"):
        A.attention_decode_rope(qkv, **dict(call, positions=to(c["pos"][:1])))
    with pytest.raises(ValueError, match="slot_mapping"):
        A.attention_decode_rope(qkv, **dict(call, slot_mapping=to(c["slots"].astype(np.int64))))
    with pytest.raises(ValueError, match="cos_sin"):
        A.attention_decode_rope(qkv, **dict(call, cos_sin=to(c["cos_sin"][:, :32].copy())))
    with pytest.raises(ValueError, match="kv_lens"):
        A.attention_decode_rope(qkv, **dict(call, kv_lens=to(c["kv_lens"][:1])))
    with pytest.raises(ValueError, match="v_cache"):
        A.attention_decode_rope(qkv, **dict(call, v_cache=kc))
    with pytest.raises(ValueError, match="out: overlaps qkv"):  # the output may not overlap the qkv it reads
        A.attention_decode_rope(qkv, **call, out=qkv.view(-1)[:2 * 4 * 64].view(2, 4, 64))
    with pytest.raises(ValueError, match="eps"):
        A.attention_decode_rope(qkv, **dict(call, eps=-1.0))
    with pytest.raises(ValueError, match="variant"):
        A.attention_decode_rope(qkv, **call, variant="v9")


# ---------------------------------------------------------------------------------------------------------------
# GPU: the shipped kernels
# ---------------------------------------------------------------------------------------------------------------

def shipped_prefill(head_dim: int) -> list[str]:
    from xserv.runtime import get_device

    return [v for v in A.prefill_variants(head_dim) if get_device().arch == "sm_90a" or v in ("simple", "v3")]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 4, 16), (8, 4, 20), (16, 4, 256), (16, 2, 64), (8, 1, 48)])
def test_prefill_gpu(rng, head_dim, hq, hkv, block_size):
    case = make_case(rng, *MIXED, hq, hkv, head_dim, block_size)
    expected = dense_expected(case)
    for variant in shipped_prefill(head_dim):
        assert rel_error(run_prefill(case, variant=variant), expected) < TOL, variant


@pytest.mark.gpu
def test_prefill_gpu_packed_and_default(rng):
    case = make_case(rng, [5, 130, 64], [5, 300, 1000], 8, 2, 128, 16, packed=True)
    assert rel_error(run_prefill(case), dense_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gpu_noncausal_chunked(rng, head_dim):
    # non-causal with tails, and causal chunks at the end of longer contexts (offset kv_len - q_len)
    case = make_case(rng, [1, 70, 129, 200], [1, 300, 129, 1111], 8, 2, head_dim, 32)
    for causal in (False, True):
        ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"],
                                            case["kv_lens"], case["tables"], case["scale"], dtype=np.float64,
                                            causal=causal)
        for variant in shipped_prefill(head_dim):
            if variant == "simple" and not causal:
                continue
            assert rel_error(run_prefill(case, variant=variant, causal=causal), ref) < TOL, (variant, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_size", [8, 16, 128, 256])
def test_prefill_gpu_sm90_copy_paths(rng, tma, block_size):
    # v4/v5 with and without TMA copies: lengths that end mid-page and mid-tile, NaN in every unused cache slot
    case = make_case(rng, [1, 37, 300, 129], [1, 300, 1000, 129], 8, 2, 128, block_size)
    expected = dense_expected(case)
    for variant in set(shipped_prefill(128)) & {"v4", "v5"}:
        assert rel_error(run_prefill(case, variant=variant, use_tma=tma), expected) < TOL, variant


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_gpu_long(rng, head_dim):
    case = make_case(rng, *LONG_PREFILL, 4, 1, head_dim, 16)
    expected = dense_expected(case)
    for variant in shipped_prefill(head_dim):
        if variant != "simple":
            assert row_error(run_prefill(case, variant=variant), expected) < TOL_LONG, variant


@pytest.mark.gpu
def test_prefill_gpu_long_catches_planted_bugs(rng):
    """The kernel fed a misplaced page (one page of the long sequence read from another's block) or a 2% scale error fails the
    long-context tolerance: the check above would catch a kernel that made either mistake."""
    case = make_case(rng, *LONG_PREFILL, 4, 1, 128, 16)
    expected = dense_expected(case)
    for variant in shipped_prefill(128):
        if variant != "simple":
            assert row_error(run_prefill(case, variant=variant, tables=misplace_page(case, 1, 900, 1800)),
                             expected) > TOL_LONG, variant
            assert row_error(run_prefill(case, variant=variant, scale=case["scale"] * 1.02), expected) > TOL_LONG


DECODE_SHAPES = [(4, 4, 16, False), (8, 4, 32, True), (16, 4, 256, False), (40, 8, 64, True), (16, 2, 16, False),
                 (12, 4, 48, True), (24, 4, 128, False), (28, 4, 16, True), (8, 8, 8, False)]
DECODE_LENS = [0, 1, 15, 16, 17, 63, 65, 200, 1000, 3000, 4096]  # around the 16-key and 64-key edges, a padding row


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4", "v4w8", "v2"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size,packed", DECODE_SHAPES)
def test_decode_gpu(rng, variant, head_dim, hq, hkv, block_size, packed):
    if variant == "v4w8" and hq // hkv > 4:
        pytest.skip("8-warp CTAs are compiled for groups of at most 4")
    case = make_case(rng, [1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, head_dim, block_size, packed=packed)
    assert rel_error(run_decode(case, 4096, variant=variant), dense_expected(case)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4", "v4w4", "v4w8", "v2"])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_decode_gpu_long(rng, variant, num_seqs):
    case = make_case(rng, [1] * num_seqs, LONG_DECODE[:num_seqs], 32, 8, 128, 16)
    assert row_error(run_decode(case, 32768, variant=variant), dense_expected(case)) < TOL_LONG


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4", "v4w8", "v2"])
def test_decode_gpu_long_catches_planted_bugs(rng, variant):
    case = make_case(rng, [1] * 3, LONG_DECODE, 32, 8, 128, 16)
    expected = dense_expected(case)
    assert row_error(run_decode(case, 32768, variant=variant, tables=misplace_page(case, 0, 700, 1500)),
                     expected) > TOL_LONG
    assert row_error(run_decode(case, 32768, variant=variant, scale=case["scale"] * 1.02), expected) > TOL_LONG


@pytest.mark.gpu
def test_decode_gpu_v2_fallback_block_size_1(rng):
    # block size 1 with 120000 keys: even 256 splits leave a split more pages than v4's shared page table holds,
    # so v2 runs
    case = make_case(rng, [1, 1], [120000, 3], 8, 2, 64, 1)
    assert D.plan_decode("v4", 2, 2, 120000, 1, 64, 4, 132)[0].variant == "v2"
    assert row_error(run_decode(case, 120000), dense_expected(case)) < TOL_LONG


def _graph_replays(rng, variant, hq=16, hkv=4):
    """Split counters reset themselves: eager calls and graph replays give the same rows, call after call."""
    from xserv.runtime.graphs import CUDAGraph

    case = make_case(rng, [1] * 4, [5000, 0, 77, 1], hq, hkv, 128, 16)
    t = on("cuda", case)
    out = poisoned((4, hq, 128), bfloat16)

    def step():
        A.attention_decode(t["q"], t["k_cache"], t["v_cache"], t["kv_lens"], t["block_tables"], case["scale"],
                           max_kv_len=8192, out=out, variant=K.decode(variant))

    step()
    first = out.numpy()
    assert rel_error(first, dense_expected(case)) < TOL
    step()
    assert np.array_equal(out.numpy().view(np.uint16), first.view(np.uint16))
    graph = CUDAGraph()
    with graph.capture():
        step()
    for _ in range(3):
        out.copy_(np.full((4, hq, 128), np.nan, bfloat16))
        graph.replay()
        assert np.array_equal(out.numpy().view(np.uint16), first.view(np.uint16))
    graph.close()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4", "v4w8"])
def test_decode_gpu_graph_replays(rng, variant):
    _graph_replays(rng, variant)


@pytest.mark.gpu
def test_decode_gpu_graph_replays_subgroups(rng):
    from xserv.runtime import get_device

    assert D.plan_decode("v4", 4, 2, 8192, 16, 128, 8, get_device().multiprocessor_count)[0].subgroups == 2
    _graph_replays(rng, "v4", hq=16, hkv=2)  # G = 8: two subgroups, a counter each


@pytest.mark.gpu
@pytest.mark.parametrize("hq,lens", [(48, [8192]), (64, [8192]), (64, [4096, 5]), (48, [300]), (40, [2048]),
                                     (40, [1000, 5, 700]), (40, [300])])
def test_decode_gpu_subgroups(rng, hq, lens):
    """Groups of 5, 6 and 8 split into 5, 2 and 2 query-head subgroups (8-warp CTAs) at few sequences: near the
    float64 reference, and a misplaced page or a 2% scale error fails the same check."""
    from xserv.runtime import get_device

    longest = max(lens)
    sms = get_device().multiprocessor_count
    assert D.plan_decode("v4", len(lens), 8, longest, 16, 128, hq // 8, sms)[0].subgroups == (5 if hq == 40 else 2)
    case = make_case(rng, [1] * len(lens), lens, hq, 8, 128, 16)
    expected = dense_expected(case)
    assert row_error(run_decode(case, longest), expected) < TOL_LONG
    if longest >= 1000:
        assert row_error(run_decode(case, longest, tables=misplace_page(case, 0, 10, 60)), expected) > TOL_LONG
        assert row_error(run_decode(case, longest, scale=case["scale"] * 1.02), expected) > TOL_LONG


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


# ---- attention_decode_rope on the GPU ---------------------------------------------------------------------------
# (hq, hkv, block_size): G = 1..8 with odd head counts and group sizes, several block sizes
ROPE_SHAPES = [(4, 4, 16), (8, 4, 32), (12, 4, 8), (16, 4, 256), (40, 8, 16), (12, 2, 64), (28, 4, 48), (8, 1, 16)]
# around the 16/32/64-key edges of the ring and of the splits, a few splits, a multiple of the chunk and not
ROPE_LENS = [1, 2, 15, 16, 17, 33, 63, 64, 65, 128, 200, 520, 1000, 3000]


def check_decode_rope(c, variant=None, max_kv_len=None):
    """The fused op is bit-identical to qk_norm_rope_write_kv followed by attention_decode (out and both caches),
    leaves qkv as it was (the two-op fallback, variant v2, rotates it in place), and agrees with the composition of
    the NumPy references (the attention in float64)."""
    out, kc, vc, qkv = run_decode_rope(c, variant=variant, max_kv_len=max_kv_len)
    want_out, want_kc, want_vc = run_rope_then_decode(c, variant=variant, max_kv_len=max_kv_len)
    np.testing.assert_array_equal(u16(out), u16(want_out))
    np.testing.assert_array_equal(u16(kc), u16(want_kc))
    np.testing.assert_array_equal(u16(vc), u16(want_vc))
    if variant != "v2":
        np.testing.assert_array_equal(u16(qkv), u16(c["qkv"]))
    ref_out, ref_kc, ref_vc = rope_expected(c)
    assert row_error(out, ref_out) < TOL
    for got, ref in ((kc, ref_kc), (vc, ref_vc)):
        written = ~np.isnan(ref.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), ~written)  # nothing else written
        assert rel_error(got[written], ref[written]) < 3e-3
    np.testing.assert_array_equal(u16(vc), u16(ref_vc))  # v: copied bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", ROPE_SHAPES)
def test_decode_rope_gpu(rng, norm, head_dim, hq, hkv, block_size):
    lens = ROPE_LENS + [1, 0, 300]
    kinds = ["new"] * len(ROPE_LENS) + ["pad", "zero", "elsewhere"]
    check_decode_rope(rope_case(rng, lens, hq, hkv, head_dim, block_size, norm=norm, kinds=kinds))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (14, 2), (64, 8), (48, 8), (40, 8)])
@pytest.mark.parametrize("kv_len", [1, 2, 64, 65, 520, 1000, 4096, 4097, 20000])
def test_decode_rope_gpu_one_sequence(rng, head_dim, hq, hkv, kv_len):
    """Batch 1, as the engine's one-request decode: from one split to many, the new key in the stage that goes out
    before pdl_wait or in a later one (each split of 64 to 1024 keys), a graph's max_kv_len bucket above kv_len."""
    c = rope_case(rng, [kv_len], hq, hkv, head_dim, 16)
    check_decode_rope(c, max_kv_len=max(kv_len, 512))


@pytest.mark.gpu
def test_decode_rope_gpu_v2_fallback_and_variant(rng):
    # block size 1 with 120000 keys: v4's shared page table cannot hold a split's pages, so two launches (v2)
    c = rope_case(rng, [120000, 3], 8, 2, 64, 1, kinds=["new", "pad"])
    assert D.plan_decode("v4", 2, 2, 120000, 1, 64, 4, 132)[0].variant == "v2"
    out = run_decode_rope(c)[0]
    assert row_error(out, rope_expected(c)[0]) < TOL_LONG
    check_decode_rope(rope_case(rng, [5, 700, 1], 16, 4, 128, 16, kinds=["new", "new", "pad"]), variant="v2")


@pytest.mark.gpu
def test_decode_rope_gpu_bad_position_gives_nan(rng):
    c = rope_case(rng, [10, 20, 30], 8, 2, 128, 16)
    c["pos"][1] = c["cos_sin"].shape[0]  # outside the table: NaN in that sequence's q, k (and so its output)
    out, kc, _, _ = run_decode_rope(c)
    want_out, want_kc, _ = run_rope_then_decode(c)
    np.testing.assert_array_equal(u16(out), u16(want_out))
    np.testing.assert_array_equal(u16(kc), u16(want_kc))
    assert np.all(np.isnan(out[1].astype(np.float32))) and np.all(np.isfinite(out[[0, 2]].astype(np.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_decode_rope_gpu_pdl_chain_graph(rng, fused):
    """The model's chain with programmatic dependent launch, captured in a CUDA graph and replayed: the qkv GEMV
    (rmsnorm_linear), then the fused op, or qk_norm_rope_write_kv then attention_decode. Before every replay qkv and
    the new tokens' cache slots are NaN (host copies before the launch), so a kernel that read either before its pdl_wait would show
    NaN. Replays give the bits of the eager run."""
    from xserv.ops.gemv import rmsnorm_linear
    from xserv.ops.rope import qk_norm_rope_write_kv
    from xserv.runtime.graphs import CUDAGraph

    hq, hkv, d, hidden = 16, 8, 128, 1024
    lens = [520, 37, 1, 4000]
    c = rope_case(rng, lens, hq, hkv, d, 16, kinds=["new", "new", "pad", "new"])
    residual = Tensor.from_numpy(random_array(rng, (len(lens), hidden), np.float32, mean=0.0))
    norm_w = Tensor.from_numpy(random_array(rng, (hidden,), bfloat16, mean=1.0, std=0.1))
    w_qkv = Tensor.from_numpy(random_array(rng, ((hq + 2 * hkv) * d, hidden), bfloat16, mean=0.0, std=0.03))
    t = {n: Tensor.from_numpy(c[n]) for n in ("qw", "kw", "pos", "cos_sin", "slots", "kv_lens", "tables")}
    kc, vc = Tensor.from_numpy(c["k_cache"]), Tensor.from_numpy(c["v_cache"])
    qkv = Tensor.empty((len(lens), hq + 2 * hkv, d), bfloat16, "cuda")
    out = Tensor.empty((len(lens), hq, d), bfloat16, "cuda")
    nan_qkv, nan_out = np.full(qkv.shape, np.nan, bfloat16), np.full(out.shape, np.nan, bfloat16)

    def poison():  # eager host copies, before the step or the graph's replay
        qkv.copy_(nan_qkv)
        out.copy_(nan_out)
        kc.copy_(c["k_cache"])  # the new tokens' slots NaN again
        vc.copy_(c["v_cache"])

    def step():
        rmsnorm_linear(residual, norm_w, ROPE_EPS, w_qkv, out=qkv.view(len(lens), (hq + 2 * hkv) * d))
        if fused:
            A.attention_decode_rope(qkv, t["qw"], t["kw"], t["pos"], t["cos_sin"], hq, ROPE_EPS, kc, vc, t["slots"],
                                    t["kv_lens"], t["tables"], c["scale"], 4096, out=out)
        else:
            qk_norm_rope_write_kv(qkv, t["qw"], t["kw"], t["pos"], t["cos_sin"], hq, hkv, ROPE_EPS, kc, vc,
                                  t["slots"], pdl=True)
            A.attention_decode(qkv, kc, vc, t["kv_lens"], t["tables"], c["scale"], 4096, out=out, num_q_heads=hq)

    poison()
    step()
    first = [x.numpy() for x in (out, kc, vc)]
    assert np.all(np.isfinite(first[0].astype(np.float32)))
    graph = CUDAGraph()
    with graph.capture():
        step()
    for _ in range(5):
        poison()
        graph.replay()
        for got, want in zip((out, kc, vc), first):
            np.testing.assert_array_equal(u16(got.numpy()), u16(want))
    graph.close()


# ---------------------------------------------------------------------------------------------------------------
# GPU, on request: the development kernels (cuda_src/dev/), which the benchmark times next to the shipped ones
# ---------------------------------------------------------------------------------------------------------------

@dev
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 4, 16), (8, 4, 20), (16, 2, 64), (8, 1, 48)])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_gpu_dev_variants(rng, head_dim, hq, hkv, block_size, causal):
    from xserv.runtime import get_device

    case = make_case(rng, [1, 70, 129, 200], [1, 300, 129, 1111], hq, hkv, head_dim, block_size)
    ref = A.attention_prefill_reference(case["q"], case["k_cache"], case["v_cache"], case["cu"], case["kv_lens"],
                                        case["tables"], case["scale"], dtype=np.float64, causal=causal)
    for variant, by_dim in K.DEV_PREFILL.items():
        k = by_dim.get(head_dim)
        if k is None or k.tma != "none" and get_device().arch != "sm_90a":
            continue
        assert rel_error(run_prefill(case, variant=k, causal=causal), ref) < TOL, variant


@dev
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v3", "v3s3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv,block_size,packed", DECODE_SHAPES)
def test_decode_gpu_dev_v3(rng, variant, head_dim, hq, hkv, block_size, packed):
    case = make_case(rng, [1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, head_dim, block_size, packed=packed)
    assert rel_error(run_decode(case, 4096, variant=K.decode(variant)), dense_expected(case)) < TOL


@dev
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v4s3", "v4s4", "v4w16"])
@pytest.mark.parametrize("head_dim,hq,hkv,block_size", [(128, 32, 8, 16), (128, 16, 8, 48), (64, 16, 8, 8)])
def test_decode_gpu_dev_v4_experiments(rng, variant, head_dim, hq, hkv, block_size):
    case = make_case(rng, [1] * 7, [0, 1, 15, 17, 65, 1000, 4096], hq, hkv, head_dim, block_size)
    assert rel_error(run_decode(case, 4096, variant=K.decode(variant)), dense_expected(case)) < TOL


def _check_wide(rng, monkeypatch, variant, head_dim, hq, hkv, one_split):
    """Wide CTAs (8 and 16 warps): the fused entry is bit-identical to its two-op form and near the references,
    with the plan's splits and with one split over up to 2,000 keys (each CTA many stages of its ring)."""
    if one_split:
        shipped = D.plan_decode

        def one(variant, num_seqs, num_kv_heads, max_kv_len, *rest):
            k, _, _ = shipped(variant, num_seqs, num_kv_heads, max_kv_len, *rest)
            return k, 1, -(-max_kv_len // 64) * 64

        monkeypatch.setattr(D, "plan_decode", one)
    lens, kinds = [1, 17, 65, 520, 1000, 2000, 0], ["new"] * 6 + ["zero"]
    check_decode_rope(rope_case(rng, lens, hq, hkv, head_dim, 16, kinds=kinds), variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 16, 8), (128, 32, 8), (64, 16, 8), (128, 8, 8), (64, 12, 4)])
@pytest.mark.parametrize("one_split", [False, True])
def test_decode_rope_gpu_wide(rng, monkeypatch, head_dim, hq, hkv, one_split):
    _check_wide(rng, monkeypatch, "v4w8", head_dim, hq, hkv, one_split)


@dev
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 16, 8), (128, 32, 8), (64, 16, 8)])
@pytest.mark.parametrize("one_split", [False, True])
def test_decode_rope_gpu_dev_wide(rng, monkeypatch, head_dim, hq, hkv, one_split):
    _check_wide(rng, monkeypatch, K.decode("v4w16"), head_dim, hq, hkv, one_split)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (8, 8), (32, 4), (48, 8), (40, 8)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("lens", [[513], [1], [65, 520, 1000, 1, 0], [4097], [20000]])
def test_decode_rope_gpu_lean_entry(rng, monkeypatch, hq, hkv, norm, lens):
    """The fused op's _lean entries (the fused path only, at most 16 splits) give the full 8-warp entry's bits (out
    and both caches); longer contexts (more splits) take the full entry either way; near the references; padding
    and zero rows. 32/4 (the 30B-A3B), 48/8 and 40/8 run the query-head subgroup kernels' _lean entries (2 x 4,
    2 x 3, 5 x 1) at the short contexts."""
    kinds = ["new"] * len(lens) if len(lens) == 1 else ["new", "elsewhere", "new", "pad", "zero"]
    c = rope_case(rng, lens, hq, hkv, 128, 16, norm=norm, kinds=kinds)
    max_kv = max(max(lens), 512)
    got = run_decode_rope(c, max_kv_len=max_kv)
    monkeypatch.setattr(D, "lean_entry", lambda *plan: False)  # the full entries
    want = run_decode_rope(c, max_kv_len=max_kv)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(u16(g), u16(w))
    assert row_error(got[0], rope_expected(c)[0]) < TOL


def test_lean_entry_only_where_the_plan_allows():
    """The fused op takes the _lean entry for the 8-warp kernel's shapes with one (head_dim 128: groups 1-4 whole,
    groups 5, 6 and 8 in the plan's query-head subgroups) and at most V4_FAST_COMBINE splits (1 x 513 keys: 9; 1 x
    32k: 32)."""
    wide = D.DECODE_KERNELS["v4w8"]
    k, splits, _ = D.plan_decode("v4", 1, 8, 513, 16, 128, 2, 132)
    assert k is wide and splits <= D.V4_FAST_COMBINE and D.lean_entry(k, 128, 2, splits)
    k, splits, _ = D.plan_decode("v4", 1, 8, 32768, 16, 128, 2, 132)
    assert splits > D.V4_FAST_COMBINE and not D.lean_entry(k, 128, 2, splits)
    assert D.lean_entry(wide, 128, 4, 16) and not D.lean_entry(wide, 128, 4, 17)
    assert not D.lean_entry(wide, 64, 2, 8)  # no _lean entry compiled for head_dim 64
    assert not D.lean_entry(dataclasses.replace(wide, subgroups=2), 128, 4, 8)  # no _g2_s2_w8_r2_lean
    # the query-head subgroup kernels' entries: 30B-A3B (32/4), Qwen3-32B (64/8), 14B (40/8), and a group of 6
    for hkv, group, r in ((4, 8, 2), (8, 8, 2), (8, 5, 5), (8, 6, 2)):
        k, splits, _ = D.plan_decode("v4", 1, hkv, 513, 16, 128, group, 132)
        assert (k.variant, k.subgroups) == ("v4w8", r) and D.lean_entry(k, 128, group, splits), (hkv, group)
        assert not D.lean_entry(k, 128, group, D.V4_FAST_COMBINE + 1)
        assert not D.lean_entry(k, 64, group, splits)  # head_dim 64: the full entries only
    assert not D.lean_entry(D.DECODE_KERNELS["v4"], 128, 2, 8)  # the 4-warp kernel has none


@dev
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v3", "v3s3"])
def test_decode_gpu_dev_graph_replays(rng, variant):
    _graph_replays(rng, K.decode(variant))
