"""Rank 0's step messages to the workers of a tensor-parallel group, through one shared-memory segment.

The segment holds the latest message: a small pickled header (the command, its integer arguments, each array's dtype /
shape / offset) and the arrays' raw bytes (token ids, positions, slot mapping, block tables, a decode graph's metadata
image): NumPy arrays copied in, never pickled tensors. Rank 0 writes a message once every worker has taken the
previous one (their ack counters), bumps the sequence number and posts each worker's wake-up semaphore; a worker
spins on the sequence number for a while after each message (CUDA; a decode step's next message comes within
milliseconds) and otherwise sleeps on its semaphore. (A semaphore, not a multiprocessing Event: an Event's set()
waits for its sleepers to wake, so a worker killed while it slept in wait() made rank 0's next set() block for good,
before any failure check.)
"""
from __future__ import annotations

import pickle
import time

import numpy as np

CHANNEL_HEADER = 4096  # int64 fields: seq, header bytes, abort; the acks at 64-byte strides from byte 64
_ALIGN = 64


class StepChannel:
    """Rank 0's messages to the workers (module doc). Layout of the segment: header fields, then the message."""

    def __init__(self, shm, world_size: int):
        self.shm = shm
        buf = shm.buf
        self._fields = np.ndarray((3,), np.int64, buf, 0)  # seq, header length, abort
        self._acks = np.ndarray((world_size,), np.int64, buf, 64, (64,))
        self._data = np.ndarray((shm.size - CHANNEL_HEADER,), np.uint8, buf, CHANNEL_HEADER)
        self.world_size = world_size

    @staticmethod
    def segment_bytes(max_message: int) -> int:
        return CHANNEL_HEADER + max_message

    @property
    def seq(self) -> int:
        return int(self._fields[0])

    @property
    def aborted(self) -> bool:
        return bool(self._fields[2])

    def abort(self) -> None:
        self._fields[2] = 1

    def write(self, command: str, args: dict, arrays: dict[str, np.ndarray], wait_acks) -> None:
        """Rank 0: wait until every worker took the last message (`wait_acks(seq)`), then write this one."""
        seq = self.seq
        wait_acks(seq)
        specs, offset = [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            specs.append((name, a.dtype.str, a.shape, offset))
            offset += -(-a.nbytes // _ALIGN) * _ALIGN
        header = pickle.dumps((command, args, specs), protocol=pickle.HIGHEST_PROTOCOL)
        start = -(-len(header) // _ALIGN) * _ALIGN
        if start + offset > self._data.shape[0]:
            raise RuntimeError(f"a tensor-parallel step message of {start + offset} bytes does not fit the "
                               f"{self._data.shape[0]}-byte channel")
        self._data[:len(header)] = np.frombuffer(header, np.uint8)
        for (name, _, _, off), a in zip(specs, arrays.values()):
            a = np.ascontiguousarray(a)
            self._data[start + off:start + off + a.nbytes] = a.reshape(-1).view(np.uint8)
        self._fields[1] = len(header)
        self._fields[0] = seq + 1  # last: a worker that sees the new number reads a complete message

    def read(self, rank: int) -> tuple[str, dict, dict[str, np.ndarray]]:
        """A worker: the current message, its arrays copied out; then the ack (rank 0 may overwrite it after)."""
        n = int(self._fields[1])
        command, args, specs = pickle.loads(self._data[:n].tobytes())
        start = -(-n // _ALIGN) * _ALIGN
        arrays = {}
        for name, dtype, shape, off in specs:
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = self._data[start + off:start + off + count * dt.itemsize].view(dt).reshape(shape).copy()
        self._acks[rank] = self.seq
        return command, args, arrays

    def acked(self, seq: int) -> bool:
        return bool(self._acks[1:].min() >= seq) if self.world_size > 1 else True

    def close(self) -> None:
        self._fields = self._acks = self._data = None
        self.shm.close()


def new_wakeup(ctx):
    """A worker's wake-up semaphore: rank 0 posts it after each message (release: sem_post, which never waits, even
    when the worker died inside acquire); the worker sleeps on it between messages (_wait_message)."""
    return ctx.Semaphore(0)


def _wait_message(channel: StepChannel, wake, seen: int, spin_s: float) -> int:
    """A worker: the number of the next message after `seen` (spinning for spin_s, then sleeping on `wake`)."""
    end = time.monotonic() + spin_s
    while True:
        seq = channel.seq
        if seq > seen:
            return seq
        if time.monotonic() < end:
            continue
        if wake.acquire(timeout=0.5):
            while wake.acquire(False):  # every post so far was made after its message's number was written
                pass
