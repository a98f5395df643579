"""The one-shot IPC all-reduce (xserv/parallel/ipc.py, cuda_src/allreduce.cu).

CPU: the layout constants agree with the kernel source, the environment settings, which messages take the kernel
(and that the communicator routes the others to NCCL), the blocks' split of a message, and the kernel's push /
flag / epoch protocol simulated step by step in NumPy over the same layout, under random interleavings of ranks and
blocks, many calls: every call's sum is right on every rank, and the same protocol with one data half instead of
two fails (so the simulation can tell). The kernel compiles for every CI arch in tests/runtime/test_compile_all.py.
On 2 GPUs (marked gpu): tools/check_ipc_allreduce.py against NumPy and NCCL, eager and inside a CUDA graph, the same
bits on both ranks (and its residual-add epilogue, all_reduce_add); the TP=2 model's logits with it against
NCCL-only.
"""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from xserv.parallel import ipc
from xserv.parallel.ipc import (BLOCKS, MAX_BLOCKS, MAX_WORLD, THREADS, IpcAllReduce, IpcLayout, block_ranges,
                                max_bytes_from_env, mode_from_env, reference_sum, use_ipc)
from xserv.tensor import bfloat16

SOURCE = Path(__file__).resolve().parents[2] / "cuda_src" / "allreduce.cu"


def test_layout_constants_match_the_kernel():
    src = SOURCE.read_text()

    def const(name):
        return int(re.search(rf"constexpr (?:int|long long) {name} = (\d+);", src).group(1))

    assert (const("MAX_WORLD"), const("MAX_BLOCKS"), const("DATA_OFFSET")) == (MAX_WORLD, MAX_BLOCKS, ipc.DATA_OFFSET)
    assert int(re.search(r"__launch_bounds__\((\d+)\)", src).group(1)) == THREADS
    assert BLOCKS <= MAX_BLOCKS and THREADS >= MAX_WORLD  # one thread per peer signals / waits
    layout = IpcLayout(2, 8)
    assert layout.counters_offset == 2 * MAX_BLOCKS * MAX_WORLD * 4  # the kernel's FLAGS_BYTES
    assert layout.counters_offset + 4 * MAX_BLOCKS <= layout.data_offset
    assert layout.slot_offset(1, 1) == layout.data_offset + 2 * (2 * 8 + 8)
    assert layout.nbytes == layout.slot_offset(1, 1) + 2 * 8


