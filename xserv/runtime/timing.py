"""CUDA-event timing for benchmarks (never for tests)."""
from __future__ import annotations

import statistics
from typing import Callable

from .errors import check_driver


class EventTimer:
    def __init__(self):
        from cuda.bindings import driver

        from . import get_device

        self._stream = get_device().stream_handle
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT
        self._start = check_driver(driver.cuEventCreate(flags), "cuEventCreate")
        self._stop = check_driver(driver.cuEventCreate(flags), "cuEventCreate")

    def time_ms(self, fn: Callable[[], None], repeat: int = 1) -> float:
        """Milliseconds per call of `fn` (run `repeat` times between two events)."""
        from cuda.bindings import driver

        check_driver(driver.cuEventRecord(self._start, self._stream), "cuEventRecord")
        for _ in range(repeat):
            fn()
        check_driver(driver.cuEventRecord(self._stop, self._stream), "cuEventRecord")
        check_driver(driver.cuEventSynchronize(self._stop), "cuEventSynchronize")
        return check_driver(driver.cuEventElapsedTime(self._start, self._stop), "cuEventElapsedTime") / repeat


def benchmark(fns: list[Callable[[], None]], warmup: int = 10, iters: int = 50, inner: int = 1) -> float:
    """Median milliseconds of one call, rotating among `fns` (the same work on different buffers, so that the
    input set of one call is out of L2 by the time it comes round again)."""
    timer = EventTimer()
    for i in range(warmup):
        fns[i % len(fns)]()
    times = []
    for i in range(iters):
        fn = fns[i % len(fns)]
        times.append(timer.time_ms(fn, inner))
    return statistics.median(times)
