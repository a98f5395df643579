"""Runtime: allocator, launches, CUDA graphs, cuBLAS. GPU tests are skipped without a GPU."""
import numpy as np
import pytest

from xserv.runtime.allocator import size_class
from xserv.runtime.arch import pdl_enabled
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


def _fake_device_allocator():
    """A CachingAllocator whose device allocations are fake addresses (CPU tests of its bookkeeping)."""
    from xserv.runtime.allocator import CachingAllocator

    class FakeDevice(CachingAllocator):
        def _device_alloc(self, size):
            self.stats.device_allocations += 1
            return 0x1000 * self.stats.device_allocations

    return FakeDevice()


def test_allocator_keep_alive_records_allocations():
    # CPU: a fake device allocation underneath; what is checked is the recording and that kept buffers stay in use
    alloc = _fake_device_allocator()
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


def test_buffer_released_once_by_free_or_garbage_collection():
    # CPU: a fake device allocation underneath. A buffer goes back to its size class exactly once, whether freed
    # explicitly (then dropped) or dropped; a double release would hand one block to two later allocations.
    alloc = _fake_device_allocator()
    a = alloc.allocate(700)
    ptr = a.ptr
    a.free()
    a.free()
    del a
    assert alloc.stats.bytes_in_use == 0 and alloc._free[size_class(700)] == [ptr]
    b, c = alloc.allocate(700), alloc.allocate(700)
    assert b.ptr == ptr and c.ptr != ptr  # one block, handed out once
    del b
    assert alloc._free[size_class(700)] == [ptr] and alloc.stats.bytes_in_use == size_class(700)


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


# ---- launch path: argument packing, launch forms, errors (CPU: a fake driver underneath) -----------------------
class _FakeInfo:
    index = 0
    max_shared_memory_per_block_optin = 227 * 1024

    def __init__(self, cc):
        self.compute_capability = cc


class _FakeDevice:
    stream_handle = 0x5150

    def __init__(self, cc=(9, 0)):
        self.info = _FakeInfo(cc)


class _FakeCore:
    def __init__(self):
        from cuda.bindings import driver

        self.handle = driver.CUfunction(0x1234)


def _read_params(params: int, sizes) -> list[bytes]:
    """The bytes the driver would read: params is a void** array, one pointer per parameter."""
    import ctypes

    return [ctypes.string_at(ctypes.c_void_p.from_address(params + 8 * i).value, n) for i, n in enumerate(sizes)]


@pytest.fixture
def fake_launches(monkeypatch):
    """Kernels over a fake driver: launches are recorded with the parameter bytes they pass."""
    from cuda.bindings import driver

    import xserv.runtime.kernels as K

    calls = []
    state = {"sizes": None, "result": driver.CUresult.CUDA_SUCCESS, "static_smem": 0, "smem_optins": []}

    def launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        calls.append(dict(ex=False, func=int(func), grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                          stream=int(stream), params=_read_params(params, state["sizes"])))
        return (state["result"],)

    def launch_ex(config, func, params, extra):
        calls.append(dict(ex=True, func=int(func), grid=(config.gridDimX, config.gridDimY, config.gridDimZ),
                          block=(config.blockDimX, config.blockDimY, config.blockDimZ), smem=config.sharedMemBytes,
                          stream=int(config.hStream), attrs=[_attr_value(a) for a in config.attrs[:config.numAttrs]],
                          params=_read_params(params, state["sizes"])))
        return (state["result"],)

    monkeypatch.setattr(K, "_cuLaunchKernel", launch)
    monkeypatch.setattr(K, "_cuLaunchKernelEx", launch_ex)
    monkeypatch.setattr(K, "_param_sizes", lambda func: state["sizes"])
    monkeypatch.setattr(K, "_static_smem", lambda func: state["static_smem"])
    monkeypatch.setattr(K, "_allow_dynamic_smem", lambda handle, func, index, smem: state["smem_optins"].append(smem))

    def make(sizes, cc=(9, 0)):
        state["sizes"] = sizes
        return K.Kernel("fam", "kern", _FakeCore(), _FakeDevice(cc))

    return make, calls, state


def _attr_value(attr):
    """(id, value) of a recorded launch attribute: PDL's flag, a cluster's (x, y, z)."""
    from cuda.bindings import driver

    if attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
        dim = attr.value.clusterDim
        return attr.id, (dim.x, dim.y, dim.z)
    return attr.id, attr.value.programmaticStreamSerializationAllowed


