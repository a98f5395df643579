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


# ---- CUDA ----------------------------------------------------------------------------------------------------------
def run_cuda(x, router, gate_up, down, k, renormalize, out_dtype=bfloat16, residual=None, size=None):
    """size: force a GEMM tile shape (small / mid / large) through moe_stages, else moe_experts picks."""
    from xserv.ops.moe import moe_stages

    t, h = x.shape
    shape = MoeShape(router.shape[0], k, h, gate_up.shape[1] // 2)
    ws = MoeWorkspace(shape, t, "cuda")
    out = Tensor.from_numpy(residual) if residual is not None else poisoned((t, h), out_dtype)
    args = [Tensor.from_numpy(a) for a in (x, router, gate_up, down)]
    if size is None:
        moe_experts(*args, k, renormalize, out=out, workspace=ws)
    else:
        for _, launch in moe_stages(*args, shape, renormalize, out, ws, t, size=size):
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
@pytest.mark.parametrize("size", ["small", "mid", "large"])
@pytest.mark.parametrize("shape", [(300, 32, 8, 512, 256), (37, 8, 3, 200, 136)], ids=["t300", "tails"])
def test_cuda_every_tile_shape(rng, size, shape):
    from xserv.ops.moe import _TILES

    t, e, k, h, inter = shape
    x = random_array(rng, (t, h), bfloat16, mean=0.0)
    router, gate_up, down = weights(rng, e, h, inter)
    got, ws = run_cuda(x, router, gate_up, down, k, True, size=size)
    check_sorted_list(ws, t, k, _TILES[size])
    ref = moe_experts_reference(x, router, gate_up, down, k, True, logits=ws.logits.numpy()[:t])
    assert rel_error(got, ref.astype(bfloat16)) < 4e-3


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
