"""Tensor on both backends."""
import numpy as np
import pytest

from xserv.tensor import Tensor, bfloat16, float32, int32

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_roundtrip_views_and_slices(device, rng):
    a = rng.standard_normal((6, 4, 8)).astype(np.float32) + 0.5
    t = Tensor.from_numpy(a, device)
    assert t.shape == (6, 4, 8) and t.dtype == float32 and t.device == device
    np.testing.assert_array_equal(t.numpy(), a)
    np.testing.assert_array_equal(t.view(24, -1).numpy(), a.reshape(24, 8))
    np.testing.assert_array_equal(t[2:5].numpy(), a[2:5])
    np.testing.assert_array_equal(t[-1].numpy(), a[-1])
    assert t.strides == (32, 8, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_slice_is_a_view_and_copy_writes_through(device, rng):
    t = Tensor.zeros((4, 3), float32, device)
    part = rng.standard_normal((2, 3)).astype(np.float32)
    t[1:3].copy_(part)
    expect = np.zeros((4, 3), np.float32)
    expect[1:3] = part
    np.testing.assert_array_equal(t.numpy(), expect)
    other = Tensor.empty((4, 3), float32, device).copy_(t)
    np.testing.assert_array_equal(other.numpy(), expect)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_and_int_dtypes(device, rng):
    a = rng.standard_normal((5, 7)).astype(bfloat16)
    np.testing.assert_array_equal(Tensor.from_numpy(a, device).numpy().view(np.uint16), a.view(np.uint16))
    ids = Tensor.full((3,), 7, int32, device)
    np.testing.assert_array_equal(ids.numpy(), [7, 7, 7])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unsupported dtype"):
        Tensor.empty((2,), np.complex64, "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        Tensor.empty((2,), float32, "tpu")
    t = Tensor.empty((4, 6), float32, "cpu")
    with pytest.raises(ValueError, match="view"):
        t.view(5, 5)
    with pytest.raises(ValueError, match="step-1"):
        t[::2]
    with pytest.raises(IndexError):
        t[4]
    with pytest.raises(ValueError, match="does not match"):
        t.copy_(np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="no device pointer"):
        t.ptr


@pytest.mark.gpu
def test_cpu_cuda_transfer(rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    t = Tensor.from_numpy(a, "cpu").to("cuda")
    assert t.is_cuda
    np.testing.assert_array_equal(t.to("cpu").numpy(), a)


def test_misaligned_helper_is_an_offset_view(rng):
    from xserv.testing import misaligned

    a = rng.standard_normal((3, 4)).astype(bfloat16)
    t = misaligned(a, "cpu")
    np.testing.assert_array_equal(t.numpy().view(np.uint16), a.view(np.uint16))