def _fake_tensor(ptr, shape=(4, 6), dtype=np.float32, offset=0):
    from types import SimpleNamespace

    from xserv.tensor import Tensor

    return Tensor(shape, dtype, buffer=SimpleNamespace(ptr=ptr), offset=offset)


def test_launch_packs_pointers_and_scalars_into_their_slots(fake_launches, rng):
    make, calls, _ = fake_launches
    k = make([8, 8, 4, 4, 8, 4, 8])
    for _ in range(3):  # fresh values each time: the reused buffer must hold the new ones, every byte of them
        t_ptr, offset, addr = (int(v) * 256 for v in rng.integers(1, 2**40, 3))
        i32, u32 = np.int32(rng.integers(-2**31, 2**31)), np.uint32(rng.integers(0, 2**32))
        i64, f32, f64 = np.int64(rng.integers(-2**62, 2**62)), np.float32(rng.standard_normal()), np.float64(rng.standard_normal())
        t = _fake_tensor(t_ptr, offset=offset)
        k((3, 2), 128, t, addr, i32, f32, i64, u32, f64, smem=1024)
        got = calls[-1]
        assert not got["ex"] and got["grid"] == (3, 2, 1) and got["block"] == (128, 1, 1) and got["smem"] == 1024
        assert got["func"] == 0x1234 and got["stream"] == _FakeDevice.stream_handle
        p = got["params"]
        assert int.from_bytes(p[0], "little") == t_ptr + offset and int.from_bytes(p[1], "little") == addr
        assert np.frombuffer(p[2], np.int32)[0] == i32 and np.frombuffer(p[3], np.float32)[0] == f32
        assert np.frombuffer(p[4], np.int64)[0] == i64 and np.frombuffer(p[5], np.uint32)[0] == u32
        assert np.frombuffer(p[6], np.float64)[0] == f64
    # the slots of one signature are reused; another signature gets its own layout
    k(1, 1, _fake_tensor(512), _fake_tensor(1024), np.int32(7), np.float32(0.5), np.int64(-1), np.uint32(3), np.float64(2))
    assert len(k._packers) == 2 and int.from_bytes(calls[-1]["params"][1], "little") == 1024


def test_launch_switches_between_signatures(fake_launches, rng):
    """A call goes through the last signature's launch when the argument types match it (checked inside), else
    through its own signature's packer: alternating signatures of one arity, fresh values each time, every slot
    right; a call of another arity or with an argument type the kernel cannot take still fails by name."""
    make, calls, _ = fake_launches
    k = make([8, 8, 8])
    t = _fake_tensor(0x4000)
    signatures = [(lambda v: (t, v, np.int64(v))), (lambda v: (v, t, v)), (lambda v: (t, np.uint64(v), t))]
    for i in rng.integers(0, len(signatures), 40):
        value = int(rng.integers(1, 2**40)) * 16
        args = signatures[i](value)
        k(2, 64, *args)
        want = [a.ptr if hasattr(a, "ptr") else int(a) for a in args]
        assert [int.from_bytes(p, "little") for p in calls[-1]["params"]] == want
    assert len(k._packers) == 3
    n = len(calls)
    with pytest.raises(ValueError, match="fam/kern: 2 arguments given, the kernel takes 3"):
        k(2, 64, t, 5)
    with pytest.raises(ValueError, match="argument 2 is a int32 \\(4 bytes\\), the kernel's parameter 2 takes 8"):
        k(2, 64, t, 5, np.int32(5))
    with pytest.raises(ValueError, match="argument 1: a Python float would be passed as a double"):
        k(2, 64, t, 0.5, t)
    k(2, 64, t, 0x10, t, pdl=True)  # the PDL launch (its own path) and back
    k(2, 64, t, 0x20, np.int64(3))
    assert len(calls) == n + 2 and calls[-2]["ex"] and not calls[-1]["ex"]
    assert [int.from_bytes(p, "little") for p in calls[-2]["params"]] == [0x4000, 0x10, 0x4000]
    assert [int.from_bytes(p, "little") for p in calls[-1]["params"]] == [0x4000, 0x20, 3]
    k0 = make([])  # a kernel without parameters
    k0(3, 32)
    k0(3, 32)
    assert calls[-1]["params"] == [] and calls[-1]["grid"] == (3, 1, 1) and len(calls) == n + 4
    with pytest.raises(ValueError, match="1 arguments given, the kernel takes 0"):
        k0(3, 32, t)


