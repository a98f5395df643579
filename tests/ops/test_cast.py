import numpy as np
import pytest

from xserv.ops.cast import cast, cast_reference
from xserv.tensor import Tensor, bfloat16, float16, float32
from xserv.testing import poisoned, random_array

DTYPES = [bfloat16, float16, float32]


def _values(rng, shape, dtype):
    x = random_array(rng, shape, np.float32, mean=0.3, std=3.0)
    special = np.array([np.nan, np.inf, -np.inf, 1e5, -0.0, 1.00390625], np.float32)  # fp16 overflow; a bf16 tie
    n = min(x.size, special.size)
    x.reshape(-1)[:n] = special[:n]
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def test_reference_round_to_nearest_even():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], np.float32)
    np.testing.assert_array_equal(cast_reference(x, bfloat16).astype(np.float32), [1.0, 1.0 + 2**-6, 1.0 + 2**-7])


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_cpu_dispatch(rng, src, dst):
    x = _values(rng, (3, 17), src)
    out = cast(Tensor.from_numpy(x, "cpu"), dst)
    assert out.dtype == dst and out.shape == x.shape
    with np.errstate(over="ignore"):
        expect = x.astype(np.float64).astype(np.float32).astype(dst)
    np.testing.assert_array_equal(out.array.astype(np.float64), expect.astype(np.float64))


def test_errors_name_the_argument(rng):
    x = Tensor.from_numpy(_values(rng, (4,), np.float32), "cpu")
    with pytest.raises(ValueError, match="dtype"):
        cast(x, np.int32)
    with pytest.raises(ValueError, match="x"):
        cast(Tensor.from_numpy(np.ones(3, np.int32), "cpu"), bfloat16)
    with pytest.raises(ValueError, match="out"):
        cast(x, bfloat16, out=Tensor.empty((5,), bfloat16, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (1023, 5), (4096, 4096)])
def test_cuda_bit_exact(rng, src, dst, shape):
    x = _values(rng, shape, src)
    out = poisoned(shape, dst) if src != dst else None
    got = cast(Tensor.from_numpy(x), dst, out=out).numpy()
    expect = cast_reference(x, dst)
    nan = np.isnan(expect.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint8 if dst == float32 else np.uint16),
                                  expect[~nan].view(np.uint8 if dst == float32 else np.uint16))
