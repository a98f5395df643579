"""What a hand-off between dependent steps costs on this GPU: a kernel boundary inside a CUDA graph (with and
without programmatic dependent launch) against a software grid barrier inside one persistent kernel (four forms).
The step is tiny (CTA b reads what CTA b + 1 wrote in the step before), so the figures are the hand-off itself:
what a persistent batch-1 decode kernel would pay per dependent phase instead of a kernel boundary
(docs/kernels/gemv.md). Kernels: cuda_src/dev/sync_bench.cu. Prints the device name. GPU only.

    python -m tools.dev.bench_sync [--grids 132,264] [--rounds 2000] [--steps 64]

Grids default to one and two CTAs per SM (the GEMVs run two); every CTA of a barrier launch must be resident.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAMILY = "dev/sync_bench"
FORMS = {0: "atomic counter, polled", 1: "red.release counter, polled", 2: "last arriver releases a flag",
         3: "two-level counters, flag"}
NO_BARRIER = 4  # the form that only does the loads
WEIGHT_CHUNKS = 1 << 26  # 1 GiB of 16-byte chunks: the loads' source, far larger than L2
_LINE, _GROUP = 32, 8  # as in sync_bench.cu


_WEIGHT_BUFFERS = {}


def _weights(chunks: int):
    """A buffer of `chunks` 16-byte chunks (a power of two), made once per size: the loads' source."""
    from xserv.tensor import Tensor, uint8

    if chunks not in _WEIGHT_BUFFERS:
        _WEIGHT_BUFFERS[chunks] = Tensor.zeros((chunks * 16,), uint8)
    return _WEIGHT_BUFFERS[chunks]


def chain(grid: int, steps: int, pdl: bool, replays: int = 20, loads: int = 0, smem: int = 0) -> tuple[float, bool]:
    """A CUDA graph of `steps` dependent sync_chain_step launches of `grid` CTAs, replayed: (median us per step,
    whether every value came out as the chain implies). loads: 16-byte loads per thread before the wait (from
    1 GiB, past L2); smem: dynamic shared memory per CTA (padding that keeps the next step's CTAs off the SM)."""
    from xserv.runtime import kernel
    from xserv.runtime.graphs import CUDAGraph
    from xserv.runtime.timing import EventTimer
    from xserv.tensor import Tensor, int32

    step = kernel(FAMILY, "sync_chain_step")
    chunks = WEIGHT_CHUNKS if loads else 1
    weights, sink = _weights(chunks), Tensor.zeros((1,), int32)
    bufs = [Tensor.zeros((grid,), int32), Tensor.zeros((grid,), int32)]
    graph = CUDAGraph()
    with graph.capture():
        for i in range(steps):
            step(grid, 128, bufs[i % 2], bufs[(i + 1) % 2], weights, np.int64(chunks), np.int32(loads), np.int32(i),
                 sink, pdl=pdl, smem=smem)
    timer = EventTimer()
    times = [timer.time_ms(graph.replay) for _ in range(replays)]
    graph.close()
    # Every step adds one to a neighbour's value and the buffers alternate, so after `replays` replays of an even
    # chain each value in the buffer the last step wrote is replays * steps.
    ok = steps % 2 == 0 and bool((bufs[0].numpy() == replays * steps).all())
    return statistics.median(times) * 1e3 / steps, ok


