"""CUDA-event timing for benchmarks (never for tests)."""
from __future__ import annotations

import statistics
from typing import Callable

from cuda.bindings import driver

from .errors import check_driver
from .graphs import CUDAGraph


class EventTimer:
    def __init__(self):
        from . import get_device

        self._stream = get_device().stream_handle
        flags = driver.CUevent_flags.CU_EVENT_DEFAULT
        self._start = check_driver(driver.cuEventCreate(flags), "cuEventCreate")
        self._stop = check_driver(driver.cuEventCreate(flags), "cuEventCreate")

    def time_ms(self, fn: Callable[[], None], repeat: int = 1) -> float:
        """Milliseconds per call of `fn` (run `repeat` times between two events)."""
        check_driver(driver.cuEventRecord(self._start, self._stream), "cuEventRecord")
        for _ in range(repeat):
            fn()
        check_driver(driver.cuEventRecord(self._stop, self._stream), "cuEventRecord")
        check_driver(driver.cuEventSynchronize(self._stop), "cuEventSynchronize")
        return check_driver(driver.cuEventElapsedTime(self._start, self._stop), "cuEventElapsedTime") / repeat


def benchmark(fns: list[Callable[[], None]], warmup: int = 10, iters: int = 30, inner: int = 10) -> float:
    """Median milliseconds of one call. Each timed sample runs `inner` calls back to back, cycling through `fns`
    (the same work on different buffers, so that an input set is out of L2 by the time it comes round again);
    back-to-back calls keep the GPU queue fed, so the host's launch cost does not show as GPU idle time."""
    timer = EventTimer()
    for i in range(warmup):
        fns[i % len(fns)]()
    state = {"i": 0}

    def batch():
        for _ in range(inner):
            fns[state["i"] % len(fns)]()
            state["i"] += 1

    return statistics.median(timer.time_ms(batch) / inner for _ in range(iters))


def benchmark_graph(fns: list[Callable[[], None]], calls: int = 20, iters: int = 20) -> float:
    """Median milliseconds of one call, measured by replaying a CUDA graph that holds `calls` calls (cycling
    through `fns`): the GPU time of the work alone, without the host's launch cost. The decode step runs
    this way in the engine. Each fn is run once first, outside the capture, so that plans and buffers exist."""
    for fn in fns:
        fn()
    graph = CUDAGraph()
    with graph.capture():
        for i in range(calls):
            fns[i % len(fns)]()
    timer = EventTimer()
    graph.replay()
    times = [timer.time_ms(graph.replay) / calls for _ in range(iters)]
    graph.close()
    return statistics.median(times)
