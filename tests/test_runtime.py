"""Runtime: allocator, launches, CUDA graphs, cuBLAS. GPU tests are skipped without a GPU."""
import numpy as np
import pytest

from xserv.runtime.allocator import size_class
from xserv.testing import random_array, rel_error


def test_size_classes():
    assert size_class(1) == 512 and size_class(512) == 512 and size_class(513) == 1024
    assert size_class((1 << 20) + 1) == 2 << 20
    assert all(size_class(n) >= n for n in (1, 1000, 10**6, 10**7 + 3))


def test_no_gpu_gives_a_clear_error(monkeypatch):
    import xserv.runtime.device as device

    monkeypatch.setattr(device, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device found; use --device cpu"):
        device.Device()


@pytest.mark.gpu
def test_device_properties():
    from xserv.runtime import get_device

    dev = get_device()
    assert dev.name and dev.arch.startswith("sm_") and dev.multiprocessor_count > 0
    free, total = dev.memory_info()
    assert 0 < free <= total


@pytest.mark.gpu
def test_allocator_reuses_blocks_and_counts():
    from xserv.runtime import get_runtime

    alloc = get_runtime().allocator
    buf = alloc.allocate(3_000_000)
    ptr, before = buf.ptr, alloc.stats.device_allocations
    in_use = alloc.stats.bytes_in_use
    del buf
    assert alloc.stats.bytes_in_use == in_use - size_class(3_000_000)
    again = alloc.allocate(3_100_000)  # same size class
    assert again.ptr == ptr and alloc.stats.device_allocations == before
    assert alloc.stats.peak_bytes_in_use >= alloc.stats.bytes_in_use


def test_allocator_keep_alive_records_allocations():
    # CPU: a fake device allocation underneath; what is checked is the recording and that kept buffers stay in use
    from xserv.runtime.allocator import CachingAllocator

    class FakeDevice(CachingAllocator):
        def _device_alloc(self, size):
            self.stats.device_allocations += 1
            return 0x1000 * self.stats.device_allocations

    alloc = FakeDevice()
    before = alloc.allocate(512)
    kept, inner = [], []
    with alloc.keep_alive(kept):
        a = alloc.allocate(1000)
        with alloc.keep_alive(inner):
            b = alloc.allocate(2000)
    after = alloc.allocate(512)
    assert kept == [a, b] and inner == [b]
    assert before not in kept and after not in kept
    in_use = alloc.stats.bytes_in_use
    del a, b  # still referenced by `kept`: not returned to the cache
    assert alloc.stats.bytes_in_use == in_use
    kept.clear()
    inner.clear()
    assert alloc.stats.bytes_in_use == in_use - size_class(1000) - size_class(2000)
    with pytest.raises(RuntimeError), alloc.keep_alive([]):
        raise RuntimeError("the recorder is closed on the way out")
    assert alloc._recorders == []


@pytest.mark.gpu
def test_out_of_memory_says_how_much():
    from xserv.runtime import DeviceOutOfMemory, get_runtime

    with pytest.raises(DeviceOutOfMemory, match="asked for .* MiB free"):
        get_runtime().allocator.allocate(1 << 50)


@pytest.mark.gpu
def test_kernel_launch_and_bad_kernel_name():
    from xserv.runtime import kernel
    from xserv.tensor import Tensor, float32

    out = Tensor.full((1000,), np.nan, float32)
    kernel("fill", "fill_f32")((4,), (256,), out, np.float32(2.5), np.int64(1000))
    np.testing.assert_array_equal(out.numpy(), np.full(1000, 2.5, np.float32))
    with pytest.raises(ValueError, match="no_such_kernel"):
        kernel("fill", "no_such_kernel")


@pytest.mark.gpu
def test_cuda_graph_replays_captured_work(rng):
    from xserv.runtime import kernel
    from xserv.runtime.graphs import CUDAGraph
    from xserv.tensor import Tensor, uint8

    src = Tensor.from_numpy(rng.integers(0, 255, 4096, dtype=np.uint8))
    dst = Tensor.zeros((4096,), uint8)
    copy = kernel("fill", "copy_u128")
    graph = CUDAGraph()
    with graph.capture():
        copy((2,), (128,), dst, src, np.int64(256))
    np.testing.assert_array_equal(dst.numpy(), 0)  # capture records, does not run
    graph.replay()
    np.testing.assert_array_equal(dst.numpy(), src.numpy())
    new = rng.integers(0, 255, 4096, dtype=np.uint8)
    src.copy_(new)
    graph.replay()
    np.testing.assert_array_equal(dst.numpy(), new)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 384, 200), (64, 1536, 1024), (1000, 512, 768)])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_cublas_linear_matches_numpy(rng, m, n, k, out_dtype):
    from xserv.ops.linear import linear
    from xserv.tensor import Tensor, as_dtype, bfloat16

    x = random_array(rng, (m, k), bfloat16)
    w = random_array(rng, (n, k), bfloat16, std=0.05)
    out = Tensor.full((m, n), np.nan, as_dtype(out_dtype))
    linear(Tensor.from_numpy(x), Tensor.from_numpy(w), out)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert rel_error(out.numpy(), ref) < (1e-2 if out_dtype == "bfloat16" else 1e-5)