def test_layout_rejects_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        IpcLayout(9, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        IpcLayout(2, 12)


def test_environment_settings():
    assert mode_from_env({}) == "auto"
    assert mode_from_env({ipc.ENV: "NCCL"}) == "nccl"
    with pytest.raises(ValueError, match="XSERV_TP_ALLREDUCE='ring'"):
        mode_from_env({ipc.ENV: "ring"})
    assert max_bytes_from_env({}) == ipc.IPC_MAX_BYTES == 64 << 10
    assert max_bytes_from_env({ipc.ENV_MAX_BYTES: "16384"}) == 16384
    for bad in ("lots", "8", str(1 << 30)):
        with pytest.raises(ValueError, match=ipc.ENV_MAX_BYTES):
            max_bytes_from_env({ipc.ENV_MAX_BYTES: bad})


def test_forcing_nccl_makes_no_buffer():
    def never(_):
        raise AssertionError("no exchange when the IPC path is off")

    assert IpcAllReduce.create(0, 2, never, mode="nccl") is None
    assert IpcAllReduce.create(0, MAX_WORLD + 1, never, mode="auto") is None


def test_ipc_handles_round_trip_through_bytes():
    """What the all-gather carries: a CUipcMemHandle's 64 bytes, and a handle rebuilt from them."""
    from cuda.bindings import driver

    from xserv.parallel.ipc import handle_from_bytes, handle_to_bytes

    data = bytes(np.random.default_rng(3).integers(0, 256, 64, dtype=np.uint8))
    handle = handle_from_bytes(data)
    assert isinstance(handle, driver.CUipcMemHandle)
    assert handle_to_bytes(handle) == data
    with pytest.raises(ValueError, match="64 bytes, not 63"):
        handle_from_bytes(data[:63])


def _message(shape, dtype=bfloat16, ptr=1 << 20, device="cuda"):
    numel = int(np.prod(shape))
    return SimpleNamespace(shape=shape, dtype=np.dtype(dtype), ptr=ptr, numel=numel, device=device,
                           nbytes=numel * np.dtype(dtype).itemsize)


def _fake_ipc(cap):
    return SimpleNamespace(layout=IpcLayout(2, cap), dtype=bfloat16)


def test_which_messages_take_the_kernel():
    fake = _fake_ipc(32768)  # 64 KB
    assert use_ipc(fake, _message((1, 4096)))
    assert use_ipc(fake, _message((8, 4096)))  # exactly the cap
    assert not use_ipc(fake, _message((9, 4096)))  # past it: NCCL
    assert not use_ipc(fake, _message((1, 4096), np.float32))
    assert not use_ipc(fake, _message((1, 4096), ptr=(1 << 20) + 8))  # a view not 16-byte aligned
    assert not use_ipc(fake, _message((0, 4096)))
    assert not use_ipc(None, _message((1, 4096)))


def test_the_communicator_routes_by_size():
    """NcclCommunicator.all_reduce: the small bf16 message to the IPC kernel, the rest to ncclAllReduce."""
    from xserv.parallel.comm import NcclCommunicator

    calls = []
    comm = object.__new__(NcclCommunicator)
    comm._raw = SimpleNamespace(all_reduce=lambda *a: calls.append(("nccl", a[2])))
    comm._handle, comm._stream = "handle", 0
    comm.ipc = SimpleNamespace(layout=IpcLayout(2, 32768), dtype=bfloat16,
                               all_reduce=lambda t: calls.append(("ipc", t.numel)))
    for shape in ((1, 4096), (16, 4096), (1, 5120)):
        comm.all_reduce(_message(shape))
    comm.all_reduce(_message((1, 4096), np.float32))
    assert calls == [("ipc", 4096), ("nccl", 65536), ("ipc", 5120), ("nccl", 4096)]
    comm.ipc = None
    comm.all_reduce(_message((1, 4096)))
    assert calls[-1] == ("nccl", 4096)


def test_all_reduce_add_takes_the_kernel_epilogue_or_nothing():
    """NcclCommunicator.adds_residual / all_reduce_add: the IPC kernel's residual-add epilogue for a message it takes;
    without the IPC path there is none (the model then keeps the unfused path). The launcher checks the residual
    before anything reaches the GPU."""
    from xserv.parallel.comm import NcclCommunicator
    from xserv.tensor import float32

    calls = []
    comm = object.__new__(NcclCommunicator)
    comm.ipc = SimpleNamespace(layout=IpcLayout(2, 32768), all_reduce_add=lambda t, r: calls.append((t.numel, r)))
    assert comm.adds_residual(4096) and comm.adds_residual(32768) and not comm.adds_residual(32769)
    comm.all_reduce_add(_message((1, 4096)), "residual")
    assert calls == [(4096, "residual")]
    comm.ipc = None
    assert not comm.adds_residual(4096)
    with pytest.raises(ValueError, match="needs the IPC all-reduce"):
        comm.all_reduce_add(_message((1, 4096)), "residual")

    fake = object.__new__(IpcAllReduce)
    fake.layout, fake.dtype = IpcLayout(2, 32768), bfloat16
    fake._add_kernel = lambda *a: calls.append("launched")
    for bad in (_message((1, 4096), bfloat16), _message((1, 2048), float32),
                _message((1, 4096), float32, ptr=8 + (1 << 20)), _message((1, 4096), float32, device="cpu")):
        with pytest.raises(ValueError, match="residual must be"):
            fake.all_reduce_add(_message((1, 4096)), bad)
    with pytest.raises(ValueError, match="not a 16-byte aligned bf16"):
        fake.all_reduce_add(_message((9, 4096)), _message((9, 4096), float32))
    assert "launched" not in calls


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 4096, 5120, 1003])
@pytest.mark.parametrize("blocks", [1, 3, BLOCKS])
def test_block_ranges_split_the_message_on_16_byte_chunks(n, blocks):
    ranges = block_ranges(n, blocks)
    assert len(ranges) == blocks
    covered = np.zeros(n, np.int32)
    for lo, hi in ranges:
        assert lo <= hi
        if lo < hi:  # a block past the last chunk has none (it still signals and waits)
            assert lo % 8 == 0 and (hi % 8 == 0 or hi == n)
        covered[lo:hi] += 1
    assert (covered == 1).all()


def test_reference_sum_is_float32_in_rank_order_one_rounding():
    parts = np.array([[1.0, 256.0], [2.0 ** -8, 1.0], [2.0 ** -8, 1.0]], np.float32).astype(bfloat16)
    got = reference_sum(parts).astype(np.float32)
    # 1 + 2^-8 + 2^-8 = 1 + 2^-7, exact in bf16; rounding after each add would give 1; 256 + 1 + 1 = 258
    assert got.tolist() == [1.0 + 2.0 ** -7, 258.0]


# ---- the protocol, simulated ---------------------------------------------------------------------------------------
class ProtocolError(AssertionError):
    pass


