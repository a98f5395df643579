"""What the benchmarks and the kernel harness share: the device's ceilings measured in the same run (copy bandwidth,
a large cuBLAS GEMM), inputs moved to the device or to torch, and torch timings with xserv's protocol."""
from __future__ import annotations

import statistics

import numpy as np


def to_device(inputs: dict) -> dict:
    """NumPy arrays -> CUDA Tensors; other values (scalars, options) as they are."""
    from xserv.tensor import Tensor

    return {k: Tensor.from_numpy(v, "cuda") if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


def torch_inputs(inputs: dict):
    """NumPy arrays -> torch CUDA tensors (bf16 through its bits); other values as they are."""
    import torch

    out = {}
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            if v.dtype.name == "bfloat16":
                out[k] = torch.from_numpy(v.view(np.uint16).astype(np.int16)).view(torch.bfloat16).cuda()
            else:
                out[k] = torch.from_numpy(np.ascontiguousarray(v)).cuda()
        else:
            out[k] = v
    return out


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy through our 16-byte copy kernel, counting bytes read plus bytes written."""
    from xserv.runtime import get_device, kernel
    from xserv.runtime.timing import benchmark
    from xserv.tensor import Tensor, uint8

    src, dst = Tensor.empty((nbytes,), uint8), Tensor.empty((nbytes,), uint8)
    copy = kernel("fill", "copy_u128")
    n16 = np.int64(nbytes // 16)
    grid = get_device().multiprocessor_count * 16
    ms = benchmark([lambda: copy(grid, 256, dst, src, n16)], warmup=5, iters=20)
    return 2 * nbytes / ms / 1e6


def gemm_tflops(m: int = 8192, n: int = 8192, k: int = 8192) -> float:
    from xserv.ops.linear import linear
    from xserv.runtime.timing import benchmark
    from xserv.tensor import Tensor, bfloat16

    rng = np.random.default_rng(0)
    x = Tensor.from_numpy(rng.standard_normal((m, k), np.float32).astype(bfloat16))
    w = Tensor.from_numpy(rng.standard_normal((n, k), np.float32).astype(bfloat16))
    out = Tensor.empty((m, n), bfloat16)
    ms = benchmark([lambda: linear(x, w, out)], warmup=3, iters=10)
    return 2 * m * n * k / ms / 1e9


def torch_graph_median(torch, fns, calls=20, iters=20) -> float:
    """Like xserv.runtime.timing.benchmark_graph: replay a torch CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def torch_median(torch, fns, warmup=5, iters=30, inner=10) -> float:
    """The same protocol as xserv.runtime.timing.benchmark, with torch's events on torch's stream."""
    for i in range(warmup):
        fns[i % len(fns)]()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, n = [], 0
    for _ in range(iters):
        start.record()
        for _ in range(inner):
            fns[n % len(fns)]()
            n += 1
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)
