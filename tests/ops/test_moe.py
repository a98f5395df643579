"""The moe family (xserv/ops/moe.py, cuda_src/moe.cu): routing, the expert-sorted list, the grouped GEMMs and the
combine, against independent NumPy loops (CPU) and the NumPy reference (GPU)."""
import numpy as np
import pytest

from xserv.ops.moe import (MoeWorkspace, MoeShape, expert_mlp_reference, moe_experts, moe_experts_reference,
                           moe_route_reference)
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import poisoned, random_array, rel_error


def weights(rng, e, h, inter, std=0.05):
    router = random_array(rng, (e, h), bfloat16, mean=0.0, std=0.5 / np.sqrt(h))
    gate_up = random_array(rng, (e, 2 * inter, h), bfloat16, mean=0.0, std=std)
    down = random_array(rng, (e, h, inter), bfloat16, mean=0.0, std=std)
    return router, gate_up, down


def route64(logits, k, renormalize):
    """Per token, in float64: softmax, the k largest (equal ones: lower id), renormalised."""
    ids, ws = [], []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        order = sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]
        w = p[order]
        ids.append(order)
        ws.append(w / w.sum() if renormalize else w)
    return np.array(ids), np.array(ws)


def moe64(x, router, gate_up, down, k, renormalize):
    """Token by token, slot by slot, in float64 (no bf16 rounding at all)."""
    x64 = x.astype(np.float64)
    ids, ws = route64(x64 @ router.astype(np.float64).T, k, renormalize)
    inter = gate_up.shape[1] // 2
    out = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        for j in range(k):
            e = ids[t, j]
            gu = gate_up[e].astype(np.float64) @ x64[t]
            g, u = gu[:inter], gu[inter:]
            out[t] += ws[t, j] * (down[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return out


# ---- CPU -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_reference_matches_a_float64_loop(rng, renormalize):
    logits = rng.normal(0, 2, (37, 24)).astype(np.float32)
    ids, w = moe_route_reference(logits, 5, renormalize)
    ids64, w64 = route64(logits, 5, renormalize)
    np.testing.assert_array_equal(ids, ids64)
    np.testing.assert_allclose(w, w64, rtol=1e-5)
    assert ids.dtype == np.int32 and w.dtype == np.float32
    if renormalize:
        np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)


def test_route_reference_breaks_ties_by_lower_expert():
    logits = np.zeros((2, 8), np.float32)
    logits[1, [6, 3]] = 1.0
    ids, w = moe_route_reference(logits, 3, True)
    assert ids[0].tolist() == [0, 1, 2]
    assert ids[1].tolist() == [3, 6, 0]
    np.testing.assert_allclose(w[0], 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_matches_a_float64_loop(rng, renormalize):
    t, e, k, h, inter = 9, 6, 2, 32, 24
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter, std=0.2)
    got = moe_experts_reference(x, router, gate_up, down, k, renormalize)
    assert rel_error(got, moe64(x, router, gate_up, down, k, renormalize)) < 1e-2


def test_expert_mlp_rounds_as_the_dense_mlp(rng):
    from xserv.ops.activation import silu_and_mul_reference
    from xserv.ops.linear import linear_reference

    x = random_array(rng, (5, 32), bfloat16)
    _, gate_up, down = weights(rng, 1, 32, 16, std=0.3)
    gu = linear_reference(x, gate_up[0]).astype(bfloat16)
    act = silu_and_mul_reference(gu).astype(bfloat16)
    want = linear_reference(act, down[0]).astype(bfloat16).astype(np.float32)
    np.testing.assert_array_equal(expert_mlp_reference(x, gate_up[0], down[0]), want)


def test_cpu_store_and_residual_add(rng):
    t, e, k, h, inter = 4, 8, 2, 16, 8
    x = random_array(rng, (t, h), bfloat16)
    router, gate_up, down = weights(rng, e, h, inter, std=0.3)
    args = [Tensor.from_numpy(a, "cpu") for a in (x, router, gate_up, down)]
    ref = moe_experts_reference(x, router, gate_up, down, k, True)
    out = moe_experts(*args, k, True)
    assert out.dtype == bfloat16
    np.testing.assert_array_equal(out.array, ref.astype(bfloat16))
    residual = rng.normal(0, 1, (t, h)).astype(np.float32)
    res = Tensor.from_numpy(residual.copy(), "cpu")
    moe_experts(*args, k, True, out=res)
    np.testing.assert_array_equal(res.array, residual + ref.astype(bfloat16).astype(np.float32))


def test_bad_arguments_name_the_problem(rng):
    x, router, gate_up, down = (Tensor.from_numpy(a, "cpu") for a in (
        random_array(rng, (2, 16), bfloat16), *weights(rng, 4, 16, 8)))
    with pytest.raises(ValueError, match="top_k"):
        moe_experts(x, router, gate_up, down, 5, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_experts(x, router, gate_up, down, 0, True)
    with pytest.raises(ValueError, match="router"):
        moe_experts(x, Tensor.from_numpy(random_array(rng, (4, 8), bfloat16), "cpu"), gate_up, down, 2, True)
    with pytest.raises(ValueError, match="gate_up"):
        moe_experts(x, router, Tensor.from_numpy(random_array(rng, (3, 16, 16), bfloat16), "cpu"), down, 2, True)
    with pytest.raises(ValueError, match="down"):
        moe_experts(x, router, gate_up, Tensor.from_numpy(random_array(rng, (4, 8, 16), bfloat16), "cpu"), 2, True)
    with pytest.raises(ValueError, match="out"):
        moe_experts(x, router, gate_up, down, 2, True, out=Tensor.empty((2, 16), np.float16, "cpu"))
    with pytest.raises(ValueError, match="multiples of 8"):
        moe_experts(*(Tensor.from_numpy(a, "cpu") for a in (random_array(rng, (2, 12), bfloat16),
                                                            *weights(rng, 4, 12, 8))), 2, True)


def combine_reference(y, w, out):
    """moe_combine's arithmetic on the kernel's own expert rows y [k, H] (bf16 values) and weights w [k] (one token),
    in float32 step by step (each product and each sum rounded, slot order): bf16 stored, or added to an fp32 out."""
    acc = np.zeros(y.shape[1], np.float32)
    for j in range(y.shape[0]):
        acc = (acc + (np.float32(w[j]) * y[j].astype(np.float32)).astype(np.float32)).astype(np.float32)
    if out.dtype == np.float32:
        return (out[0] + _bf16_values(acc)).astype(np.float32)[None]
    return acc.astype(bfloat16)[None]


def _bf16_values(a):
    return a.astype(bfloat16).astype(np.float32)


# which GEMM entries serve which path (no GPU: a recorded launch per stage)
@pytest.mark.parametrize("arch, fp8, size, portable, want", [
    ("sm_90a", False, "mid", False, "tma"), ("sm_90a", False, "large", False, "tma"),
    ("sm_80@sm_90a", False, "mid", False, "mma"), ("sm_90a", False, "large", True, "mma"),
    ("sm_90a", False, "small", False, "mma"), ("sm_90a", True, "large", False, "mma"),
    ("sm_80@sm_90a", False, "large", False, "mma"), ("sm_89@sm_90a", False, "mid", False, "mma")])
def test_the_hopper_paths_mid_and_large_bf16_tiles_take_the_wgmma_entries(monkeypatch, arch, fp8, size, portable,
                                                                            want):
    from types import SimpleNamespace

    import xserv.runtime as runtime
    from xserv.ops import moe as M

    launched = []
    monkeypatch.setattr(runtime, "get_device", lambda: SimpleNamespace(arch=arch))
    import xserv.runtime.tma as tma

    monkeypatch.setattr(runtime, "kernel", lambda family, name: (
        lambda grid, threads, x, w, *args, smem=0, pdl=False: launched.append(
            (family, name, grid, threads, smem) + ((args[0],) if name.endswith("_tma") else ()))))
    monkeypatch.setattr(runtime, "get_runtime", lambda: "rt")
    monkeypatch.setattr(tma, "matrix_tensor_map", lambda rt, address, rows, cols, box_rows: (
        "map", rt, address, rows, cols, box_rows))
    monkeypatch.setattr(tma, "gate_up_tensor_map", lambda rt, address, experts, inter, cols, groups: (
        "gate_up_map", rt, address, experts, inter, cols, groups))
    t, shape = 300, MoeShape(32, 8, 512, 256)
    ws = SimpleNamespace(logits=np.zeros((t, 32), np.float32), ids=0, weights=0, sorted=0, tile_expert=0, act=0, y=0,
                         counters=0)
    out = SimpleNamespace(dtype=bfloat16)
    gate_up, down = SimpleNamespace(ptr=1 << 20), SimpleNamespace(ptr=1 << 30)
    stages = dict(M.moe_stages(0, 0, gate_up, down, shape, True, out, ws, t, size=size,
                               scales=(0, 0) if fp8 else None, portable_tiles=portable))
    stages["gate_up"](), stages["down"]()
    tiles = M._max_tiles(t * 8, 32, M._TILES[size])
    if want == "mma":
        sfx = "_fp8" if fp8 else ""
        cfg = M._gemm_config(**M._GEMM_SHAPES[size], fp8=fp8)
        assert launched == [
            (f"moe:e1_x{int(fp8)}", f"moe_gemm_gate_up_{size}{sfx}", (256 // (cfg.rows // 2), tiles), cfg.threads,
             cfg.smem),
            (f"moe:e1_x{int(fp8)}", f"moe_gemm_down_{size}{sfx}", (512 // cfg.rows, tiles), cfg.threads, cfg.smem)]
    else:  # moe_sm90.cu's shapes, written out: 128 weight rows a CTA, threads, a 3-stage ring 1024-byte aligned
        threads = {"mid": 128, "large": 256}[size]
        smem = 3 * (128 + M._TILES[size]) * 64 * 2 + 1024
        # the weights' tensor maps after the weights: 32 experts' gate/up of width 256 over 512 columns in boxes of
        # 8 groups of 8 gate and 8 up rows, down [32 x 512, 256] in boxes of a CTA's 128 rows
        assert launched == [
            ("moe_sm90:e1", f"moe_wg_gate_up_{size}_tma", (256 // 64, tiles), threads, smem,
             ("gate_up_map", "rt", 1 << 20, 32, 256, 512, 8)),
            ("moe_sm90:e1", f"moe_wg_down_{size}_tma", (512 // 128, tiles), threads, smem,
             ("map", "rt", 1 << 30, 32 * 512, 256, 128))]


# ---- CUDA ----------------------------------------------------------------------------------------------------------
def run_cuda(x, router, gate_up, down, k, renormalize, out_dtype=bfloat16, residual=None, size=None,
             portable_tiles=False):
    """size: force a GEMM tile shape (small / mid / large) through moe_stages, else moe_experts picks;
    portable_tiles: moe.cu's mma.sync mid and large tiles on the hopper path too."""
    from xserv.ops.moe import moe_stages

    t, h = x.shape
    shape = MoeShape(router.shape[0], k, h, gate_up.shape[1] // 2)
    ws = MoeWorkspace(shape, t, "cuda")
    out = Tensor.from_numpy(residual) if residual is not None else poisoned((t, h), out_dtype)
    args = [Tensor.from_numpy(a) for a in (x, router, gate_up, down)]
    if size is None:
        moe_experts(*args, k, renormalize, out=out, workspace=ws)
    else:
        for _, launch in moe_stages(*args, shape, renormalize, out, ws, t, size=size, portable_tiles=portable_tiles):
            launch()
    return out.numpy(), ws


def check_sorted_list(ws, t, k, tile):
    """Every entry once, in a tile of its own expert; padding -1; the tile count the sum of ceil(n_e / tile)."""
    ids = ws.ids.numpy()[:t * k]
    tiles = int(ws.tile_expert.numpy()[0])
    counts = np.bincount(ids, minlength=ws.shape.num_experts)
    assert tiles == int(sum(-(-n // tile) for n in counts))
    experts = ws.tile_expert.numpy()[1:1 + tiles]
    sorted_ = ws.sorted.numpy()[:tiles * tile].reshape(tiles, tile)
    real = sorted_[sorted_ >= 0]
    assert sorted(real.tolist()) == list(range(t * k))
    for i in range(tiles):
        for entry in sorted_[i]:
            if entry >= 0:
                assert ids[entry] == experts[i]
    assert np.all(np.diff(experts) >= 0)  # tiles in expert order


SHAPES = [  # t, experts, k, hidden, inter
    (1, 128, 8, 2048, 768),  # Qwen3-30B-A3B, one decode token
    (5, 16, 4, 256, 128),
    (64, 128, 8, 2048, 768),  # a decode batch
    (3, 8, 2, 136, 200),  # K and N tails (not multiples of 64 / 16)
    (300, 32, 8, 512, 256),  # 2400 entries: the prefill tiles
    (20, 200, 6, 128, 64),  # more than 128 experts: 16 per lane
]


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}_e{}_k{}_h{}_i{}".format(*s))
def test_cuda_matches_reference(rng, shape, renormalize):
    from xserv.ops.moe import _TILES, _tile_for

    t, e, k, h, inter = shape
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    got, ws = run_cuda(x, router, gate_up, down, k, renormalize)
    logits = ws.logits.numpy()[:t]
    np.testing.assert_allclose(logits, x.astype(np.float32) @ router.astype(np.float32).T, rtol=1e-4, atol=1e-5)
    ids, w = moe_route_reference(logits, k, renormalize)
    np.testing.assert_array_equal(ws.ids.numpy()[:t * k].reshape(t, k), ids)
    np.testing.assert_allclose(ws.weights.numpy()[:t * k].reshape(t, k), w, rtol=2e-6)
    check_sorted_list(ws, t, k, _TILES[_tile_for(t * k, e)])
    ref = moe_experts_reference(x, router, gate_up, down, k, renormalize, logits=logits)
    assert rel_error(got, ref.astype(bfloat16)) < 4e-3
    if t <= 5:
        assert rel_error(got, moe64(x, router, gate_up, down, k, renormalize)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("portable", [False, True], ids=["path", "mma"])  # the hopper path's mid / large: wgmma
@pytest.mark.parametrize("size", ["small", "mid", "large"])
@pytest.mark.parametrize("shape", [(300, 32, 8, 512, 256), (37, 8, 3, 200, 136)], ids=["t300", "tails"])
def test_cuda_every_tile_shape(rng, size, shape, portable):
    from xserv.ops.moe import _TILES

    t, e, k, h, inter = shape
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    got, ws = run_cuda(x, router, gate_up, down, k, True, size=size, portable_tiles=portable)
    check_sorted_list(ws, t, k, _TILES[size])
    ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:t])
    assert rel_error(got, ref.astype(bfloat16)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["mid", "large"])
def test_cuda_wgmma_tiles_match_the_mma_tiles(rng, size):
    """moe_sm90.cu's wgmma GEMMs (the hopper path's mid and large tiles) against moe.cu's mma.sync ones on the same
    inputs at Qwen3-30B-A3B's widths: within rounding of each other (the sums' order inside a k16 step is the
    hardware's) and of the reference; skipped where the path has no wgmma form."""
    from xserv.ops import moe as M

    if not M.uses_wgmma():
        pytest.skip("the portable path has no wgmma form")
    t, e, k, h, inter = 520, 32, 8, 2048, 768
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    wg, ws = run_cuda(x, router, gate_up, down, k, True, size=size)
    mma, _ = run_cuda(x, router, gate_up, down, k, True, size=size, portable_tiles=True)
    ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:t])
    assert rel_error(wg, ref.astype(bfloat16)) < 4e-3
    assert rel_error(wg, mma) < 4e-3 and rel_error(wg, mma) <= 2 * max(rel_error(mma, ref.astype(bfloat16)), 1e-3)


@pytest.mark.gpu
def test_cuda_adds_to_the_residual_and_is_deterministic(rng):
    t, e, k, h, inter = 40, 64, 6, 512, 384
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    residual = rng.normal(0, 1, (t, h)).astype(np.float32)
    got, ws = run_cuda(x, router, gate_up, down, k, True, residual=residual)
    again, _ = run_cuda(x, router, gate_up, down, k, True, residual=residual)
    np.testing.assert_array_equal(got, again)  # the atomics pick rows, never the arithmetic order
    ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:t])
    assert rel_error(got - residual, ref) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("t", [3, 400])
def test_cuda_shared_and_unpicked_experts(rng, t):
    """Every token picks experts 0..k-2 (one expert holds all t tokens, over several tiles at t = 400); the last
    experts are never picked (no tiles, nothing read); the last slot varies."""
    e, k, h, inter = 32, 4, 256, 128
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    # a constant direction in x makes experts 0..k-2 win for every token
    x[:, 0] = 4.0
    router[:, 0] = 0
    router[:k - 1, 0] = np.linspace(8, 4, k - 1).astype(bfloat16)  # logits 32, 24, 16 against ~N(0, 0.5)
    router[e - 4:] = 0
    router[e - 4:, 0] = -3.0
    got, ws = run_cuda(x, router, gate_up, down, k, False)
    ids = ws.ids.numpy()[:t * k].reshape(t, k)
    assert np.all(ids[:, :k - 1] == np.arange(k - 1)) and not np.isin(ids, np.arange(e - 4, e)).any()
    from xserv.ops.moe import _TILES, _tile_for

    check_sorted_list(ws, t, k, _TILES[_tile_for(t * k, e)])
    ref = moe_experts_reference(x, router, gate_up, down, k, False, logits=ws.logits.numpy()[:t])
    assert rel_error(got, ref.astype(bfloat16)) < 4e-3


@pytest.mark.gpu
def test_cuda_workspace_sizes_every_step_below_its_maximum(rng):
    """One workspace made for 512 tokens (the prefill tiles) serves steps of 1..512 tokens (the decode tiles)."""
    e, k, h, inter = 128, 8, 256, 64
    router, gate_up, down = weights(rng, e, h, inter)
    ws = MoeWorkspace(MoeShape(e, k, h, inter), 512, "cuda")
    dev = [Tensor.from_numpy(a) for a in (router, gate_up, down)]
    for t in (1, 255, 256, 512):
        x = random_array(rng, (t, h), bfloat16, mean=0.0)
        out = poisoned((t, h), bfloat16)
        moe_experts(Tensor.from_numpy(x), *dev, k, True, out=out, workspace=ws)
        ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:t])
        assert rel_error(out.numpy(), ref.astype(bfloat16)) < 4e-3, t


def test_float32_out_is_the_residual_add_contract(rng):
    """The docstring's promise on the CPU backend, so the model can rely on it on both."""
    x = random_array(rng, (2, 16), bfloat16)
    router, gate_up, down = weights(rng, 4, 16, 8)
    res = Tensor.from_numpy(np.zeros((2, 16), np.float32), "cpu")
    moe_experts(*(Tensor.from_numpy(a, "cpu") for a in (x, router, gate_up, down)), 2, True, out=res)
    assert res.dtype == float32
    np.testing.assert_array_equal(res.array, moe_experts_reference(x, router, gate_up, down, 2, True)
                                  .astype(bfloat16).astype(np.float32))


# ---- the one-token down GEMM with the combine folded in (moe_gemm_down_one_*; docs/kernels/moe.md, "Launches") ---
ONE_TOKEN_SHAPES = [  # experts, k, hidden, inter
    (32, 8, 2048, 768),  # Qwen3-30B-A3B's width, top-8 and 64 row blocks (fewer experts: faster inputs)
    (16, 4, 136, 200),  # a last row block of 8 columns (136 = 4 x 32 + 8); K tails
    (64, 6, 264, 72),
]


def one_token_inputs(rng, e, k, h, inter):
    x = random_array(rng, (1, h), bfloat16, mean=0.0)
    return x, *weights(rng, e, h, inter)


def one_token_stages(dev, shape, out, ws):
    from xserv.ops.moe import moe_stages

    return moe_stages(*dev, shape, True, out, ws, 1)


def poisoned_workspace(shape):
    """A one-token workspace whose expert rows, activations and routing outputs start as NaN / -1."""
    ws = MoeWorkspace(shape, 1, "cuda")
    for buf in (ws.y, ws.act, ws.weights, ws.logits, ws.ids):
        buf.copy_(poisoned(buf.shape, buf.dtype).numpy())
    return ws


def run_one_token(dev, shape, out_init):
    """One token through moe_stages on a fresh poisoned workspace: (out, workspace, stage names)."""
    ws = poisoned_workspace(shape)
    out = Tensor.from_numpy(out_init)
    stages = one_token_stages(dev, shape, out, ws)
    for _, launch in stages:
        launch()
    return out.numpy(), ws, [name for name, _ in stages]


def bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["add", "store"])
@pytest.mark.parametrize("shape", ONE_TOKEN_SHAPES, ids=lambda s: "e{}_k{}_h{}_i{}".format(*s))
def test_cuda_one_token_fused_combine(rng, shape, mode):
    """The one-token down GEMM with the combine folded in (the last CTA of each row block combines it): its output is
    moe_combine's float32 arithmetic on the kernel's own expert rows exactly, and the block within rounding of the
    reference. The workspace starts poisoned (NaN rows): a CTA that combined before every expert's rows were stored
    would read NaN. Its counters are all zero again afterwards (the next launch counts from zero)."""
    e, k, h, inter = shape
    x, router, gate_up, down = one_token_inputs(rng, e, k, h, inter)
    dev = [Tensor.from_numpy(a) for a in (x, router, gate_up, down)]
    if mode == "add":
        init = random_array(rng, (1, h), np.float32, mean=0.5)  # the fp32 residual stream
    else:
        init = np.full((1, h), np.nan, bfloat16)
    got, ws, names = run_one_token(dev, MoeShape(e, k, h, inter), init)
    assert names[-1] == "down+combine" and "combine" not in names and "down" not in names
    assert not np.isnan(got.astype(np.float32)).any()
    y, w = ws.y.numpy()[:k], ws.weights.numpy()[:k]
    np.testing.assert_array_equal(bits(got), bits(combine_reference(y, w, init)))
    assert not ws.counters.numpy().any()
    ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:1])
    result = got - init if mode == "add" else got.astype(np.float32)
    assert rel_error(result, ref.astype(bfloat16).astype(np.float32)) < 4e-3


@pytest.mark.gpu
def test_cuda_one_token_fused_combine_replays_in_a_graph_with_new_routings(rng):
    """One capture of the fused one-token block, replayed with a new token (so new experts) each time: each replay
    must equal the same launches run eagerly on the same input with a fresh workspace, bit for bit, and leave the
    counters at zero (the eager form's combine is tested above). A
    counter left non-zero by a replay would make the next replay's last CTA of that row block never combine (or
    combine too early), and its rows of the residual would differ."""
    from xserv.runtime.graphs import CUDAGraph

    e, k, h, inter = 64, 8, 2048, 768
    x, router, gate_up, down = one_token_inputs(rng, e, k, h, inter)
    mshape = MoeShape(e, k, h, inter)
    dev = [Tensor.from_numpy(a) for a in (x, router, gate_up, down)]
    residual = Tensor.from_numpy(random_array(rng, (1, h), np.float32, mean=0.5))
    ws = poisoned_workspace(mshape)
    stages = one_token_stages(dev, mshape, residual, ws)
    for _, launch in stages:  # outside the capture first: kernels compiled, the router GEMV's workspace made
        launch()
    graph = CUDAGraph()
    with graph.capture():
        for _, launch in stages:
            launch()
    routings = set()
    for replay in range(5):
        x_new = random_array(rng, (1, h), bfloat16, mean=0.0)
        start = random_array(rng, (1, h), np.float32, mean=0.5)
        dev[0].copy_(x_new)
        residual.copy_(start)
        ws.y.copy_(poisoned(ws.y.shape, ws.y.dtype).numpy())
        graph.replay()
        got = residual.numpy()
        want, ws_ref, _ = run_one_token([Tensor.from_numpy(x_new), *dev[1:]], mshape, start)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"replay {replay}")
        ids = ws.ids.numpy()[:k]
        np.testing.assert_array_equal(ids, ws_ref.ids.numpy()[:k])
        routings.add(tuple(sorted(ids.tolist())))
        assert not ws.counters.numpy().any(), f"replay {replay} left a counter set"
    graph.close()
    assert len(routings) > 1  # the replays did route differently


