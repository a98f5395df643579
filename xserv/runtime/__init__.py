"""The runtime context: the only process-wide state in xserv (device, stream, allocator, kernel cache, cuBLAS).

Created on first use by any CUDA path; a CPU-only program never creates it.
"""
from __future__ import annotations

from .allocator import CachingAllocator
from .cublas import Cublas
from .device import Device, device_count
from .errors import CompileError, CublasError, CudaError, DeviceOutOfMemory, check_driver
from .kernels import KernelCache

_runtime = None


class Runtime:
    def __init__(self, device_index: int = 0):
        self.device = Device(device_index)
        self.allocator = CachingAllocator(self.device.memory_info)
        self.kernels = KernelCache(self.device)
        self._cublas = None

    @property
    def cublas(self):
        if self._cublas is None:
            self._cublas = Cublas(self.device, self.allocator)
        return self._cublas


def get_runtime() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def cuda_available() -> bool:
    return device_count() > 0


def get_device() -> Device:
    return get_runtime().device


def kernel(family: str, name: str):
    """The launchable kernel `name` from cuda_src/<family>.cu (compiled and loaded on first use). Every eager op
    launch asks: a loaded kernel is one dictionary lookup away."""
    runtime = _runtime if _runtime is not None else get_runtime()
    k = runtime.kernels._kernels.get((family, name))
    return k if k is not None else runtime.kernels.get(family, name)


def synchronize() -> None:
    get_runtime().device.synchronize()


def memory_stats():
    return get_runtime().allocator.stats


def empty_cache() -> None:
    get_runtime().allocator.empty_cache()


def release_cached_memory() -> None:
    """Give the device memory xserv keeps for reuse back to the driver: the TMA descriptors and the allocator's
    cached blocks. Only when nothing that may hold their addresses is left (no CUDA graph of a live LLM)."""
    if _runtime is None:
        return
    from .tma import release_descriptors

    release_descriptors()
    _runtime.allocator.empty_cache()


__all__ = [
    "Runtime", "get_runtime", "get_device", "kernel", "synchronize", "cuda_available", "memory_stats",
    "empty_cache", "release_cached_memory", "CudaError", "CompileError", "CublasError", "DeviceOutOfMemory", "check_driver",
]
