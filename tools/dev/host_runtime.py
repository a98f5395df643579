"""xserv's runtime over a fake driver, for measuring and testing the Python side of eager launches without a GPU.

`install(...)` makes the process's runtime a host-only one: a fake device, the real CachingAllocator over a no-op
cuMemAlloc (fake 256-byte-aligned addresses), the real KernelCache and Kernel over fake cubins (one fake function
handle per kernel name), and cuLaunchKernel / cuLaunchKernelEx replaced by no-ops. Nothing launched through it
reaches a GPU; everything above the driver (op checks, Tensor allocation, argument packing) is xserv's own code.

    python -m tools.bench_runtime --only host      # the timings (tools/bench_runtime.py)
    tests/runtime/test_eager_fast_paths.py                 # the ops' fast paths against their checked paths
"""
from __future__ import annotations

import ctypes

from cuda.bindings import driver


class HostInfo:
    index = 0
    compute_capability = (9, 0)
    max_shared_memory_per_block_optin = 227 * 1024


class HostDevice:
    """What Kernel, the allocator and the ops read from a Device; nothing here talks to a driver."""
    name = "no GPU: fake driver (host-side Python only)"
    arch = "sm_90a"
    multiprocessor_count = 132
    stream_handle = 0x5150
    info = HostInfo()

    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        return 80 << 30, 80 << 30


class _Core:
    """A cuda.core kernel stand-in: only its handle is read (as the function to launch)."""

    def __init__(self, handle: int):
        self.handle = driver.CUfunction(handle)


class _Module:
    def __init__(self, family: str, names: dict):
        self._family, self._names = family, names

    def get_kernel(self, name):
        handle = 0x1000 + 16 * len(self._names)
        self._names[handle] = (self._family, name)
        return _Core(handle)


class _NoOpDriver:
    """The driver module as the allocator sees it, with cuMemAlloc / cuMemFree as no-ops handing out fake addresses
    (256-byte aligned, like the real one); everything else is the real module's."""

    def __init__(self, real):
        self._real = real
        self._next = 1 << 32

    def cuMemAlloc(self, size):
        ptr, self._next = self._next, self._next + ((int(size) + 255) & ~255)
        return self._real.CUresult.CUDA_SUCCESS, ptr

    def cuMemFree(self, ptr):
        return (self._real.CUresult.CUDA_SUCCESS,)

    def __getattr__(self, name):
        return getattr(self._real, name)


def install(launches: list | None = None, param_sizes: dict | None = None, setattr=setattr):
    """Make this process's runtime host-only (see the module's doc); returns the runtime.

    launches: when given, every launch appends (family, kernel name, grid (x, y, z), block (x, y, z), smem, the
    8-byte parameter slots as ints); without it the fake launch does nothing at all (for timing).
    param_sizes: {kernel name: [bytes of each parameter]} that the fake cubins report (as cuFuncGetParamInfo
    would), so that a call is checked against them; kernels not named report none (a driver before CUDA 12.4).
    setattr: how the module attributes are replaced (pytest's monkeypatch.setattr undoes them after a test)."""
    import xserv.runtime as runtime
    import xserv.runtime.allocator as allocator
    import xserv.runtime.kernels as kernels

    names: dict[int, tuple[str, str]] = {}  # fake function handle -> (family, kernel name)
    sizes = param_sizes or {}
    ok = (driver.CUresult.CUDA_SUCCESS,)

    if launches is None:
        def launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            return ok

        def launch_ex(config, func, params, extra):
            return ok
    else:
        def record(func, grid, block, smem, params):
            family, name = names[int(func)]
            n = len(sizes.get(name) or ()) or 16  # no sizes: the first 16 slots (xserv's kernels take fewer)
            slots = [ctypes.c_uint64.from_address(ctypes.c_void_p.from_address(params + 8 * i).value).value
                     for i in range(n)]
            launches.append((family, name, grid, block, smem, slots))

        def launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            record(func, (gx, gy, gz), (bx, by, bz), smem, params)
            return ok

        def launch_ex(config, func, params, extra):
            record(func, (config.gridDimX, config.gridDimY, config.gridDimZ),
                   (config.blockDimX, config.blockDimY, config.blockDimZ), config.sharedMemBytes, params)
            return ok

    setattr(kernels, "_cuLaunchKernel", launch)
    setattr(kernels, "_cuLaunchKernelEx", launch_ex)
    setattr(kernels, "_param_sizes", lambda func: sizes.get(names[int(func)][1]))
    if not isinstance(allocator.driver, _NoOpDriver):
        setattr(allocator, "driver", _NoOpDriver(allocator.driver))

    class HostKernelCache(kernels.KernelCache):
        def load_family(self, family):
            module = self._modules.get(family)
            if module is None:
                module = self._modules[family] = _Module(family, names)
            return module

    class HostRuntime:
        def __init__(self):
            self.device = HostDevice()
            self.allocator = allocator.CachingAllocator(self.device.memory_info)
            self.kernels = HostKernelCache(self.device)

    rt = HostRuntime()
    setattr(runtime, "_runtime", rt)
    return rt
