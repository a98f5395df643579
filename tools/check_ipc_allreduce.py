"""The IPC one-shot all-reduce (xserv/parallel/ipc.py) on 2+ GPUs: checked against NumPy and NCCL, and timed.

    python -m tools.check_ipc_allreduce check [--world 2]     # exits 1 on a mismatch; prints what it checked
    python -m tools.check_ipc_allreduce bench [--world 2]     # us per all-reduce, IPC vs NCCL, eager and graph

One process per rank (spawn), each on GPU `rank`, joined through NCCL as the engine's ranks are. Every rank draws
every rank's partials from the same seed, so each one computes the NumPy reference itself; the results come back to
the parent, which checks they are the same bits on every rank. `check` also covers all_reduce_add (the kernel's
residual-add epilogue, allreduce_oneshot_add_bf16) against ipc.reference_sum_add, eager and in a CUDA graph
interleaved with plain all-reduces. tests/parallel/test_ipc_allreduce.py runs `check`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

import numpy as np

CHECK_SHAPES = [(1, 4096), (1, 5120), (4, 4096), (1, 1003), (3, 7), (8, 4096)]
BENCH_SHAPES = [(1, 4096), (1, 5120), (4, 4096), (8, 4096), (16, 4096), (64, 4096)]


def _partials(seed: int, world: int, shape):
    from xserv.tensor import bfloat16

    rng = np.random.default_rng(seed)
    return (rng.standard_normal((world, *shape)) + 0.25).astype(bfloat16)


def _rank_main(rank: int, world: int, uid: bytes, what: str, q) -> None:
    try:
        from xserv.parallel.worker import _bind_device

        _bind_device(rank)
        from xserv.parallel.comm import NcclCommunicator

        comm = NcclCommunicator(uid, rank, world, 8, 8 * world)
        if comm.ipc is None:
            q.put((rank, "error", "the IPC path is off on this machine (no peer access, or XSERV_TP_ALLREDUCE=nccl)"))
            return
        q.put((rank, "ok", _check(comm, rank, world) if what == "check" else _bench(comm, rank, world)))
        comm.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _nccl(comm, t):
    ipc, comm.ipc = comm.ipc, None
    try:
        return comm.all_reduce(t)
    finally:
        comm.ipc = ipc


def _check(comm, rank: int, world: int) -> dict:
    """Results keyed by case: (the result's bytes, mismatches against NumPy / NCCL as text)."""
    from xserv.parallel.ipc import reference_sum, use_ipc
    from xserv.runtime.graphs import CUDAGraph
    from xserv.tensor import Tensor

    out, problems = {}, []
    seed = 0
    # eager, many epochs: every shape in turn, 64 rounds (the halves and the flags reused 192 times each)
    for rnd in range(64):
        for shape in CHECK_SHAPES:
            seed += 1
            parts = _partials(seed, world, shape)
            t = Tensor.from_numpy(parts[rank], "cuda")
            assert use_ipc(comm.ipc, t), shape
            got = comm.all_reduce(t).numpy()
            want = reference_sum(parts.reshape(world, -1)).reshape(shape)
            if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                problems.append(f"eager round {rnd} {shape}: differs from NumPy's rank-order float32 sum")
            if rnd in (0, 63):
                out[f"eager{rnd}{shape}"] = got.tobytes()
                nccl = _nccl(comm, Tensor.from_numpy(parts[rank], "cuda")).numpy()
                if world == 2 and not np.array_equal(nccl.view(np.uint16), got.view(np.uint16)):
                    problems.append(f"eager {shape}: differs from NCCL (2 ranks: one rounding of a + b in both)")
    # a CUDA graph of three all-reduces (two shapes), replayed with fresh inputs: the epochs come from the device
    shapes = [(1, 4096), (1, 5120), (1, 4096)]
    from xserv.tensor import bfloat16

    xs = [Tensor.empty(s, bfloat16, "cuda") for s in shapes]
    for x in xs:  # warm-up outside the capture (the kernel loads here)
        x.copy_(np.zeros(x.shape, bfloat16))
        comm.all_reduce(x)
    graph = CUDAGraph()
    with graph.capture():
        for x in xs:
            comm.all_reduce(x)
    for rep in range(200):
        parts = [_partials(10_000 + 3 * rep + i, world, s) for i, s in enumerate(shapes)]
        for x, p in zip(xs, parts):
            x.copy_(p[rank])
        graph.replay()
        for i, (x, p) in enumerate(zip(xs, parts)):
            got = x.numpy()
            want = reference_sum(p.reshape(world, -1)).reshape(p.shape[1:])
            if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                problems.append(f"graph replay {rep} all-reduce {i}: differs from NumPy")
            if rep == 199:
                out[f"graph{i}"] = got.tobytes()
    graph.close()
    _check_add(comm, rank, world, out, problems)
    _check_broadcast(comm, rank, world, out, problems)
    return {"bytes": out, "problems": problems[:20], "count": len(problems)}


def _tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-5, 1 << 30, count).astype(np.int32)