@pytest.mark.parametrize("static", [0, 1024, 8])
def test_dynamic_smem_opt_in_counts_the_static_shared_memory(fake_launches, static):
    """The driver refuses a launch whose static plus dynamic shared memory passes 48 KB unless the dynamic limit was
    raised: 48 KB dynamic beside 1 KB of static arrays needs the opt-in (an FP8 MoE GEMM failed so on an H100)."""
    make, calls, state = fake_launches
    state["static_smem"] = static
    k = make([])
    k(1, 32, smem=48 * 1024 - static)  # exactly the default limit: no opt-in
    assert state["smem_optins"] == []
    k(1, 32, smem=48 * 1024 - static + 16)
    assert state["smem_optins"] == [48 * 1024 - static + 16]
    k(1, 32, smem=1024)  # below the raised limit: no second opt-in
    k(1, 32, smem=100 * 1024)
    assert state["smem_optins"] == [48 * 1024 - static + 16, 100 * 1024]
    assert [c["smem"] for c in calls] == [48 * 1024 - static, 48 * 1024 - static + 16, 1024, 100 * 1024]
    with pytest.raises(ValueError, match=rf"kern: {227 * 1024 - static + 1} bytes of dynamic shared memory asked "
                                         rf"\(and {static} static\), the device allows {227 * 1024}"):
        k(1, 32, smem=227 * 1024 - static + 1)
    assert len(calls) == 4


@pytest.mark.parametrize("grid,block,dims", [(5, 64, ((5, 1, 1), (64, 1, 1))), ((5,), (64,), ((5, 1, 1), (64, 1, 1))),
                                             ((5, 6), (32, 2), ((5, 6, 1), (32, 2, 1))),
                                             ((5, 6, 7), (8, 4, 2), ((5, 6, 7), (8, 4, 2))),
                                             (np.int64(9), [16], ((9, 1, 1), (16, 1, 1)))])
def test_launch_grid_and_block_forms(fake_launches, grid, block, dims):
    make, calls, _ = fake_launches
    make([8])(grid, block, 0x1000)
    assert (calls[-1]["grid"], calls[-1]["block"]) == dims
    with pytest.raises(ValueError, match="grid: expected an int or a tuple"):
        make([8])((1, 2, 3, 4), 32, 0x1000)


def test_launch_argument_errors_name_the_argument(fake_launches):
    make, calls, _ = fake_launches
    k = make([8, 4, 8])
    t = _fake_tensor(4096)
    with pytest.raises(ValueError, match="fam/kern: 2 arguments given, the kernel takes 3"):
        k(1, 32, t, np.float32(1))
    with pytest.raises(ValueError, match="argument 2 is a int32 \\(4 bytes\\), the kernel's parameter 2 takes 8"):
        k(1, 32, t, np.float32(1), np.int32(5))
    with pytest.raises(ValueError, match="argument 1 is a device address \\(8 bytes\\).* takes 4"):
        k(1, 32, t, 5, np.int64(5))
    with pytest.raises(ValueError, match="argument 1: a Python float would be passed as a double"):
        k(1, 32, t, 1.5, np.int64(5))
    with pytest.raises(ValueError, match="argument 2: a bool has no fixed width"):
        k(1, 32, t, np.float32(1), True)
    with pytest.raises(ValueError, match="argument 0: cannot pass a str"):
        k(1, 32, "x", np.float32(1), np.int64(5))
    k(1, 32, t, np.float32(1), np.int64(5))  # this signature now has a packer: errors must still be named
    from xserv.tensor import Tensor

    with pytest.raises(ValueError, match="argument 0 \\(Tensor\\): a CPU tensor has no device pointer"):
        k(1, 32, Tensor.empty((3,), np.float32, "cpu"), np.float32(1), np.int64(5))
    k2 = make([8, 8])
    k2(1, 32, 0x1000, 0x2000)
    with pytest.raises(ValueError, match="argument 1 \\(int\\)"):
        k2(1, 32, 0x1000, -5)  # a negative address
    assert len(calls) == 2  # no failed call reached the driver


def test_launch_without_param_info_still_packs(fake_launches):
    """Where the driver cannot list the parameters (before CUDA 12.4) the layout comes from the arguments alone."""
    make, calls, state = fake_launches
    k = make(None)
    state["sizes"] = [8, 4]  # only for reading back the bytes
    k(2, 32, 0xABC0, np.int32(-3))
    assert int.from_bytes(calls[-1]["params"][0], "little") == 0xABC0
    assert np.frombuffer(calls[-1]["params"][1], np.int32)[0] == -3


