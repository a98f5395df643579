import numpy as np
import pytest

from xserv.ops.argmax import argmax, argmax_reference, split_plan
from xserv.tensor import Tensor, bfloat16, float32, int32
from xserv.testing import poisoned, random_array


def _logits(rng, b, v, dtype):
    """Random logits with one clear maximum per row at a random index (no near-ties)."""
    x = random_array(rng, (b, v), dtype, mean=0.5, std=2.0).astype(np.float32)
    where = rng.integers(0, v, b)
    x[np.arange(b), where] = x.max(axis=1) + 4.0
    return x.astype(dtype), where.astype(np.int32)


def test_reference(rng):
    x, where = _logits(rng, 6, 1000, bfloat16)
    np.testing.assert_array_equal(argmax_reference(x), where)


def test_ties_nan_and_inf():
    x = np.array([[1, 5, 5, 2], [-np.inf] * 4, [1, np.nan, 9, np.nan], [0, -0.0, 0, -1]], np.float32)
    np.testing.assert_array_equal(argmax_reference(x), [1, 0, 1, 0])
    out = argmax(Tensor.from_numpy(x, "cpu"))
    assert out.dtype == int32 and out.shape == (4,)
    np.testing.assert_array_equal(out.array, [1, 0, 1, 0])


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="x"):
        argmax(Tensor.from_numpy(np.zeros((2, 3), np.int32), "cpu"))
    with pytest.raises(ValueError, match="x"):
        argmax(Tensor.from_numpy(np.zeros((2, 0), np.float32), "cpu"))
    with pytest.raises(ValueError, match="out"):
        argmax(Tensor.from_numpy(np.zeros((2, 3), np.float32), "cpu"), out=Tensor.empty((3,), int32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, float32])
@pytest.mark.parametrize("b, v", [(1, 151936), (7, 151936), (3, 1), (5, 7), (64, 1023), (2, 32000), (1, 100003)])
def test_cuda_exact(rng, dtype, b, v):
    x, where = _logits(rng, b, v, dtype)
    out = poisoned((b,), int32)
    argmax(Tensor.from_numpy(x), out=out)
    np.testing.assert_array_equal(out.numpy(), argmax_reference(x))
    np.testing.assert_array_equal(out.numpy(), where)


def test_split_plan():
    # one row of a 152k vocabulary fills the GPU in splits of >= 512 float4s; many rows keep one CTA each
    assert split_plan(1, 151936, 132) == 74 and split_plan(7, 151936, 132) == 18
    assert split_plan(64, 151936, 132) == 2 and split_plan(67, 151936, 132) == 1 and split_plan(1, 1023, 132) == 1


@pytest.mark.gpu
def test_cuda_split_rows_again_and_again(rng):
    """The split kernel's last CTA resets its row counter: calls after calls (as graph replays are) stay right,
    with the maximum moved to a different split each time, and on a split boundary."""
    from xserv.runtime import get_device

    v = 151936
    chunk = 4 * -(-(v // 4) // split_plan(3, v, get_device().multiprocessor_count))  # elements per split at b = 3
    for b, where in ((1, [0]), (3, [v - 1, 3 * chunk, 3 * chunk - 1]), (1, [77777]), (2, [3, 150000])):
        x = random_array(rng, (b, v), np.float32)
        x[np.arange(b), where] = 50.0
        got = argmax(Tensor.from_numpy(x), out=poisoned((b,), int32)).numpy()
        np.testing.assert_array_equal(got, where)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bfloat16, float32])
def test_cuda_ties_nan_inf(rng, dtype):
    v = 151936
    x = random_array(rng, (5, v), dtype).astype(np.float32)
    x[0, [70000, 123, 150000]] = 100.0  # tie -> lowest index
    x[1, :] = -np.inf
    x[2, [99999, 5000]] = np.nan  # first NaN wins
    x[3, v - 1] = 100.0  # the very last element
    x[4, 0] = 100.0
    x = x.astype(dtype)
    got = argmax(Tensor.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, [123, 0, 5000, v - 1, 0])
    np.testing.assert_array_equal(got, argmax_reference(x))