def _check_broadcast(comm, rank: int, world: int, out: dict, problems: list) -> None:
    """broadcast_tokens (the decode step launched ahead at tp > 1): every rank ends with rank 0's int32 tokens minus
    its own offset; the other ranks' own values (different on every rank) must not leak in. Eager for several
    counts (partial last chunks included), then in a CUDA graph between two all-reduces, replayed with fresh
    tokens (the epochs shared with the all-reduce kernels)."""
    from xserv.parallel.ipc import reference_sum
    from xserv.runtime.graphs import CUDAGraph
    from xserv.tensor import Tensor, bfloat16, int32

    offset = 1000 * rank + 7 * (rank > 0)
    seed = 90_000
    for rnd in range(8):
        for count in (1, 3, 4, 5, 64, 257, 1024):
            seed += 1
            mine = _tokens(seed + 1000 * rank, count)  # this rank's own (ignored unless rank 0) values
            t = Tensor.from_numpy(mine, "cuda")
            comm.broadcast_tokens(t, offset)
            want = _tokens(seed, count) - np.int32(offset) if rank else mine
            if not np.array_equal(t.numpy(), want):
                problems.append(f"broadcast eager round {rnd} count {count}: differs from rank 0's tokens - offset")
            if rnd == 7:
                out[f"bcast{count}"] = (t.numpy() + np.int32(offset)).tobytes()  # the same bytes on every rank
    count, shape = 256, (1, 4096)
    tok = Tensor.empty((count,), int32, "cuda")
    x = Tensor.empty(shape, bfloat16, "cuda")
    tok.copy_(np.zeros(count, np.int32))
    x.copy_(np.zeros(shape, bfloat16))
    comm.broadcast_tokens(tok, offset)  # warm-up outside the capture
    comm.all_reduce(x)
    graph = CUDAGraph()
    with graph.capture():
        comm.all_reduce(x)
        comm.broadcast_tokens(tok, offset)
        comm.all_reduce(x)
    for rep in range(100):
        parts = _partials(95_000 + rep, world, shape)
        x.copy_(parts[rank])
        mine = _tokens(97_000 + rep + 1000 * rank, count)
        tok.copy_(mine)
        graph.replay()
        want = _tokens(97_000 + rep, count) - np.int32(offset) if rank else mine
        if not np.array_equal(tok.numpy(), want):
            problems.append(f"broadcast graph replay {rep}: differs from rank 0's tokens - offset")
        twice = reference_sum(np.stack([reference_sum(parts.reshape(world, -1))] * world))
        if not np.array_equal(x.numpy().reshape(-1).view(np.uint16), twice.view(np.uint16)):
            problems.append(f"broadcast graph replay {rep}: the all-reduces around it differ from NumPy")
    graph.close()


def _residual(seed: int, shape):
    return (np.random.default_rng(seed).standard_normal(shape) * 3 + 0.5).astype(np.float32)