def barrier(grid: int, form: int, rounds: int, repeats: int = 5, loads: int = 0,
            warp0_loads: bool = True) -> tuple[float, int]:
    """sync_grid_barrier with `rounds` rounds against 0 rounds (the launch): (median us per round, the mismatches
    counted over every launch). loads: 16-byte weight loads per thread issued before each barrier and used after it
    (warp0_loads False: not by warp 0, whose thread 0 arrives)."""
    from xserv.runtime import kernel
    from xserv.runtime.timing import EventTimer
    from xserv.tensor import Tensor, int32

    k = kernel(FAMILY, "sync_grid_barrier")
    chunks = WEIGHT_CHUNKS if loads else 1
    weights = _weights(chunks)
    data = Tensor.zeros((2 * grid,), int32)
    sync = Tensor.zeros((_LINE * (2 + -(-grid // _GROUP)),), int32)
    errors = Tensor.zeros((2,), int32)
    timer = EventTimer()

    def launch_ms(n: int) -> float:
        sync.copy_(np.zeros(sync.shape, np.int32))
        data.copy_(np.zeros(data.shape, np.int32))
        return timer.time_ms(lambda: k(grid, 128, data, sync, errors, np.int32(n), np.int32(form), weights,
                                       np.int64(chunks), np.int32(loads), np.int32(warp0_loads)))

    launch_ms(rounds)  # warm-up
    full = statistics.median(launch_ms(rounds) for _ in range(repeats))
    empty = statistics.median(launch_ms(0) for _ in range(repeats))
    return (full - empty) * 1e3 / rounds, int(errors.numpy()[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grids", default="", help="comma list of CTA counts (default: 1 and 2 per SM)")
    ap.add_argument("--rounds", type=int, default=2000, help="barriers per persistent launch")
    ap.add_argument("--steps", type=int, default=64, help="kernels per graph (even)")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        ap.error("--steps: an even number of at least 2")
    if args.rounds < 4:
        ap.error("--rounds: at least 4 (the runs with loads take a quarter of them)")
    try:
        grids = [int(g) for g in args.grids.split(",") if g]
    except ValueError:
        ap.error(f"--grids: expected a comma list of CTA counts, got {args.grids!r}")

    from xserv.runtime import get_device

    dev = get_device()
    sms = dev.multiprocessor_count
    grids = grids or [sms, 2 * sms]
    if any(not 1 <= g <= 16 * sms for g in grids):  # a barrier grid that is not all resident would hang
        ap.error(f"--grids: each between 1 and {16 * sms} (16 CTAs of 128 threads per SM, all resident)")
    print(f"device: {dev.name} ({sms} SMs); a dependent step of 128-thread CTAs, us per hand-off (median)")
    for grid in grids:
        for pdl in (False, True):
            us, ok = chain(grid, args.steps, pdl)
            print(f"  grid {grid:4d}  kernel boundary in a graph, {'with' if pdl else 'without'} PDL: {us:6.2f} us"
                  f"{'' if ok else '  WRONG VALUES'}")
        for form, name in FORMS.items():
            us, errors = barrier(grid, form, args.rounds)
            print(f"  grid {grid:4d}  grid barrier {form} ({name}): {us:6.2f} us"
                  f"{'' if errors == 0 else f'  {errors} MISMATCHES'}")
        # With a GEMV's pattern: 16 loads per thread of cold weights before the hand-off, used after it.
        smem = _padding(dev, grid)
        for pad in (0, smem):
            us, ok = chain(grid, args.steps, True, loads=16, smem=pad)
            print(f"  grid {grid:4d}  kernel boundary with PDL, 16 pre-wait loads per thread"
                  f"{f', {pad >> 10} KB smem (next CTAs not resident)' if pad else ''}: {us:6.2f} us"
                  f"{'' if ok else '  WRONG VALUES'}")
        for form, warp0 in ((NO_BARRIER, True), (0, True), (0, False), (2, True), (2, False)):
            us, errors = barrier(grid, form, args.rounds // 4, loads=16, warp0_loads=warp0)
            what = "loads alone" if form == NO_BARRIER else f"grid barrier {form}"
            print(f"  grid {grid:4d}  {what}, 16 loads per thread{'' if warp0 else ' but warp 0'}: {us:6.2f} us"
                  f"{'' if errors == 0 or form == NO_BARRIER else f'  {errors} MISMATCHES'}")
    return 0


def _padding(dev, grid: int) -> int:
    """Dynamic shared memory per CTA so that an SM holds only the CTAs of one step (ceil(grid / SMs) of them)."""
    per_sm = -(-grid // dev.multiprocessor_count)
    return (dev.info.max_shared_memory_per_block_optin // per_sm - 1024) // 1024 * 1024 if per_sm <= 2 else 0


if __name__ == "__main__":
    sys.exit(main())
