"""CUDA graphs: capture a region of work on xserv's stream once, replay it with one launch."""
from __future__ import annotations

from cuda.bindings import driver

from .errors import check_driver


class CUDAGraph:
    """Usage:
        graph = CUDAGraph()
        with graph.capture():
            step()          # launches only; no allocation of new sizes, no host synchronisation
        graph.replay()      # re-runs every captured launch on the same buffers
    """

    def __init__(self):
        from . import get_device

        self._device = get_device()
        self._graph = None
        self._exec = None

    def capture(self):
        return _Capture(self)

    def replay(self) -> None:
        if self._exec is None:
            raise RuntimeError("CUDAGraph.replay() before a capture")
        check_driver(driver.cuGraphLaunch(self._exec, self._device.stream_handle), "cuGraphLaunch")

    def close(self) -> None:
        if self._exec is not None:
            driver.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            driver.cuGraphDestroy(self._graph)
            self._graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Capture:
    def __init__(self, graph: CUDAGraph):
        self.graph = graph

    def __enter__(self):
        self.graph.close()
        # Relaxed mode: the caching allocator may still call cuMemAlloc for a size it has not seen (outside the
        # stream); capture only records stream work.
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        check_driver(driver.cuStreamBeginCapture(self.graph._device.stream_handle, mode), "cuStreamBeginCapture")
        return self.graph

    def __exit__(self, exc_type, exc, tb):
        graph = check_driver(driver.cuStreamEndCapture(self.graph._device.stream_handle), "cuStreamEndCapture")
        if exc_type is not None:
            if graph is not None:
                driver.cuGraphDestroy(graph)
            return False
        self.graph._graph = graph
        self.graph._exec = check_driver(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return False