def _check_add(comm, rank: int, world: int, out: dict, problems: list) -> None:
    """all_reduce_add (the kernel's residual-add epilogue) against reference_sum_add, bit for bit: eager, then in a
    CUDA graph interleaved with plain all-reduces (both kernels step the same epoch counters), as a decode step
    at tp > 1 does."""
    from xserv.parallel.ipc import reference_sum, reference_sum_add
    from xserv.runtime.graphs import CUDAGraph
    from xserv.tensor import Tensor, bfloat16, float32

    def compare(what, t, res, parts, residual):
        want_sum, want_res = reference_sum_add(parts.reshape(world, -1), residual.reshape(-1))
        got_sum, got_res = t.numpy().reshape(-1), res.numpy().reshape(-1)
        if not np.array_equal(got_sum.view(np.uint16), want_sum.view(np.uint16)):
            problems.append(f"{what}: all_reduce_add's sum differs from NumPy")
        if not np.array_equal(got_res.view(np.uint32), want_res.view(np.uint32)):
            problems.append(f"{what}: all_reduce_add's residual differs from NumPy")
        return got_res.tobytes()

    seed = 50_000
    for rnd in range(16):
        for shape in CHECK_SHAPES:
            seed += 1
            parts, residual = _partials(seed, world, shape), _residual(seed, shape)
            t, res = Tensor.from_numpy(parts[rank], "cuda"), Tensor.from_numpy(residual, "cuda")
            comm.all_reduce_add(t, res)
            got = compare(f"add eager round {rnd} {shape}", t, res, parts, residual)
            if rnd == 15:
                out[f"add-eager{shape}"] = got
    shape = (1, 4096)
    x, y = Tensor.empty(shape, bfloat16, "cuda"), Tensor.empty(shape, bfloat16, "cuda")
    res = Tensor.empty(shape, float32, "cuda")
    for a in (x, y):
        a.copy_(np.zeros(shape, bfloat16))
    res.copy_(np.zeros(shape, np.float32))
    comm.all_reduce_add(x, res)  # warm-up outside the capture
    comm.all_reduce(y)
    graph = CUDAGraph()
    with graph.capture():
        comm.all_reduce_add(x, res)
        comm.all_reduce(y)
        comm.all_reduce_add(x, res)
    for rep in range(100):
        px, py = _partials(70_000 + 2 * rep, world, shape), _partials(70_001 + 2 * rep, world, shape)
        residual = _residual(70_000 + rep, shape)
        x.copy_(px[rank])
        y.copy_(py[rank])
        res.copy_(residual)
        graph.replay()
        # the second add sums the first's output again: x holds the sum s, every rank pushes s, so 2 s (exact)
        s = reference_sum_add(px.reshape(world, -1), residual.reshape(-1))
        twice = np.stack([s[0]] * world)
        got = compare(f"add graph replay {rep}", x, res, twice, s[1])
        yv = y.numpy().reshape(-1)
        if not np.array_equal(yv.view(np.uint16), reference_sum(py.reshape(world, -1)).view(np.uint16)):
            problems.append(f"add graph replay {rep}: the plain all-reduce between the adds differs from NumPy")
        if rep == 99:
            out["add-graph"] = got
    graph.close()


def _bench(comm, rank: int, world: int) -> dict:
    from xserv.runtime import synchronize
    from xserv.runtime.graphs import CUDAGraph
    from xserv.runtime.pinned import Event
    from xserv.runtime import get_device
    from xserv.tensor import Tensor, bfloat16

    stream = get_device().stream_handle
    rows = {}
    calls = 200
    for shape in BENCH_SHAPES:
        x = Tensor.from_numpy(_partials(1, world, shape)[rank], "cuda")
        row = {"KiB": x.nbytes / 1024}
        for name, fn in (("ipc", comm.all_reduce), ("nccl", lambda t: _nccl(comm, t))):
            if name == "ipc" and x.numel > comm.ipc.layout.cap:
                continue
            for _ in range(20):
                fn(x)
            synchronize()
            a, b = Event(timing=True), Event(timing=True)
            a.record(stream)
            for _ in range(calls):
                fn(x)
            b.record(stream)
            b.synchronize()
            row[f"{name}_eager_us"] = a.elapsed_ms(b) * 1e3 / calls
            graph = CUDAGraph()
            with graph.capture():
                for _ in range(calls):
                    fn(x)
            graph.replay()
            synchronize()
            reps = []
            for _ in range(5):
                a.record(stream)
                graph.replay()
                b.record(stream)
                b.synchronize()
                reps.append(a.elapsed_ms(b) * 1e3 / calls)
            row[f"{name}_graph_us"] = float(np.median(reps))
            graph.close()
        rows[str(shape)] = row
    return rows


def run(what: str, world: int = 2, timeout: float = 300.0) -> dict:
    """Run `what` ("check" / "bench") on `world` GPUs; {rank: result}; RuntimeError naming a rank that failed."""
    from xserv.parallel.comm import nccl_unique_id

    ctx = mp.get_context("spawn")
    uid = nccl_unique_id()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, uid, what, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, kind, value = q.get(timeout=timeout)
            if kind != "ok":
                raise RuntimeError(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("check", "bench"))
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    results = run(args.what, args.world)
    if args.what == "bench":
        for shape, row in results[0].items():
            cells = "  ".join(f"{k} {v:6.2f}" for k, v in row.items())
            print(f"{shape} bf16, {args.world} ranks:  {cells}")
        return 0
    bad = 0
    for rank, res in sorted(results.items()):
        bad += res["count"]
        for p in res["problems"]:
            print(f"rank {rank}: {p}")
    ref = results[0]["bytes"]
    for rank, res in results.items():
        for key, data in res["bytes"].items():
            if data != ref[key]:
                bad += 1
                print(f"rank {rank}: {key} differs from rank 0's bits")
    print(f"{'FAIL' if bad else 'ok'}: {len(ref)} results compared across {args.world} ranks, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
