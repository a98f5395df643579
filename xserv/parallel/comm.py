"""The collectives of a tensor-parallel group, as the model calls them (`DenseModel.comm`; None at tp 1).

A Communicator joins its rank to the others at the row-parallel outputs: `all_reduce(t)` sums a bf16 [rows, H]
activation over the ranks in place (after the vocab-parallel embedding, each o projection, each MLP / MoE block),
and `gather_logits(part, out)` gathers each rank's vocab-parallel logits [rows, vocab_part] into the full
[rows, vocab_size] on every rank (the padding columns past vocab_size cut off; only rank 0's sampler reads them).
Every rank calls the same collectives in the same order; the results are the same bits on every rank (the MoE
router, replicated, then routes every token identically).

Two implementations with one interface:
- NcclCommunicator (CUDA): nccl4py's raw bindings (ncclAllReduce / ncclAllGather) on xserv's own stream and raw
  device pointers, so they are captured inside the decode CUDA graphs like any kernel. (nccl4py's high-level
  Communicator.allreduce inferred the wrong device for a __cuda_array_interface__ buffer on rank 1: not used.)
  A bf16 message of at most 64 KB (a decode step's rows) takes the one-shot IPC kernel instead where every pair of
  GPUs has peer access (xserv/parallel/ipc.py; XSERV_TP_ALLREDUCE=nccl keeps everything on NCCL).
- ShmCommunicator (CPU backend): a shared-memory segment of one slot per rank, twice (calls alternate, so one
  barrier per collective suffices), summed in float32 in rank order on every rank. It exists so that CI runs the
  whole tensor-parallel engine, collectives included, without a GPU.
"""
from __future__ import annotations

import time

import numpy as np

from ..tensor import Tensor, bfloat16, float32
from .ipc import use_ipc

SHM_SLOT_BYTES = 4 << 20  # ShmCommunicator: bytes of one rank's slot (a larger message goes in pieces)
_SHM_HEADER = 4096  # counters: one int64 per rank at 64-byte strides, the abort flag after them


class CollectiveAborted(RuntimeError):
    """A collective could not finish: another rank of the group failed (the group says which)."""


