import numpy as np
import pytest

from xserv.ops.gather import gather, gather_reference
from xserv.tensor import Tensor, int32


def _case(rng, m, n):
    src = rng.integers(0, 150_000, m).astype(np.int32)
    index = rng.integers(-1, m, n).astype(np.int32)
    out = rng.integers(-5, 0, n).astype(np.int32)  # what the host wrote: kept where index is -1
    return src, index, out


def test_reference(rng):
    src, index, out = _case(rng, 7, 20)
    got = gather_reference(src, index, out)
    for i in range(20):
        assert got[i] == (src[index[i]] if index[i] >= 0 else out[i])


def test_cpu_matches_reference_and_checks_range(rng):
    src, index, out = _case(rng, 9, 33)
    t = Tensor.from_numpy(out, "cpu")
    gather(Tensor.from_numpy(src, "cpu"), Tensor.from_numpy(index, "cpu"), t)
    np.testing.assert_array_equal(t.array, gather_reference(src, index, out))
    with pytest.raises(ValueError, match="index"):
        gather(Tensor.from_numpy(src, "cpu"), Tensor.from_numpy(np.array([9], np.int32), "cpu"),
               Tensor.zeros((1,), int32, "cpu"))
    with pytest.raises(ValueError, match="out"):
        gather(Tensor.from_numpy(src, "cpu"), Tensor.from_numpy(index, "cpu"), Tensor.zeros((2,), int32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(1, 1), (256, 256), (300, 1000), (5, 4097)])
def test_cuda_matches_reference(rng, m, n):
    src, index, out = _case(rng, m, n)
    t = Tensor.from_numpy(out, "cuda")
    gather(Tensor.from_numpy(src, "cuda"), Tensor.from_numpy(index, "cuda"), t)
    np.testing.assert_array_equal(t.numpy(), gather_reference(src, index, out))