@pytest.mark.gpu
def test_cublas_accumulate_and_batched(rng):
    from xserv.ops.linear import batched_linear, linear
    from xserv.tensor import Tensor, bfloat16, float32

    x = random_array(rng, (5, 64), bfloat16)
    w = random_array(rng, (32, 64), bfloat16)
    base = random_array(rng, (5, 32), np.float32)
    out = Tensor.from_numpy(base)
    linear(Tensor.from_numpy(x), Tensor.from_numpy(w), out, accumulate=True)
    ref = base + x.astype(np.float64) @ w.astype(np.float64).T
    assert rel_error(out.numpy(), ref) < 1e-5
    a = random_array(rng, (3, 17, 64), bfloat16)
    b = random_array(rng, (3, 40, 64), bfloat16)
    got = batched_linear(Tensor.from_numpy(a), Tensor.from_numpy(b), Tensor.full((3, 17, 40), np.nan, float32))
    assert rel_error(got.numpy(), np.einsum("bmk,bnk->bmn", a.astype(np.float64), b.astype(np.float64))) < 1e-5


@pytest.mark.gpu
def test_cublas_inside_graph_capture(rng):
    from xserv.ops.linear import linear
    from xserv.runtime.graphs import CUDAGraph
    from xserv.tensor import Tensor, bfloat16, float32

    x = Tensor.from_numpy(random_array(rng, (4, 256), bfloat16))
    w_np = random_array(rng, (128, 256), bfloat16)
    w = Tensor.from_numpy(w_np)
    out = Tensor.zeros((4, 128), float32)
    linear(x, w, out)  # plan the shape outside the capture
    graph = CUDAGraph()
    with graph.capture():
        linear(x, w, out)
    new = random_array(rng, (4, 256), bfloat16)
    x.copy_(new)
    graph.replay()
    assert rel_error(out.numpy(), new.astype(np.float64) @ w_np.astype(np.float64).T) < 1e-5


def test_linear_cpu_and_argument_errors(rng):
    from xserv.ops.linear import linear
    from xserv.tensor import Tensor

    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((5, 8)).astype(np.float32)
    got = linear(Tensor.from_numpy(x, "cpu"), Tensor.from_numpy(w, "cpu"))
    np.testing.assert_allclose(got.numpy(), x @ w.T, rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        linear(Tensor.from_numpy(x, "cpu"), Tensor.from_numpy(w[:, :7].copy(), "cpu"))
    with pytest.raises(ValueError, match="out: shape"):
        linear(Tensor.from_numpy(x, "cpu"), Tensor.from_numpy(w, "cpu"), out=Tensor.empty((3, 4), np.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", [False, True])
def test_cublas_with_and_without_autotuning(rng, autotune):
    from xserv.ops.linear import linear
    from xserv.runtime import get_runtime
    from xserv.tensor import Tensor, bfloat16

    cublas = get_runtime().cublas
    saved, cublas.autotune = cublas.autotune, autotune
    try:
        m, n, k = 3 + autotune, 520, 264  # a shape no other test plans
        x = random_array(rng, (m, k), bfloat16)
        w = random_array(rng, (n, k), bfloat16)
        out = linear(Tensor.from_numpy(x), Tensor.from_numpy(w), Tensor.full((m, n), np.nan, bfloat16))
        assert rel_error(out.numpy(), x.astype(np.float64) @ w.astype(np.float64).T) < 1e-2
    finally:
        cublas.autotune = saved


@pytest.mark.gpu
def test_kernel_reports_its_registers():
    from xserv.runtime import kernel

    assert 0 < kernel("fill", "copy_u128").registers <= 255


def test_runtime_imports_nothing_above_it():
    """The floors: importing the runtime loads neither xserv.tensor nor any op (the old circle tensor -> ops.cast ->
    runtime -> cublas -> tensor is closed), and xserv.tensor loads no op."""
    import subprocess
    import sys

    code = ("import sys, xserv.runtime, xserv.runtime.cublas, xserv.runtime.tma; "
            "assert not [m for m in sys.modules if m == 'xserv.tensor' or m.startswith('xserv.ops')], 'runtime'; "
            "import xserv.tensor; assert not [m for m in sys.modules if m.startswith('xserv.ops')], 'tensor'")
    subprocess.run([sys.executable, "-c", code], check=True)