class Communicator:
    """The interface the model uses; `rank`, `world_size`, and the vocab split (`vocab_part` rows per rank,
    `vocab_size` real columns)."""

    def __init__(self, rank: int, world_size: int, vocab_part: int, vocab_size: int, device: str):
        self.rank, self.world_size = rank, world_size
        self.vocab_part, self.vocab_size = vocab_part, vocab_size
        self.device = device
        self._parts: Tensor | None = None  # [rows, vocab_part] float32: this rank's logits
        self._gathered: Tensor | None = None  # [world, rows, vocab_part] float32
        self._keep: list[Tensor] = []  # outgrown buffers: a captured CUDA graph may still point into them

    def all_reduce(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    def gather_logits(self, part: Tensor, out: Tensor) -> Tensor:
        raise NotImplementedError

    def adds_residual(self, numel: int) -> bool:
        """Can all_reduce_add take a bf16 message of numel elements (the same answer on every rank)? The fused
        one-token path runs at tp > 1 only where it can."""
        return False

    def all_reduce_add(self, t: Tensor, residual: Tensor) -> Tensor:
        """all_reduce(t) in place, then residual (float32, as many elements) += the bf16 sum: the row-parallel
        output's all-reduce and the residual add of the fused one-token path (ipc.reference_sum_add)."""
        raise NotImplementedError

    def can_broadcast_tokens(self, count: int) -> bool:
        """Can broadcast_tokens take `count` tokens (the same answer on every rank)? A decode step is launched ahead
        of the previous step's booking at tp > 1 only where it can (xserv/engine/model_runner.py)."""
        return False

    def broadcast_tokens(self, tokens: Tensor, offset: int) -> Tensor:
        """Every rank's int32 `tokens` becomes rank 0's, minus `offset` on this rank (its first vocab-parallel token
        id): rank 0's sampled tokens, on the device of every rank, for a step launched ahead."""
        raise NotImplementedError

    def logits_part(self, rows: int) -> Tensor:
        """A [rows, vocab_part] float32 buffer for this rank's lm_head output (kept: stable across steps, so a
        CUDA graph may capture it; a larger request allocates a larger one and keeps the old alive)."""
        if self._parts is None or self._parts.shape[0] < rows:
            if self._parts is not None:
                self._keep += [self._parts, self._gathered]
            cap = max(rows, 1)
            self._parts = Tensor.empty((cap, self.vocab_part), float32, self.device)
            self._gathered = Tensor.empty((self.world_size, cap, self.vocab_part), float32, self.device)
        return self._parts[:rows]

    def close(self) -> None:
        self._parts = self._gathered = None
        self._keep.clear()

    def abort(self) -> None:
        """Another rank failed: stop waiting for it (pending collectives end with garbage, or raise)."""


# ---- CPU: shared memory -------------------------------------------------------------------------------------------
class ShmCommunicator(Communicator):
    """Collectives through one shared-memory segment (multiprocessing.shared_memory, created by rank 0's group):
    a header of per-rank arrival counters and an abort flag, then 2 x world_size slots of SHM_SLOT_BYTES. A
    collective writes this rank's piece into its slot of buffer (call number % 2), waits at a barrier (every
    rank's counter reaches the call number), and reads every slot. Buffer (k % 2) is written again only at call
    k + 2, after every rank passed call k + 1's barrier, i.e. finished reading call k. `check()` is called while
    waiting (about every 50 ms) and raises when the group has failed."""

    def __init__(self, shm_name: str, rank: int, world_size: int, vocab_part: int, vocab_size: int, check=None):
        from multiprocessing import shared_memory

        super().__init__(rank, world_size, vocab_part, vocab_size, "cpu")
        self._shm = shared_memory.SharedMemory(name=shm_name)
        buf = self._shm.buf
        self._counters = np.ndarray((world_size,), np.int64, buf, 0, (64,))
        self._abort = np.ndarray((1,), np.int64, buf, 64 * world_size)
        self._slots = np.ndarray((2, world_size, SHM_SLOT_BYTES), np.uint8, buf, _SHM_HEADER)
        self._calls = 0
        self._check = check

    @staticmethod
    def segment_bytes(world_size: int) -> int:
        return _SHM_HEADER + 2 * world_size * SHM_SLOT_BYTES

    def abort(self) -> None:
        if self._abort is not None:
            self._abort[0] = 1

    def _barrier(self) -> None:
        self._calls += 1
        n = self._calls
        self._counters[self.rank] = n
        spins, last = 0, time.monotonic()
        while self._counters.min() < n:
            spins += 1
            if spins < 100:
                continue
            time.sleep(1e-5 if spins < 1000 else 2e-4)
            now = time.monotonic()
            if now - last > 0.05:
                last = now
                if self._check is not None:  # rank 0: the group's failure, naming the rank
                    self._check()
                if self._abort[0]:
                    raise CollectiveAborted("a tensor-parallel collective was aborted: another rank failed")

    def _exchange(self, flat: np.ndarray, read) -> None:
        """Every rank's bytes `flat` (the same length on every rank), piece by piece: read(start, pieces) gets, per
        piece, a [world, nbytes] view of all ranks' bytes at byte offset `start`."""
        total = flat.nbytes
        raw = flat.view(np.uint8)
        for start in range(0, max(total, 1), SHM_SLOT_BYTES):
            stop = min(start + SHM_SLOT_BYTES, total)
            slots = self._slots[self._calls % 2]
            slots[self.rank, :stop - start] = raw[start:stop]
            self._barrier()
            read(start, slots[:, :stop - start])

    def all_reduce(self, t: Tensor) -> Tensor:
        arr = t.array
        if not arr.flags.c_contiguous:
            raise ValueError("all_reduce: the tensor must be contiguous")
        flat = arr.reshape(-1)
        item = arr.dtype.itemsize

        def read(start, pieces):
            parts = pieces.view(arr.dtype)  # [world, elements]
            acc = parts[0].astype(np.float32)
            for r in range(1, self.world_size):
                acc += parts[r].astype(np.float32)
            flat[start // item:start // item + parts.shape[1]] = acc.astype(arr.dtype)

        self._exchange(flat.copy(), read)
        return t

    def adds_residual(self, numel: int) -> bool:
        return True

    def all_reduce_add(self, t: Tensor, residual: Tensor) -> Tensor:
        if residual.shape != t.shape or np.dtype(residual.dtype) != np.dtype(float32):
            raise ValueError(f"all_reduce_add: residual must be float32 {t.shape}, got {residual.shape} "
                             f"{np.dtype(residual.dtype).name}")
        self.all_reduce(t)
        residual.array[...] += t.array.astype(np.float32)
        return residual

    def can_broadcast_tokens(self, count: int) -> bool:
        return True

    def broadcast_tokens(self, tokens: Tensor, offset: int) -> Tensor:
        flat = tokens.array.reshape(-1)

        def read(start, pieces):
            if self.rank != 0:
                root = pieces[0].view(np.int32)
                flat[start // 4:start // 4 + root.shape[0]] = root - np.int32(offset)

        self._exchange(flat.copy(), read)
        return tokens

    def gather_logits(self, part: Tensor, out: Tensor) -> Tensor:
        rows, p = part.shape
        gathered = self._gathered.array.reshape(-1)[:self.world_size * rows * p].reshape(self.world_size, rows * p)
        gathered_bytes = gathered.view(np.uint8)

        def read(start, pieces):
            gathered_bytes[:, start:start + pieces.shape[1]] = pieces

        self._exchange(np.ascontiguousarray(part.array).reshape(-1), read)
        _assemble_cpu(gathered.reshape(self.world_size, rows, p), out.array, self.vocab_size)
        return out

    def close(self) -> None:
        super().close()
        if self._shm is not None:
            self._counters = self._abort = self._slots = None
            self._shm.close()
            self._shm = None


def _assemble_cpu(gathered: np.ndarray, out: np.ndarray, vocab_size: int) -> None:
    world, _, p = gathered.shape
    for r in range(world):
        c0, c1 = r * p, min((r + 1) * p, vocab_size)
        if c1 > c0:
            out[:, c0:c1] = gathered[r, :, :c1 - c0]


# ---- CUDA: NCCL -------------------------------------------------------------------------------------------------
_NCCL_SUM = 0
_NCCL_UINT8 = 1
_NCCL_DTYPES = {np.dtype(bfloat16): 9, np.dtype(np.float32): 7, np.dtype(np.float16): 6}


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (rank 0 makes it; every rank initialises its communicator with its bytes)."""
    try:
        from nccl.core import get_unique_id
    except ImportError as e:
        raise RuntimeError(f"tensor_parallel_size > 1 on CUDA needs nccl4py and libnccl: pip install 'xserv[multi-gpu]' "
                           f"({e})") from None
    return bytes(get_unique_id())


class NcclCommunicator(Communicator):
    """NCCL collectives on xserv's stream of this process's device (every rank binds its own GPU first)."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, vocab_part: int, vocab_size: int):
        from cuda.bindings import driver
        from nccl.bindings import nccl as nccl_raw
        from nccl.core import Communicator as NcclComm
        from nccl.core import UniqueId

        from ..runtime import get_device

        super().__init__(rank, world_size, vocab_part, vocab_size, "cuda")
        self.ipc = None
        self._driver, self._raw = driver, nccl_raw
        self._nccl = NcclComm.init(world_size, rank, UniqueId.from_bytes(unique_id))
        self._handle = self._nccl._comm
        self._stream = get_device().stream_handle
        from .ipc import IpcAllReduce

        self.ipc = IpcAllReduce.create(rank, world_size, self._all_gather_bytes)  # None: NCCL for every all-reduce

    def _all_gather_bytes(self, record: bytes) -> bytes:
        """Every rank's `record` (the same length on every rank), rank order, through NCCL (setup only: synchronous)."""
        n = len(record)
        send = Tensor.from_numpy(np.frombuffer(record, np.uint8), "cuda")
        recv = Tensor.empty((self.world_size * n,), np.uint8, "cuda")
        self._raw.all_gather(send.ptr, recv.ptr, n, _NCCL_UINT8, self._handle, self._stream)
        return recv.numpy().tobytes()  # synchronises xserv's stream

    def all_reduce(self, t: Tensor) -> Tensor:
        ipc = self.ipc
        if ipc is not None and use_ipc(ipc, t):
            return ipc.all_reduce(t)
        self._raw.all_reduce(t.ptr, t.ptr, t.numel, _NCCL_DTYPES[np.dtype(t.dtype)], _NCCL_SUM, self._handle,
                             self._stream)
        return t

    def adds_residual(self, numel: int) -> bool:
        return self.ipc is not None and 0 < numel <= self.ipc.layout.cap  # the IPC kernel's epilogue; NCCL has none

    def all_reduce_add(self, t: Tensor, residual: Tensor) -> Tensor:
        if self.ipc is None:
            raise ValueError("all_reduce_add: needs the IPC all-reduce (XSERV_TP_ALLREDUCE=nccl turns it off)")
        return self.ipc.all_reduce_add(t, residual)

    def can_broadcast_tokens(self, count: int) -> bool:
        return self.ipc is not None and self.ipc.can_broadcast_tokens(count)  # (NCCL only: no step launched ahead)

    def broadcast_tokens(self, tokens: Tensor, offset: int) -> Tensor:
        if self.ipc is None:
            raise ValueError("broadcast_tokens: needs the IPC kernels (XSERV_TP_ALLREDUCE=nccl turns them off)")
        return self.ipc.broadcast_tokens(tokens, offset)

    def gather_logits(self, part: Tensor, out: Tensor) -> Tensor:
        rows, p = part.shape
        world, v = self.world_size, self.vocab_size
        if rows == 1 and world * p == v:  # one row, no padding: the gathered row is the output row
            self._raw.all_gather(part.ptr, out.ptr, part.numel, _NCCL_DTYPES[np.dtype(float32)], self._handle,
                                 self._stream)
            return out
        base = self._gathered.ptr  # [world, rows, p] packed at the buffer's start
        self._raw.all_gather(part.ptr, base, part.numel, _NCCL_DTYPES[np.dtype(float32)], self._handle,
                             self._stream)
        d = self._driver
        from ..runtime.errors import check_driver

        for r in range(world):
            c0, c1 = r * p, min((r + 1) * p, v)
            if c1 <= c0:
                continue
            m = d.CUDA_MEMCPY2D()
            m.srcMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            m.srcDevice = base + r * rows * p * 4
            m.srcPitch = p * 4
            m.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            m.dstDevice = out.ptr + c0 * 4
            m.dstPitch = out.shape[1] * 4
            m.WidthInBytes = (c1 - c0) * 4
            m.Height = rows
            check_driver(d.cuMemcpy2DAsync(m, self._stream), "cuMemcpy2DAsync")
        return out

    def abort(self) -> None:
        if self.ipc is not None:  # a one-shot kernel waiting for the dead rank's flag returns
            self.ipc.abort()
        comm, self._handle = self._handle, None
        if comm is not None:
            try:
                self._raw.comm_abort(comm)
            except Exception:
                pass

    def close(self) -> None:
        super().close()
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None
        if self._nccl is not None and self._handle is not None:
            try:
                self._nccl.destroy()
            except Exception:
                pass
        self._nccl = self._handle = None


__all__ = ["CollectiveAborted", "Communicator", "NcclCommunicator", "ShmCommunicator", "nccl_unique_id"]
