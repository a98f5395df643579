import numpy as np
import pytest

from xserv.ops.activation import silu_and_mul, silu_and_mul_reference
from xserv.tensor import Tensor, bfloat16
from xserv.testing import misaligned, poisoned, random_array, rel_error


def swiglu64(x):
    x = x.astype(np.float64)
    i = x.shape[-1] // 2
    g, u = x[:, :i], x[:, i:]
    return g / (1 + np.exp(-g)) * u


def test_reference_vs_float64(rng):
    x = random_array(rng, (11, 2 * 96), bfloat16, mean=0.3, std=2.0)
    assert rel_error(silu_and_mul_reference(x), swiglu64(x)) < 1e-2


def test_reference_rounds_silu_to_bf16_first(rng):
    x = random_array(rng, (3, 64), bfloat16)
    g, u = x[:, :32].astype(np.float32), x[:, 32:].astype(np.float32)
    silu = (g / (1 + np.exp(-g))).astype(bfloat16).astype(np.float32)
    np.testing.assert_array_equal(silu_and_mul_reference(x), silu * u)


def test_extreme_gates_stay_finite():
    x = np.array([[-200.0, 200.0, 0.0, 3.0, 1.0, 1.0]], bfloat16)
    got = silu_and_mul_reference(x)
    assert np.all(np.isfinite(got)) and got[0, 0] == 0 and got[0, 1] == 200.0 and got[0, 2] == 0


def test_cpu_dispatch_and_errors(rng):
    x = random_array(rng, (4, 16), bfloat16)
    out = silu_and_mul(Tensor.from_numpy(x, "cpu"))
    assert out.shape == (4, 8)
    np.testing.assert_array_equal(out.array, silu_and_mul_reference(x).astype(bfloat16))
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(Tensor.from_numpy(x[:, :15], "cpu"))
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(Tensor.from_numpy(x.astype(np.float32), "cpu"))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(Tensor.from_numpy(x, "cpu"), out=Tensor.empty((4, 16), bfloat16, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 1023])
@pytest.mark.parametrize("inter", [8, 100, 768, 3072, 12288])
def test_cuda_matches_reference(rng, t, inter):
    x = random_array(rng, (t, 2 * inter), bfloat16, mean=0.3, std=2.0)
    out = poisoned((t, inter), bfloat16)
    silu_and_mul(Tensor.from_numpy(x), out=out)
    got = out.numpy()
    assert rel_error(got, silu_and_mul_reference(x).astype(bfloat16)) < 2e-3
    assert rel_error(got, swiglu64(x)) < 1e-2


@pytest.mark.gpu
def test_cuda_unaligned(rng):
    x = random_array(rng, (5, 2 * 64), bfloat16, mean=0.3)
    out = poisoned((5, 64), bfloat16)
    silu_and_mul(misaligned(x), out=out)
    assert rel_error(out.numpy(), silu_and_mul_reference(x).astype(bfloat16)) < 2e-3