def test_launch_failure_is_a_cuda_error_naming_the_kernel(fake_launches, monkeypatch):
    from cuda.bindings import driver

    import xserv.runtime.errors as errors
    from xserv.runtime import CudaError

    make, _, state = fake_launches
    monkeypatch.setattr(errors, "driver", type("D", (), {"CUresult": driver.CUresult,
                        "cuGetErrorName": staticmethod(lambda e: (0, b"CUDA_ERROR_INVALID_VALUE")),
                        "cuGetErrorString": staticmethod(lambda e: (0, b"invalid argument"))}))
    state["result"] = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="launch of fam/kern grid=7 block=\\(2048,\\) smem=0 failed: CUDA_ERROR_INVALID_VALUE"):
        make([8])(7, (2048,), 0x1000)


@pytest.mark.parametrize("cc", [(9, 0), (8, 0)])
def test_pdl_launch_sets_programmatic_stream_serialization(fake_launches, cc):
    from cuda.bindings import driver

    make, calls, _ = fake_launches
    k = make([8, 8], cc)
    for pdl in (True, False, True):
        k((4, 2), 256, 0x100, 0x200, smem=64, pdl=pdl)
        got = calls[-1]
        assert got["grid"] == (4, 2, 1) and got["block"] == (256, 1, 1) and got["smem"] == 64
        assert [int.from_bytes(p, "little") for p in got["params"]] == [0x100, 0x200]
        if pdl and cc >= (9, 0):
            pss = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            assert got["ex"] and got["attrs"] == [(pss, 1)] and got["stream"] == _FakeDevice.stream_handle
        else:  # no PDL before Hopper: a plain stream-ordered launch
            assert not got["ex"]


def test_cluster_launch_sets_the_cluster_dimension(fake_launches):
    from cuda.bindings import driver

    make, calls, _ = fake_launches
    pss = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    cdim = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    k = make([8])
    for pdl, cluster, want in ((False, 4, [(cdim, (4, 1, 1))]), (True, 8, [(pss, 1), (cdim, (8, 1, 1))]),
                               (True, 1, [(pss, 1)]), (False, 4, [(cdim, (4, 1, 1))])):
        k((8, 3, 2), 128, 0x100, smem=1024, pdl=pdl, cluster=cluster)
        got = calls[-1]
        assert got["ex"] and got["attrs"] == want
        assert got["grid"] == (8, 3, 2) and got["block"] == (128, 1, 1) and got["smem"] == 1024
        assert [int.from_bytes(p, "little") for p in got["params"]] == [0x100]
    k(8, 128, 0x100)
    assert not calls[-1]["ex"]  # cluster 1, no PDL: the plain launch
    n = len(calls)
    with pytest.raises(ValueError, match="grid x 6 is not a multiple of the cluster size 4"):
        k(6, 128, 0x100, cluster=4)
    with pytest.raises(ValueError, match="cluster 16: expected an int in 1..8"):
        k(16, 128, 0x100, cluster=16)
    with pytest.raises(ValueError, match="a cluster launch needs sm_90 or later, this device is 8.0"):
        make([8], (8, 0))(8, 128, 0x100, cluster=2)
    assert len(calls) == n  # no refused launch reached the driver


def test_tensor_attributes_and_views_are_plain_values():
    from xserv.tensor import Tensor, bfloat16

    t = _fake_tensor(0x10000, (6, 4, 8), bfloat16, offset=32)
    assert t.ptr == 0x10020 and t.numel == 192 and t.nbytes == 384 and t.ndim == 3
    v = t.view(24, -1)
    assert v.shape == (24, 8) and v.ptr == t.ptr and v.dtype is bfloat16 and v.nbytes == 384
    assert t.view((np.int64(3), -1)).shape == (3, 64)  # NumPy integers take the checked path
    assert t[2:5].ptr == t.ptr + 2 * 64 and t[2:5].shape == (3, 4, 8) and t[-1].ptr == t.ptr + 5 * 64
    assert t[4:2].shape == (0, 4, 8) and t[1].shape == (4, 8) and t[1][3].ptr == t.ptr + 64 + 3 * 16
    with pytest.raises(ValueError, match="view: shape \\(5, 5\\) has 25 elements, tensor has 192"):
        t.view(5, 5)
    with pytest.raises(ValueError, match="at most one dimension may be -1"):
        t.view(-1, -1)
    with pytest.raises(ValueError, match="cannot infer -1"):
        t.view(-1, 5)
    with pytest.raises(ValueError, match="negative dimension"):
        t.view(-2, -96)
    c = Tensor.empty((3, 5), np.float32, "cpu")
    assert c.numel == 15 and c.nbytes == 60 and c.view(5, 3).array.base is not None
    with pytest.raises(ValueError, match="no device pointer"):
        c.ptr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        c.nope


