"""A caching device allocator.

Requests are rounded up to a size class; a freed block goes back to the free list of its class and is handed to
the next request of that class, so a steady-state loop (a decode step, a benchmark) calls cuMemAlloc zero times.
All work runs on one stream, so a block freed by Python and reused by a later launch is ordered after every
earlier use of it on that stream.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from cuda.bindings import driver

from .errors import CudaError, DeviceOutOfMemory, check_driver

_SMALL = 1 << 20  # below 1 MiB: 512-byte granules
_LARGE_GRANULE = 2 << 20  # above: 2 MiB granules


def size_class(nbytes: int) -> int:
    if nbytes <= 0:
        return 512
    if nbytes < _SMALL:
        return (nbytes + 511) & ~511
    return (nbytes + _LARGE_GRANULE - 1) // _LARGE_GRANULE * _LARGE_GRANULE


@dataclass(slots=True)
class AllocatorStats:
    bytes_in_use: int = 0
    peak_bytes_in_use: int = 0
    bytes_cached: int = 0  # held by the allocator but free, ready for reuse
    device_allocations: int = 0  # cuMemAlloc calls made so far
    device_frees: int = 0


class DeviceBuffer:
    """A block of device memory. Returned to its allocator's cache when garbage-collected or `free()`d (once).

    Released from `__del__` rather than a weakref.finalize: registering a finalizer cost 1.5 us per allocation,
    a fifth of an eager op's host time (docs/runtime.md). A buffer has no reference cycles, so CPython's reference
    counting releases it as soon as the last Tensor that views it goes. The release is written out here (not a call
    into the allocator): it runs once per eager op that allocates its output."""

    __slots__ = ("ptr", "nbytes", "_allocator", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, allocator: "CachingAllocator"):
        self.ptr = ptr
        self.nbytes = nbytes
        self._allocator = allocator

    def free(self) -> None:
        allocator = self._allocator
        if allocator is not None:
            self._allocator = None
            size = self.nbytes
            stats = allocator.stats
            stats.bytes_in_use -= size
            stats.bytes_cached += size
            free_list = allocator._free.get(size)
            if free_list is None:
                free_list = allocator._free[size] = []
            free_list.append(self.ptr)

    __del__ = free

    def __repr__(self):
        return f"DeviceBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes})"


class CachingAllocator:
    def __init__(self, memory_info=None):
        self._free: dict[int, list[int]] = {}  # size class -> free blocks (device addresses) of that class
        self._memory_info = memory_info
        self.stats = AllocatorStats()
        self._recorders: list[list[DeviceBuffer]] = []  # open keep_alive() lists

    def allocate(self, nbytes: int) -> DeviceBuffer:
        # size_class() written out for the small sizes: this runs once per eager op that allocates its output
        size = (nbytes + 511) & -512 if 0 < nbytes < _SMALL else size_class(nbytes)
        stats = self.stats
        free_list = self._free.get(size)
        if free_list:
            ptr = free_list.pop()
            stats.bytes_cached -= size
        else:
            ptr = self._device_alloc(size)
        in_use = stats.bytes_in_use = stats.bytes_in_use + size
        if in_use > stats.peak_bytes_in_use:
            stats.peak_bytes_in_use = in_use
        buf = DeviceBuffer(ptr, size, self)
        if self._recorders:
            for recorder in self._recorders:
                recorder.append(buf)
        return buf

    @contextmanager
    def keep_alive(self, into: list):
        """Append every buffer allocated inside the block to `into`, which keeps them allocated as long as it lives.
        For CUDA graph capture: the addresses of buffers allocated while capturing are baked into the graph, so they
        must outlive it even when Python drops the Tensors."""
        self._recorders.append(into)
        try:
            yield into
        finally:
            self._recorders.remove(into)

    def _device_alloc(self, size: int) -> int:
        err, ptr = driver.cuMemAlloc(size)
        if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            self.empty_cache()
            err, ptr = driver.cuMemAlloc(size)
        if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            free, total = self._memory_info() if self._memory_info else (-1, -1)
            raise DeviceOutOfMemory(
                f"out of device memory: asked for {size / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free of "
                f"{total / 2**20:.1f} MiB total ({self.stats.bytes_in_use / 2**20:.1f} MiB in use by xserv)"
            )
        check_driver((err,), f"cuMemAlloc({size})")
        self.stats.device_allocations += 1
        return int(ptr)

    def empty_cache(self) -> None:
        """Give every cached (free) block back to the driver."""
        for size, ptrs in self._free.items():
            for ptr in ptrs:
                try:
                    check_driver(driver.cuMemFree(ptr), "cuMemFree")
                except CudaError:
                    pass
                self.stats.bytes_cached -= size
                self.stats.device_frees += 1
        self._free.clear()
