"""The one-shot all-reduce of small bf16 messages over CUDA IPC peer memory (cuda_src/allreduce.cu), on top of NCCL.

A decode step of a tensor-parallel model all-reduces one [rows, hidden] bf16 activation 2 x layers + 1 times; at
batch 1 that is 8 to 10 KB, where NCCL's ring costs 6.6-7.3 us per call inside a CUDA graph on two NVLinked H100s
(docs/engine.md). The one-shot kernel does the whole collective in one launch: every rank pushes its partial into
every rank's buffer (posted NVLink writes), raises one flag per peer (release), waits for the peers' flags
(acquire) and sums the partials in rank order in float32 (the same bits on every rank). NCCL stays the path for
larger messages and the reference in the tests.

Setup (`IpcAllReduce.create`, called by every rank's NcclCommunicator while the group starts, collectively): each
rank cuMemAllocs one buffer (IpcLayout: flags, private epoch counters, 2 x world x cap bf16 of data), zeroes it,
exports it with cuIpcGetMemHandle; the handles, device ordinals and a "can this rank access every peer"
bit go through one NCCL all-gather (the communicator every rank already joined: no extra channel), so every rank
takes the same decision; then each rank opens its peers' buffers (cuIpcOpenMemHandle with lazy peer access) and
keeps the [world] table of base addresses in device memory for the kernel. Where any pair of GPUs lacks peer access,
or XSERV_TP_ALLREDUCE=nccl, no buffer is made and every all-reduce stays on NCCL.

Selection (`use_ipc`): bf16, contiguous, 16-byte aligned, at most `cap` elements (IPC_MAX_BYTES). The choice depends
only on the message (the same on every rank), so all ranks take the same path for the same call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import settings

ENV = settings.TP_ALLREDUCE.name  # "auto" (default): the IPC kernel for small messages where peers can; "nccl"
ENV_MAX_BYTES = settings.TP_IPC_MAX_BYTES.name  # the largest message (bytes) the IPC kernel takes
# [8, 4096] or [6, 5120] bf16: decode steps of up to 8 rows at the 8B / 32B widths
IPC_MAX_BYTES = settings.TP_IPC_MAX_BYTES.default
# cuda_src/allreduce.cu's constants (tests/parallel/test_ipc_allreduce.py reads them back from the source)
MAX_WORLD = 8
MAX_BLOCKS = 32
DATA_OFFSET = 4096
BLOCKS = 8  # the fixed grid of every launch (every block of every call signals and waits: the epochs stay equal)
THREADS = 512
_HANDLE_BYTES = 64  # CUipcMemHandle
_RECORD_BYTES = 128  # one rank's all-gathered record: handle, device ordinal (int32), peer-access bit (int32)


def mode_from_env(environ=None) -> str:
    return settings.TP_ALLREDUCE.get(environ)


def max_bytes_from_env(environ=None) -> int:
    return settings.TP_IPC_MAX_BYTES.get(environ)


@dataclass(frozen=True)
class IpcLayout:
    """One rank's IPC buffer: flags uint32 [2][MAX_BLOCKS][MAX_WORLD] (written by the peers), counters uint32
    [MAX_BLOCKS] (this rank's epochs, private), then from DATA_OFFSET the data bf16 [2][world][cap]."""

    world: int
    cap: int  # elements of one rank's slot

    def __post_init__(self):
        if not 2 <= self.world <= MAX_WORLD:
            raise ValueError(f"the IPC all-reduce takes 2 to {MAX_WORLD} ranks, not {self.world}")
        if self.cap <= 0 or self.cap % 8:
            raise ValueError(f"cap {self.cap}: expected a positive multiple of 8 elements (16-byte slots)")

    flags_offset = 0
    counters_offset = 2 * MAX_BLOCKS * MAX_WORLD * 4
    data_offset = DATA_OFFSET

    def flag_index(self, parity: int, block: int, src: int) -> int:
        """The uint32 index of flags[parity][block][src] from the buffer's start."""
        return (parity * MAX_BLOCKS + block) * MAX_WORLD + src

    def slot_offset(self, parity: int, src: int) -> int:
        """The byte offset of data[parity][src] from the buffer's start."""
        return self.data_offset + 2 * (parity * self.world * self.cap + src * self.cap)

    @property
    def nbytes(self) -> int:
        return self.data_offset + 2 * 2 * self.world * self.cap


def use_ipc(ipc, t) -> bool:
    """Does all-reduce of Tensor `t` take the IPC kernel (`ipc`: the rank's IpcAllReduce or None)? Depends only on
    the message, so every rank answers the same for the same call."""
    if ipc is None:
        return False
    return (t.device == "cuda" and np.dtype(t.dtype) == np.dtype(ipc.dtype) and t.ptr % 16 == 0
            and 0 < t.numel <= ipc.layout.cap)  # a Tensor is always contiguous


def block_ranges(n: int, blocks: int = BLOCKS) -> list[tuple[int, int]]:
    """The element range [start, stop) each block of the kernel sums (its 8-element chunks, as the kernel splits
    them); a block may have none (it still signals and waits)."""
    chunks = -(-n // 8)
    per = -(-chunks // blocks)
    out = []
    for b in range(blocks):
        c0, c1 = b * per, min(chunks, b * per + per)
        out.append((min(c0 * 8, n), min(max(c1, c0) * 8, n)))
    return out


def reference_sum(parts: np.ndarray) -> np.ndarray:
    """The kernel's result from every rank's partial [world, n] (bf16): float32 sums in rank order, one rounding."""
    from ..tensor import bfloat16

    acc = parts[0].astype(np.float32)
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].astype(np.float32)
    return acc.astype(bfloat16)


def reference_sum_add(parts: np.ndarray, residual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """allreduce_oneshot_add_bf16's results: the rounded sum (reference_sum) and residual (float32) + that sum."""
    total = reference_sum(parts)
    return total, residual.astype(np.float32) + total.astype(np.float32)


class IpcAllReduce:
    """This rank's side of the IPC all-reduce: its buffer, the peers' buffers opened, the kernel (module doc)."""

    def __init__(self, rank: int, world: int, cap: int, own: int, opened: list[int], bases, abort_word, kernel,
                 add_kernel=None, broadcast_kernel=None):
        from ..tensor import bfloat16

        self.rank, self.world = rank, world
        self.layout = IpcLayout(world, cap)
        self.dtype = bfloat16
        self._own, self._opened = own, opened  # cuMemAlloc'd buffer; peers' mapped bases (cuIpcCloseMemHandle)
        self._bases = bases  # Tensor uint64 [world]
        self._abort = abort_word  # PinnedArray uint32 [1], host-mapped
        self._abort_dev = _mapped_pointer(abort_word.ptr)
        self._kernel = kernel
        self._add_kernel = add_kernel  # the same, then residual += the sum (all_reduce_add)
        self._broadcast_kernel = broadcast_kernel  # rank 0's int32 tokens to every rank (broadcast_tokens)
        self._rank32, self._world32 = np.int32(rank), np.int32(world)
        self._cap64 = np.int64(cap)

    @classmethod
    def create(cls, rank: int, world: int, all_gather_bytes, *, max_bytes: int | None = None,
               mode: str | None = None):
        """Collective: every rank calls it at the same point. all_gather_bytes(record: bytes) -> [world] records
        (NcclCommunicator: an NCCL all-gather). None on every rank where the IPC path is off (XSERV_TP_ALLREDUCE=nccl,
        a pair without peer access, more than MAX_WORLD ranks)."""
        from cuda.bindings import driver

        from ..runtime import get_device, kernel
        from ..runtime.errors import check_driver
        from ..runtime.pinned import PinnedArray
        from ..tensor import Tensor

        mode = mode_from_env() if mode is None else mode
        if mode == "nccl" or world > MAX_WORLD:
            return None  # the same on every rank (the environment is inherited by the spawned workers)
        max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        layout = IpcLayout(world, max(8, max_bytes // 2 // 8 * 8))
        device = get_device()
        ordinal = device.info.index
        own, handle = 0, b""
        try:
            own = int(check_driver(driver.cuMemAlloc(layout.nbytes), "cuMemAlloc (IPC all-reduce buffer)"))
            # zero flags and counters: epochs start at 1 on every rank; synchronised before any peer can write
            check_driver(driver.cuMemsetD8(own, 0, layout.nbytes), "cuMemsetD8")
            handle = handle_to_bytes(check_driver(driver.cuIpcGetMemHandle(own), "cuIpcGetMemHandle"))
            ok = 1
        except Exception:
            ok = 0  # this rank cannot export (e.g. the driver has no IPC here): every rank falls back
        record = np.zeros(_RECORD_BYTES, np.uint8)
        record[:len(handle)] = np.frombuffer(handle, np.uint8)[:_HANDLE_BYTES]
        record[_HANDLE_BYTES:_HANDLE_BYTES + 8].view(np.int32)[:] = (ordinal, ok)
        records = np.frombuffer(all_gather_bytes(record.tobytes()), np.uint8).reshape(world, _RECORD_BYTES)
        meta = records[:, _HANDLE_BYTES:_HANDLE_BYTES + 8].copy().view(np.int32)  # [world, 2]: ordinal, ok
        # this rank's peer access; gathered once more so that every rank decides on every pair
        can = int(all(meta[q, 1] for q in range(world)) and all(
            q == rank or check_driver(driver.cuDeviceCanAccessPeer(driver.CUdevice(ordinal), driver.CUdevice(int(meta[q, 0]))),
                                      "cuDeviceCanAccessPeer")
            for q in range(world)))
        flags = np.frombuffer(all_gather_bytes(np.full(_RECORD_BYTES, can, np.uint8).tobytes()), np.uint8)
        if not flags.reshape(world, _RECORD_BYTES)[:, 0].all():
            if own:
                driver.cuMemFree(own)
            return None
        opened: list[int] = []
        try:
            bases = []
            for q in range(world):
                if q == rank:
                    bases.append(own)
                    continue
                h = handle_from_bytes(bytes(records[q, :_HANDLE_BYTES]))
                flag = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                ptr = int(check_driver(driver.cuIpcOpenMemHandle(h, flag), f"cuIpcOpenMemHandle (rank {q}'s buffer)"))
                opened.append(ptr)
                bases.append(ptr)
            table = Tensor.from_numpy(np.array(bases, np.uint64).view(np.int64), "cuda")  # [world] addresses
            abort_word = PinnedArray((1,), np.uint32)
            abort_word.array[0] = 0
            device.synchronize()  # the zeroed buffer and the table are in place before the first launch
            return cls(rank, world, layout.cap, own, opened, table, abort_word,
                       kernel("allreduce", "allreduce_oneshot_bf16"), kernel("allreduce", "allreduce_oneshot_add_bf16"),
                       kernel("allreduce", "ipc_broadcast_tokens"))
        except BaseException:
            for ptr in opened:
                driver.cuIpcCloseMemHandle(ptr)
            driver.cuMemFree(own)
            raise

    def all_reduce(self, t, out=None):
        """Sum `t` (bf16, contiguous, 16-byte aligned, at most cap elements: use_ipc) over the ranks into `out`
        (default: in place); launched on xserv's stream, capturable in a CUDA graph."""
        if not use_ipc(self, t):
            raise ValueError(f"IPC all-reduce: {t.shape} {np.dtype(t.dtype).name} is not a 16-byte aligned bf16 "
                             f"CUDA message of at most {self.layout.cap} elements")
        out = t if out is None else out
        if out.numel != t.numel or np.dtype(out.dtype) != np.dtype(t.dtype) or out.ptr % 16:
            raise ValueError("IPC all-reduce: out must be bf16, 16-byte aligned and as large as the input")
        self._kernel(BLOCKS, THREADS, t, out, self._bases, self._abort_dev, self._rank32, self._world32,
                     np.int64(t.numel), self._cap64, pdl=True)
        return out

    def all_reduce_add(self, t, residual):
        """all_reduce(t) in place, then residual (float32, the same element count) += the bf16 sum, in the same
        launch (the tensor-parallel fused one-token path's residual add: reference_sum_add)."""
        from ..tensor import float32

        if not use_ipc(self, t):
            raise ValueError(f"IPC all-reduce: {t.shape} {np.dtype(t.dtype).name} is not a 16-byte aligned bf16 "
                             f"CUDA message of at most {self.layout.cap} elements")
        if (residual.device != "cuda" or np.dtype(residual.dtype) != np.dtype(float32) or residual.numel != t.numel
                or residual.ptr % 16):
            raise ValueError(f"IPC all-reduce: residual must be a 16-byte aligned float32 CUDA tensor of {t.numel} "
                             f"elements, got {residual.shape} {np.dtype(residual.dtype).name}")
        self._add_kernel(BLOCKS, THREADS, t, t, residual, self._bases, self._abort_dev, self._rank32, self._world32,
                         np.int64(t.numel), self._cap64, pdl=True)
        return residual

    def can_broadcast_tokens(self, count: int) -> bool:
        """Does a broadcast of `count` int32 tokens fit one rank's slot (2 bf16 elements a token)?"""
        return self._broadcast_kernel is not None and 2 * count <= self.layout.cap

    def broadcast_tokens(self, tokens, offset: int = 0):
        """Every rank's `tokens` (int32 [count], contiguous, 16-byte aligned; the same count on every rank) becomes
        rank 0's, minus `offset` on this rank; launched on xserv's stream, capturable in a CUDA graph."""
        from ..tensor import int32

        if (tokens.device != "cuda" or np.dtype(tokens.dtype) != np.dtype(int32) or tokens.ptr % 16
                or not self.can_broadcast_tokens(tokens.numel)):
            raise ValueError(f"IPC token broadcast: {tokens.shape} {np.dtype(tokens.dtype).name} is not a 16-byte "
                             f"aligned int32 CUDA tensor of at most {self.layout.cap // 2} tokens")
        self._broadcast_kernel(BLOCKS, THREADS, tokens, self._bases, self._abort_dev, self._rank32, self._world32,
                               np.int64(tokens.numel), self._cap64, np.int32(offset), pdl=True)
        return tokens

    def abort(self) -> None:
        """A peer died: the kernel's waits end at their next poll of the host-mapped word (results are garbage)."""
        if self._abort is not None:
            self._abort.array[0] = 1

    def close(self) -> None:
        from cuda.bindings import driver

        for ptr in self._opened:
            try:
                driver.cuIpcCloseMemHandle(ptr)
            except Exception:
                pass
        self._opened = []
        if self._own:
            try:
                driver.cuMemFree(self._own)
            except Exception:
                pass
            self._own = 0
        self._bases = None


def handle_to_bytes(handle) -> bytes:
    """The 64 bytes of a CUipcMemHandle (cuda-python 13 exposes no `reserved` field: read them at getPtr())."""
    import ctypes

    return ctypes.string_at(handle.getPtr(), _HANDLE_BYTES)


def handle_from_bytes(data: bytes):
    """A CUipcMemHandle holding `data` (64 bytes another process exported)."""
    import ctypes

    from cuda.bindings import driver

    if len(data) != _HANDLE_BYTES:
        raise ValueError(f"an IPC memory handle is {_HANDLE_BYTES} bytes, not {len(data)}")
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), data, _HANDLE_BYTES)
    return handle


def _mapped_pointer(host_ptr: int) -> int:
    """The device address of pinned host memory (cuMemHostAlloc; with unified addressing, the same number)."""
    from cuda.bindings import driver

    from ..runtime.errors import check_driver

    return int(check_driver(driver.cuMemHostGetDevicePointer(host_ptr, 0), "cuMemHostGetDevicePointer"))


__all__ = ["ENV", "ENV_MAX_BYTES", "IPC_MAX_BYTES", "IpcAllReduce", "IpcLayout", "block_ranges", "handle_from_bytes",
           "handle_to_bytes", "mode_from_env",
           "max_bytes_from_env", "reference_sum", "use_ipc"]