def simulate(world: int, sizes: list[int], blocks: int, seed: int, halves: int = 2, cap: int = 64) -> None:
    """Run the kernel's protocol (cuda_src/allreduce.cu steps 1-5) for len(sizes) calls on `world` ranks over NumPy
    buffers laid out as IpcLayout says. Each (rank, block) is a generator that yields after every chunk it pushes or
    sums and while it waits; a random scheduler interleaves them, a rank's call k + 1 starting once all its blocks of
    call k ended (stream order). Raises ProtocolError on a wrong sum or a deadlock. `halves`=1 is the broken variant
    with one data half (parity always 0)."""
    rng = np.random.default_rng(seed)
    layout = IpcLayout(world, cap)
    bufs = [np.zeros(layout.nbytes, np.uint8) for _ in range(world)]
    flags = [b[:layout.counters_offset].view(np.uint32) for b in bufs]
    counters = [b[layout.counters_offset:layout.counters_offset + 4 * MAX_BLOCKS].view(np.uint32) for b in bufs]
    parts = [(rng.standard_normal((world, n)) * 4 + 1).astype(bfloat16) for n in sizes]
    results = [[np.full(n, np.nan, np.float32).astype(bfloat16) for n in sizes] for _ in range(world)]

    def slot(r, parity, src, n):
        off = layout.slot_offset(parity, src)
        return bufs[r][off:off + 2 * n].view(bfloat16)

    def block(r, b, k):
        n = sizes[k]
        epoch = int(counters[r][b]) + 1
        p = epoch % 2 if halves == 2 else 0
        lo, hi = block_ranges(n, blocks)[b]
        for c in range(lo, hi, 8):  # 1. push this chunk into slot r of every rank
            for q in range(world):
                slot(q, p, r, n)[c:min(c + 8, hi)] = parts[k][r, c:min(c + 8, hi)]
                yield "run"
        for q in range(world):  # 2. signal
            flags[q][layout.flag_index(p, b, r)] = epoch
            yield "run"
        for q in range(world):  # 3. wait
            while flags[r][layout.flag_index(p, b, q)] != epoch:
                yield "wait"
        for c in range(lo, hi, 8):  # 4. sum in rank order
            c1 = min(c + 8, hi)
            results[r][k][c:c1] = reference_sum(np.stack([slot(r, p, q, n)[c:c1] for q in range(world)]))
            yield "run"
        counters[r][b] = epoch  # 5.

    call = [0] * world
    running = [[block(r, b, 0) for b in range(blocks)] for r in range(world)]
    speed = rng.uniform(0.05, 1.0, world)  # some ranks run far ahead of others, as far as the flags let them
    idle = 0
    while any(running):
        live = [r for r in range(world) if running[r]]
        weights = speed[live] / speed[live].sum()
        r = live[rng.choice(len(live), p=weights)]
        gen = running[r][rng.integers(len(running[r]))]
        try:
            state = next(gen)
        except StopIteration:
            running[r].remove(gen)
            state = "run"
            if not running[r] and call[r] + 1 < len(sizes):
                call[r] += 1
                running[r] = [block(r, b, call[r]) for b in range(blocks)]
        idle = idle + 1 if state == "wait" else 0
        if idle > 20000:
            raise ProtocolError(f"deadlock: calls reached {call}")
    for k, n in enumerate(sizes):
        want = reference_sum(parts[k])
        for r in range(world):
            if not np.array_equal(results[r][k].view(np.uint16), want.view(np.uint16)):
                raise ProtocolError(f"rank {r} call {k}: wrong sum")


@pytest.mark.parametrize("world, blocks", [(2, 1), (2, 3), (3, 4), (4, 2)])
def test_protocol_sums_every_call_right_under_random_interleavings(world, blocks):
    rng = np.random.default_rng(world * 10 + blocks)
    for seed in range(6):
        sizes = [int(s) for s in rng.integers(1, 65, 24)]  # many epochs: each half and flag reused 12 times
        simulate(world, sizes, blocks, seed=seed)


def test_protocol_with_one_data_half_fails():
    """The second half is what lets a rank that runs ahead push call k + 1 while a slower peer still sums call k:
    the simulation catches the one-half variant (a wrong sum, or a flag overwritten before it was seen)."""
    failures = 0
    for seed in range(8):
        try:
            simulate(2, [64] * 12, 2, seed=seed, halves=1)
        except ProtocolError:
            failures += 1
    assert failures > 0


# ---- 2 GPUs ---------------------------------------------------------------------------------------------------------
def _gpu_count() -> int:
    try:
        from xserv.runtime import device_count

        return device_count()
    except Exception:
        return 0


two_gpus = pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@two_gpus
def test_ipc_all_reduce_matches_numpy_and_nccl_on_two_gpus():
    from tools.check_ipc_allreduce import run

    results = run("check", 2)
    for rank, res in results.items():
        assert res["count"] == 0, (rank, res["problems"])
    assert results[0]["bytes"] == results[1]["bytes"]  # the same bits on both ranks, eager and graph