def test_op_checks_name_the_argument():
    from xserv.ops._checks import check_tensor, same_device
    from xserv.ops._launch import check_eps, identical, overlaps
    from xserv.tensor import Tensor, bfloat16, float32

    x = _fake_tensor(0x10000, (4, 6), bfloat16)
    assert check_tensor("x", x, dtype=bfloat16, shape=(4, 6)) is x
    assert check_tensor("x", x, dtype=(float32, bfloat16), shape=(None, 6), ndim=2) is x
    with pytest.raises(ValueError, match="x: shape \\[4, 6\\], expected \\[\\*, 7\\]"):
        check_tensor("x", x, shape=(None, 7))
    with pytest.raises(ValueError, match="x: dtype bfloat16, expected float32"):
        check_tensor("x", x, dtype=float32)
    with pytest.raises(ValueError, match="x: expected 3 dimensions"):
        check_tensor("x", x, ndim=3)
    with pytest.raises(ValueError, match="x: expected a Tensor, got ndarray"):
        check_tensor("x", np.zeros(3))
    with pytest.raises(ValueError, match="x on cuda, y on cpu"):
        same_device(x=x, y=Tensor.empty((2,), float32, "cpu"), z=None)
    assert same_device(x=x, z=None) == "cuda"
    assert overlaps(x, x[3:]) and not overlaps(x[:2], x[2:]) and identical(x, x.view(24)) and not identical(x, x[1:])
    assert check_eps(1e-6) == np.float32(1e-6) and check_eps(0) == 0
    for bad in (-1.0, float("nan"), float("inf"), True, "1e-6"):
        with pytest.raises(ValueError, match="eps"):
            check_eps(bad)


