"""Page-locked host arrays and events: the pieces for reading small device results back without stalling the
host. A copy into pageable memory waits for the stream; one into pinned memory is queued like a kernel, and an
event recorded after it says when the bytes have landed."""
from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver

from .errors import check_driver


class PinnedArray:
    """A NumPy array in page-locked host memory (freed with the object)."""

    def __init__(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        self.ptr = int(check_driver(driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        buf = (ctypes.c_byte * nbytes).from_address(self.ptr)
        self.array = np.frombuffer(buf, np.uint8, count=int(np.prod(shape)) * dtype.itemsize).view(dtype)
        self.array = self.array.reshape(shape)

    def copy_from_async(self, tensor, stream: int) -> np.ndarray:
        """Queue a copy of device `tensor` (contiguous, fits) into the start of this array; returns that view.
        The bytes are there once an event recorded after this call has completed."""
        view = self.array.reshape(-1).view(np.uint8)[:tensor.nbytes].view(tensor.dtype).reshape(tensor.shape)
        if tensor.nbytes:
            check_driver(driver.cuMemcpyDtoHAsync(self.ptr, tensor.ptr, tensor.nbytes, stream), "cuMemcpyDtoHAsync")
        return view

    def copy_to_async(self, tensor, nbytes: int, stream: int) -> None:
        """Queue a copy of this array's first `nbytes` into device `tensor` (contiguous, large enough). The array
        must not be refilled before an event recorded after this call has completed."""
        if nbytes:
            check_driver(driver.cuMemcpyHtoDAsync(tensor.ptr, self.ptr, nbytes, stream), "cuMemcpyHtoDAsync")

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                driver.cuMemFreeHost(ptr)
            except Exception:
                pass


class Event:
    """A CUDA event; without timing (the default) it is cheaper to record and wait on."""

    def __init__(self, timing: bool = False):
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check_driver(driver.cuEventCreate(flags), "cuEventCreate")

    def elapsed_ms(self, later: "Event") -> float:
        """Milliseconds from this event to `later` (both recorded with timing, both completed)."""
        return check_driver(driver.cuEventElapsedTime(self.handle, later.handle), "cuEventElapsedTime")

    def record(self, stream: int) -> None:
        check_driver(driver.cuEventRecord(self.handle, stream), "cuEventRecord")

    def synchronize(self) -> None:
        check_driver(driver.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def wait_on(self, stream: int) -> None:
        """Make `stream`'s later work wait until this event (as last recorded) has completed."""
        check_driver(driver.cuStreamWaitEvent(stream, self.handle, 0), "cuStreamWaitEvent")

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None:
            try:
                driver.cuEventDestroy(handle)
            except Exception:
                pass
