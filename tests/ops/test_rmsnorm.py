import numpy as np
import pytest

from xserv.ops.rmsnorm import (fused_add_rmsnorm, fused_add_rmsnorm_reference, head_rmsnorm, head_rmsnorm_reference,
                               rmsnorm, rmsnorm_reference)
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import misaligned as unaligned, poisoned, random_array, rel_error

EPS = 1e-6


def rms64(x, w, eps=EPS):
    x = x.astype(np.float64)
    return w.astype(np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _xw(rng, shape):
    return random_array(rng, shape, bfloat16, mean=0.3), random_array(rng, shape[-1:], bfloat16, mean=1.0, std=0.3)


def cpu(a):
    return Tensor.from_numpy(a, "cpu")


def dev(a):
    return Tensor.from_numpy(a, "cuda")


# ---- CPU -----------------------------------------------------------------------------------------------------------
def test_reference_vs_float64(rng):
    x, w = _xw(rng, (13, 256))
    assert rel_error(rmsnorm_reference(x, w, EPS), rms64(x, w)) < 1e-2


def test_reference_rounds_normalised_value_before_weight(rng):
    x, w = _xw(rng, (4, 64))
    xf = x.astype(np.float32)
    normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + np.float32(EPS))
    expect = (w.astype(np.float32) * normed.astype(bfloat16).astype(np.float32)).astype(bfloat16)
    got = rmsnorm_reference(x, w, EPS).astype(bfloat16)
    assert np.mean(got.view(np.uint16) != expect.view(np.uint16)) < 0.02  # equal up to rsqrt-vs-division flips


def test_fused_reference(rng):
    x, w = _xw(rng, (9, 320))
    res = random_array(rng, (9, 320), bfloat16, mean=-0.2)
    new_res, y = fused_add_rmsnorm_reference(x, res, w, EPS)
    s = x.astype(np.float64) + res.astype(np.float64)
    assert rel_error(new_res, s) < 4e-3
    assert rel_error(y, rms64(s, w)) < 1e-2


def test_cpu_dispatch_all_three(rng):
    x, w = _xw(rng, (5, 128))
    out = rmsnorm(cpu(x), cpu(w), EPS)
    np.testing.assert_array_equal(out.array, rmsnorm_reference(x, w, EPS).astype(bfloat16))
    res = random_array(rng, (5, 128), bfloat16)
    res_t = cpu(res.copy())
    out = fused_add_rmsnorm(cpu(x), res_t, cpu(w), EPS)
    new_res, y = fused_add_rmsnorm_reference(x, res, w, EPS)
    np.testing.assert_array_equal(res_t.array, new_res)
    np.testing.assert_array_equal(out.array, y.astype(bfloat16))
    h, hw = _xw(rng, (3, 4, 64))
    ht = cpu(h.copy())
    assert head_rmsnorm(ht, cpu(hw), EPS, out=ht) is ht  # in place
    np.testing.assert_array_equal(ht.array, head_rmsnorm_reference(h, hw, EPS).astype(bfloat16))
    assert rel_error(ht.array, rms64(h, hw)) < 1e-2


def test_errors_name_the_argument(rng):
    x, w = _xw(rng, (4, 64))
    with pytest.raises(ValueError, match="x"):
        rmsnorm(cpu(x.astype(np.float32)), cpu(w), EPS)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(cpu(x), cpu(w[:32]), EPS)
    with pytest.raises(ValueError, match="out"):
        rmsnorm(cpu(x), cpu(w), EPS, out=Tensor.empty((4, 64), float32, "cpu"))
    with pytest.raises(ValueError, match="eps"):
        rmsnorm(cpu(x), cpu(w), -1.0)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(cpu(x), cpu(x[:2]), cpu(w), EPS)
    r = cpu(x.copy())
    with pytest.raises(ValueError, match="out"):
        fused_add_rmsnorm(cpu(x), r, cpu(w), EPS, out=r)
    with pytest.raises(ValueError, match="head_dim"):
        head_rmsnorm(cpu(random_array(rng, (2, 3, 96), bfloat16)), cpu(w), EPS)
    with pytest.raises(ValueError, match="weight"):
        head_rmsnorm(cpu(random_array(rng, (2, 3, 64), bfloat16)), cpu(w[:32]), EPS)


# ---- CUDA ----------------------------------------------------------------------------------------------------------
ROWS = [1, 7, 1023]
HIDDEN = [8, 128, 1000, 1024, 4096, 5120, 20480]