# ---- launch path on the GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_kernel_checks_its_parameters_on_the_device(rng):
    from xserv.runtime import CudaError, kernel
    from xserv.tensor import Tensor, float32

    fill = kernel("fill", "fill_f32")
    assert fill.param_sizes == [8, 4, 8]
    n = int(rng.integers(300, 3000))
    value = np.float32(rng.standard_normal())
    out = Tensor.full((n,), np.nan, float32)
    for grid, block in ((-(-n // 128), 128), ((-(-n // 64),), (64, 1)), ((-(-n // 32), 1, 1), (32, 1, 1))):
        out.copy_(np.full(n, np.nan, np.float32))
        fill(grid, block, out, value, np.int64(n))
        np.testing.assert_array_equal(out.numpy(), np.full(n, value, np.float32))
    with pytest.raises(ValueError, match="argument 2 is a int32"):
        fill(1, 32, out, value, np.int32(n))
    with pytest.raises(ValueError, match="2 arguments given, the kernel takes 3"):
        fill(1, 32, out, value)
    with pytest.raises(ValueError, match="argument 1: a Python float"):
        fill(1, 32, out, 1.0, np.int64(n))
    with pytest.raises(CudaError, match="launch of fill/fill_f32 .* failed: CUDA_ERROR_INVALID_VALUE"):
        fill(1, 4096, out, value, np.int64(n))  # more threads per block than any GPU has
    fill(1, 32, out, value, np.int64(1))  # the stream still works after a refused launch
    out.numpy()


_PDL_DELAY_NS = 2_000_000  # the producer's spin: long enough that a dependent released early surely runs inside it


def _pdl_pair(rng, n):
    from xserv.runtime import kernel
    from xserv.tensor import Tensor, float32

    src_np = (rng.standard_normal(n) + 0.5).astype(np.float32)
    src = Tensor.from_numpy(src_np)
    buf, out = Tensor.full((n,), np.nan, float32), Tensor.full((n,), np.nan, float32)
    k = {name: kernel("dev/pdl_test", name) for name in ("pdl_producer", "pdl_consumer", "pdl_consumer_nowait")}
    return src_np, src, buf, out, k


def _run_pair(k, consumer, src, buf, out, n, pdl):
    k["pdl_producer"](1, 256, src, buf, np.int64(n), np.int64(_PDL_DELAY_NS))
    k[consumer](-(-n // 256), 256, buf, out, np.int64(n), pdl=pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_pdl_launch_eager(rng, n):
    from xserv.runtime import get_device

    src_np, src, buf, out, k = _pdl_pair(rng, n)
    expect = 2 * (src_np + np.float32(1))
    _run_pair(k, "pdl_consumer", src, buf, out, n, pdl=True)  # waits inside: correct although it starts early
    np.testing.assert_array_equal(out.numpy(), expect)
    buf.copy_(np.full(n, np.nan, np.float32))
    out.copy_(np.full(n, np.nan, np.float32))
    _run_pair(k, "pdl_consumer_nowait", src, buf, out, n, pdl=False)  # stream order: correct without a wait
    np.testing.assert_array_equal(out.numpy(), expect)
    if pdl_enabled(get_device().arch):
        # without the wait and with PDL, the consumer overlaps the producer's spin and reads the stale (NaN) buffer:
        # the attribute took effect
        buf.copy_(np.full(n, np.nan, np.float32))
        _run_pair(k, "pdl_consumer_nowait", src, buf, out, n, pdl=True)
        assert np.isnan(out.numpy()).any()


@pytest.mark.gpu
def test_pdl_launch_in_a_captured_graph(rng):
    from xserv.runtime import get_device
    from xserv.runtime.graphs import CUDAGraph

    n = 3001
    src_np, src, buf, out, k = _pdl_pair(rng, n)
    _, _, buf2, out2, _ = _pdl_pair(rng, n)
    graph = CUDAGraph()
    with graph.capture():
        _run_pair(k, "pdl_consumer", src, buf, out, n, pdl=True)
        # a chain: the next producer is itself a PDL launch (it waits before reading src)
        k["pdl_producer"](2, 128, out, buf2, np.int64(n), np.int64(0), pdl=True)
        k["pdl_consumer"](-(-n // 128), 128, buf2, out2, np.int64(n), pdl=True)
    for _ in range(2):
        src_np = (rng.standard_normal(n) - 0.3).astype(np.float32)
        src.copy_(src_np)
        for t in (buf, out, buf2, out2):
            t.copy_(np.full(n, np.nan, np.float32))
        graph.replay()
        first = 2 * (src_np + np.float32(1))
        np.testing.assert_array_equal(out.numpy(), first)
        np.testing.assert_array_equal(out2.numpy(), 2 * (first + np.float32(1)))
    if pdl_enabled(get_device().arch):  # the captured edge is programmatic: the overlap survives capture
        stale = CUDAGraph()
        with stale.capture():
            _run_pair(k, "pdl_consumer_nowait", src, buf, out, n, pdl=True)
        buf.copy_(np.full(n, np.nan, np.float32))
        stale.replay()
        assert np.isnan(out.numpy()).any()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl,loads,padded", [(False, 0, False), (True, 0, False), (True, 16, True)])
def test_sync_bench_chain_orders_the_data(pdl, loads, padded):
    """tools/dev/bench_sync's kernel chain (each step reads a neighbour's value from the step before) gives the values
    the chain implies, with and without programmatic dependent launch, pre-wait loads and shared-memory padding:
    the boundary it times is a real hand-off."""
    from tools.dev.bench_sync import _padding, chain
    from xserv.runtime import get_device

    dev = get_device()
    grid = 2 * dev.multiprocessor_count
    _, ok = chain(grid, steps=8, pdl=pdl, replays=3, loads=loads, smem=_padding(dev, grid) if padded else 0)
    assert ok


@pytest.mark.gpu
@pytest.mark.parametrize("form", [0, 1, 2, 3])
@pytest.mark.parametrize("per_sm,loads", [(None, 0), (1, 0), (2, 0), (2, 16)])
def test_sync_bench_barriers_order_the_data(form, per_sm, loads):
    """Every grid-barrier form of tools/dev/bench_sync orders the data: no CTA reads its neighbour's slot before the
    neighbour wrote it that round (37 CTAs: a partial group of the two-level form; with loads in flight across it,
    from all warps or all but the arriving one)."""
    from tools.dev.bench_sync import barrier
    from xserv.runtime import get_device

    grid = 37 if per_sm is None else per_sm * get_device().multiprocessor_count
    for warp0_loads in ((True, False) if loads else (True,)):
        _, errors = barrier(grid, form, rounds=400, repeats=1, loads=loads, warp0_loads=warp0_loads)
        assert errors == 0
