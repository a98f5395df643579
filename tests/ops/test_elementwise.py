import numpy as np
import pytest

from xserv.ops.elementwise import add, add_reference
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import misaligned, poisoned, random_array, rel_error


def test_reference_and_cpu_dispatch(rng):
    for dtype in (bfloat16, float32):
        a = random_array(rng, (3, 5, 7), dtype, mean=0.5)
        b = random_array(rng, (3, 5, 7), dtype, mean=-0.2)
        exact = a.astype(np.float64) + b.astype(np.float64)
        assert rel_error(add_reference(a, b), exact) < 1e-6
        out = add(Tensor.from_numpy(a, "cpu"), Tensor.from_numpy(b, "cpu"))
        assert out.dtype == dtype
        assert rel_error(out.array, exact) < (4e-3 if dtype == bfloat16 else 1e-7)
    at = Tensor.from_numpy(a, "cpu")
    assert add(at, Tensor.from_numpy(b, "cpu"), out=at) is at


def test_errors_name_the_argument(rng):
    a = Tensor.from_numpy(random_array(rng, (4, 8), bfloat16), "cpu")
    with pytest.raises(ValueError, match="b"):
        add(a, Tensor.from_numpy(random_array(rng, (4, 8), np.float32), "cpu"))
    with pytest.raises(ValueError, match="b"):
        add(a, Tensor.from_numpy(random_array(rng, (8, 4), bfloat16), "cpu"))
    with pytest.raises(ValueError, match="a"):
        add(Tensor.from_numpy(np.ones(3, np.int32), "cpu"), Tensor.from_numpy(np.ones(3, np.int32), "cpu"))
    with pytest.raises(ValueError, match="out"):
        add(a, a, out=Tensor.empty((4, 8), np.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, float32])
@pytest.mark.parametrize("shape", [(1,), (7,), (1023, 7), (8192, 4096), (3, 5, 128)])
def test_cuda_matches_reference(rng, dtype, shape):
    a = random_array(rng, shape, dtype, mean=0.5)
    b = random_array(rng, shape, dtype, mean=-0.2)
    out = poisoned(shape, dtype)
    add(Tensor.from_numpy(a), Tensor.from_numpy(b), out=out)
    np.testing.assert_array_equal(out.numpy(), add_reference(a, b).astype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, float32])
def test_cuda_inplace_and_unaligned(rng, dtype):
    a = random_array(rng, (64,), dtype, mean=0.5)
    b = random_array(rng, (64,), dtype)
    ad = Tensor.from_numpy(a)
    add(ad, Tensor.from_numpy(b), out=ad)
    np.testing.assert_array_equal(ad.numpy(), add_reference(a, b).astype(dtype))
    out = poisoned((64,), dtype)
    add(misaligned(a), Tensor.from_numpy(b), out=out)
    np.testing.assert_array_equal(out.numpy(), add_reference(a, b).astype(dtype))