@pytest.mark.gpu
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
def test_cuda_rmsnorm(rng, t, h):
    x, w = _xw(rng, (t, h))
    out = poisoned((t, h), bfloat16)
    rmsnorm(dev(x), dev(w), EPS, out=out)
    got = out.numpy()
    assert rel_error(got, rmsnorm_reference(x, w, EPS).astype(bfloat16)) < 3e-3
    assert rel_error(got, rms64(x, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("h", HIDDEN)
def test_cuda_fused_add_rmsnorm(rng, t, h):
    x, w = _xw(rng, (t, h))
    res = random_array(rng, (t, h), bfloat16, mean=-0.2)
    res_dev = dev(res)
    out = poisoned((t, h), bfloat16)
    assert fused_add_rmsnorm(dev(x), res_dev, dev(w), EPS, out=out) is out
    new_res, y = fused_add_rmsnorm_reference(x, res, w, EPS)
    np.testing.assert_array_equal(res_dev.numpy().view(np.uint16), new_res.view(np.uint16))
    assert rel_error(out.numpy(), y.astype(bfloat16)) < 3e-3
    assert rel_error(out.numpy(), rms64(x.astype(np.float64) + res, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_unaligned_huge_and_inplace(rng, fused):
    for t, h, layout in [(3, 4096, "unaligned"), (2, 65544, "aligned"), (5, 1024, "inplace")]:
        x, w = _xw(rng, (t, h))
        res = random_array(rng, (t, h), bfloat16)
        xd = unaligned(x) if layout == "unaligned" else dev(x)
        out = xd if layout == "inplace" else poisoned((t, h), bfloat16)
        if fused:
            rd = unaligned(res) if layout == "unaligned" else dev(res)
            fused_add_rmsnorm(xd, rd, dev(w), EPS, out=out)
            new_res, ref = fused_add_rmsnorm_reference(x, res, w, EPS)
            np.testing.assert_array_equal(rd.numpy().view(np.uint16), new_res.view(np.uint16))
        else:
            rmsnorm(xd, dev(w), EPS, out=out)
            ref = rmsnorm_reference(x, w, EPS)
        assert rel_error(out.numpy(), ref.astype(bfloat16)) < 3e-3, (t, h, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("heads", [1, 8, 40])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_head_rmsnorm(rng, t, heads, d):
    x, w = _xw(rng, (t, heads, d))
    out = poisoned((t, heads, d), bfloat16)
    head_rmsnorm(dev(x), dev(w), EPS, out=out)
    assert rel_error(out.numpy(), head_rmsnorm_reference(x, w, EPS).astype(bfloat16)) < 3e-3
    assert rel_error(out.numpy(), rms64(x, w)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["inplace", "unaligned"])
def test_cuda_head_rmsnorm_layouts(rng, layout):
    x, w = _xw(rng, (7, 5, 128))
    xd = unaligned(x) if layout == "unaligned" else dev(x)
    out = xd if layout == "inplace" else poisoned(x.shape, bfloat16)
    head_rmsnorm(xd, dev(w), EPS, out=out)
    assert rel_error(out.numpy(), head_rmsnorm_reference(x, w, EPS).astype(bfloat16)) < 3e-3


def test_fp32_residual_reference_is_unrounded(rng):
    """With a float32 residual stream nothing is rounded to bf16 before the output: matches float64 closely."""
    x, w = _xw(rng, (4, 256))
    res = random_array(rng, (4, 256), np.float32, mean=-0.2)
    new_res, y = fused_add_rmsnorm_reference(x, res, w, EPS)
    assert new_res.dtype == np.float32
    np.testing.assert_array_equal(new_res, x.astype(np.float32) + res)
    assert rel_error(y, rms64(x.astype(np.float64) + res, w)) < 1e-6
    xc, rc, wc = (Tensor.from_numpy(a, "cpu") for a in (x, res, w))
    out = fused_add_rmsnorm(xc, rc, wc, EPS)
    np.testing.assert_array_equal(rc.numpy(), new_res)
    assert rel_error(out.numpy(), y.astype(bfloat16)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,layout", [(1, 4096, "aligned"), (7, 1024, "aligned"), (33, 5120, "aligned"),
                                        (3, 4096, "unaligned"), (2, 1000, "aligned")])
def test_cuda_fused_add_rmsnorm_fp32_residual(rng, t, h, layout):
    x, w = _xw(rng, (t, h))
    res = random_array(rng, (t, h), np.float32, mean=-0.2)
    xd = unaligned(x) if layout == "unaligned" else dev(x)
    rd = dev(res)
    out = poisoned((t, h), bfloat16)
    fused_add_rmsnorm(xd, rd, dev(w), EPS, out=out)
    new_res, y = fused_add_rmsnorm_reference(x, res, w, EPS)
    np.testing.assert_array_equal(rd.numpy(), new_res)  # fp32 add of the same operands: bit-exact
    assert rel_error(out.numpy(), y.astype(bfloat16)) < 3e-3
    assert rel_error(out.numpy(), rms64(x.astype(np.float64) + res, w)) < 5e-3