# ---- FP8 experts (a -FP8 checkpoint's: e4m3 with 128 x 128 block scales) -------------------------------------------
def fp8_experts(rng, gate_up, down):
    """Blockwise-quantized twins of bf16 experts: (e4m3 gate_up, its scales, e4m3 down, its scales), each expert as
    xserv/fp8_format.py's quantize_blockwise writes a checkpoint tensor."""
    from xserv.fp8_format import quantize_blockwise

    out = []
    for w in (gate_up, down):
        pairs = [quantize_blockwise(w[e].astype(np.float32)) for e in range(w.shape[0])]
        out += [np.stack([q for q, _ in pairs]), np.stack([s for _, s in pairs]).astype(np.float32)]
    return out


def test_fp8_experts_are_checked_by_name(rng):
    from xserv.ops.moe import dequantize_experts

    def cpu(a):
        return Tensor.from_numpy(a, "cpu")

    e, k, h, inter = 4, 2, 128, 128
    x = random_array(rng, (3, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    gu8, gus, dn8, dns = (cpu(a) for a in fp8_experts(rng, gate_up, down))
    xt, rt = cpu(x), cpu(router)
    with pytest.raises(ValueError, match="gate_up_scale: FP8"):
        moe_experts(xt, rt, gu8, dn8, k, True)
    with pytest.raises(ValueError, match="down_scale"):
        moe_experts(xt, rt, gu8, dn8, k, True, gate_up_scale=gus, down_scale=cpu(dns.numpy()[:2]))
    with pytest.raises(ValueError, match="given for bfloat16 experts"):
        moe_experts(xt, rt, cpu(gate_up), cpu(down), k, True, gate_up_scale=gus,
                    down_scale=dns)
    with pytest.raises(ValueError, match="down: dtype"):  # one FP8, one bf16
        moe_experts(xt, rt, gu8, cpu(down), k, True, gate_up_scale=gus, down_scale=dns)
    small = weights(rng, e, 64, 64)
    q = fp8_experts(rng, small[1], small[2])
    with pytest.raises(ValueError, match="multiples of the 128 x 128 scale block"):
        moe_experts(cpu(x[:, :64]), cpu(small[0]), *(cpu(a) for a in q[::2]),
                    k, True, gate_up_scale=cpu(q[1]), down_scale=cpu(q[3]))
    # the CPU path: the dequantized experts' result, bit for bit
    got = moe_experts(xt, rt, gu8, dn8, k, True, gate_up_scale=gus, down_scale=dns).numpy()
    want = moe_experts(xt, rt, cpu(dequantize_experts(gu8.numpy(), gus.numpy())),
                       cpu(dequantize_experts(dn8.numpy(), dns.numpy())), k, True).numpy()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("t, size, mode", [(1, None, "add"), (1, None, "store"), (5, "small", "store"),
                                           (70, "mid", "store"), (200, "large", "add")])
def test_cuda_fp8_experts_are_the_dequantized_experts_bit_for_bit(rng, t, size, mode):
    """The _fp8 entries (e4m3 chunks converted to bf16 in shared memory) against the bf16 entries on the dequantized
    experts (fp8_format.py's rounding), same launches, each into a NaN-poisoned workspace: the same output bits, for
    the one-token fused path (gate/up with the routing, down with the combine, the default ring) and each prefill
    tile size; and close to the float reference (a wrong scale block would be far)."""
    from xserv.ops.moe import MoeWorkspace, dequantize_experts, moe_stages

    e, k, h, inter = 32, 8, 2048, 768  # Qwen3-30B-A3B's widths
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    q = fp8_experts(rng, gate_up, down)
    deq = (dequantize_experts(q[0], q[1]), dequantize_experts(q[2], q[3]))
    shape = MoeShape(e, k, h, inter)
    init = (random_array(rng, (t, h), np.float32, mean=0.5) if mode == "add"
            else np.full((t, h), np.nan, bfloat16))
    results = {}
    for fp8 in (False, True):
        dev = [Tensor.from_numpy(a) for a in (x, router, *((q[0], q[2]) if fp8 else deq))]
        scales = (Tensor.from_numpy(q[1]), Tensor.from_numpy(q[3])) if fp8 else None
        ws = MoeWorkspace(shape, t, "cuda")
        for buf in (ws.y, ws.act):
            buf.copy_(poisoned(buf.shape, buf.dtype).numpy())
        out = Tensor.from_numpy(init.copy())
        stages = moe_stages(*dev, shape, True, out, ws, t, size=size, scales=scales)
        assert all(name in ("router", "route", "topk", "sort", "gate_up+route", "gate_up", "down+combine", "down",
                            "combine") for name, _ in stages)
        for _, launch in stages:
            launch()
        results[fp8] = out.numpy()
    got, want = results[True], results[False]
    assert not np.isnan(got.astype(np.float32)).any()
    bits = np.uint32 if got.dtype == np.float32 else np.uint16
    np.testing.assert_array_equal(got.view(bits), want.view(bits))
    ref = moe_experts_reference(x, router, *deq, k, True)
    result = got - init if mode == "add" else got.astype(np.float32)
    assert rel_error(result, ref.astype(bfloat16).astype(np.float32)) < 4e-3
