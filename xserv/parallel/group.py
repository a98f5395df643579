"""The processes of a tensor-parallel model: rank 0 is the process that owns the LLM (tokenizer, scheduler, block
manager, sampler, and its own shard of the model); ranks 1..tp-1 are worker processes started here with spawn, one
per GPU (on the CPU backend, one per rank), each running `worker_main`: bind its GPU, join the communicator, load
its shard (`load_shard`), then repeat rank 0's runner step by step.

Messaging. Rank 0 -> workers: one shared-memory segment, the `StepChannel` (channel.py). Workers -> rank 0: one Pipe
each, for replies ("ok" with a value) and a failure ("error" with the phase and the exception); read only by rank 0's
watchdog thread, which routes replies to `call()`. The workers' side is worker.py.

Failure. The watchdog also waits on every worker's process sentinel. A worker that ends while the group is open
(killed, an exception while loading or stepping, out of memory) marks the group failed with one WorkerFailed naming
the rank and its error (its own message when it sent one, else its exit code / signal), raises the abort flag in
shared memory, aborts rank 0's NCCL communicator (so that a collective waiting for the dead rank returns), and
stops the other workers: each worker's own watchdog thread exits its process within 0.1 s of the abort flag or of
rank 0's death. Rank 0 raises the failure from its next wait (a message ack, a reply, a shared-memory collective) or
from the engine's next step; close() joins every worker (terminate / kill after a grace period) and unlinks the
shared-memory segments.
"""
from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - its exit hook first registered, so ours (closing the groups) runs first
import os
import queue
import signal
import threading
import time
import weakref

from .channel import StepChannel, _wait_message, new_wakeup  # noqa: F401 - tests and tools reach them here
from .comm import ShmCommunicator
# worker_main is looked up in this module when the workers are spawned: a test swaps it here for a faulty one
from .worker import worker_main

_WORKER_SPIN_S = {"cuda": 0.05, "cpu": 0.0}  # a worker polls the sequence number this long before sleeping
JOIN_TIMEOUT_S = 10.0


class WorkerFailed(RuntimeError):
    """A rank of a tensor-parallel group failed; the message names the rank and its error."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_OPEN_GROUPS: "weakref.WeakSet[TPGroup]" = weakref.WeakSet()


@atexit.register
def _close_open_groups() -> None:
    for group in list(_OPEN_GROUPS):
        try:
            group.close()
        except Exception:
            pass


def _channel_bytes(config, engine_config) -> int:
    """The largest step message: a decode metadata image of max_num_seqs rows and full-context block tables, or an
    eager forward's arrays (tokens, block tables), with room for the header."""
    from ..engine.model_runner import GRAPH_BATCH_SIZES

    bs = engine_config.block_size
    seqs = max(engine_config.max_num_seqs, max(GRAPH_BATCH_SIZES))
    width = -(-int(engine_config.max_model_len or config.context_length) // bs) + 1
    tokens = max(engine_config.max_num_batched_tokens or 16384, 16384, engine_config.max_num_seqs)
    return 4 * (8 * seqs + seqs * width + 8 * tokens) + (1 << 20)


class TPGroup:
    """Rank 0's handle on the worker processes (module doc). `start` checks, spawns and returns at once; rank 0
    then loads its own shard (`load_rank0`) while the workers load theirs, and `wait_loaded` waits for them."""

    def __init__(self):
        self.workers: list = []
        self.error: WorkerFailed | None = None
        self.closed = False
        self.comm = None
        self._channel = None
        self._shms: list = []
        self._wakes: list = []  # each worker's wake-up semaphore (new_wakeup)
        self._conns: list = []
        self._replies: list[queue.Queue] = []
        self._errors: dict[int, str] = {}
        self._lock = threading.Lock()
        self._watch_stop = None
        self._watchdog = None

    # ---- start ----------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, folder, config, tp_size: int, device: str, engine_config, *, max_positions: int,
              dtype=None) -> "TPGroup":
        """Check that the model splits tp_size ways (on CUDA: onto as many GPUs), then spawn ranks 1..tp-1."""
        import multiprocessing as mp
        from multiprocessing import shared_memory

        from ..models.registry import model_class
        from .sharding import check_tp, rank_config

        num_gpus = tp_size
        if device == "cuda":
            from ..runtime import device_count

            num_gpus = device_count()
        check_tp(config, tp_size, num_gpus, model_class(config))
        rc = rank_config(config, tp_size, 0)
        group = cls()
        group.tp_size, group.device, group.config = tp_size, device, config
        group.vocab_part = rc.vocab_part
        ctx = mp.get_context("spawn")
        try:
            channel_shm = shared_memory.SharedMemory(create=True,
                                                     size=StepChannel.segment_bytes(_channel_bytes(config,
                                                                                                   engine_config)))
            group._shms.append(channel_shm)
            group._channel = StepChannel(channel_shm, tp_size)
            comm_spec = {"kind": "shm"}
            if device == "cpu":
                comm_shm = shared_memory.SharedMemory(create=True, size=ShmCommunicator.segment_bytes(tp_size))
                group._shms.append(comm_shm)
                comm_spec["name"] = comm_shm.name
            else:
                from .comm import nccl_unique_id

                comm_spec = {"kind": "nccl", "unique_id": nccl_unique_id()}
            spec = {"folder": str(folder), "tp_size": tp_size, "device": device, "max_positions": max_positions,
                    "dtype": dtype, "channel": channel_shm.name, "comm": comm_spec,
                    "spin_s": _WORKER_SPIN_S[device], "parent_pid": os.getpid()}
            for rank in range(1, tp_size):
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                wake = new_wakeup(ctx)
                proc = ctx.Process(target=worker_main, args=(rank, spec, child_conn, wake),
                                   name=f"xserv-tp-rank{rank}", daemon=True)
                proc.start()
                child_conn.close()
                group.workers.append(proc)
                group._conns.append(parent_conn)
                group._wakes.append(wake)
                group._replies.append(queue.Queue())
            _OPEN_GROUPS.add(group)
            group._start_watchdog()
            group.comm = group._make_comm(comm_spec, rc)
        except BaseException:
            group.close()
            raise
        return group

    def _make_comm(self, spec: dict, rc):
        if spec["kind"] == "shm":
            return ShmCommunicator(spec["name"], 0, self.tp_size, rc.vocab_part, rc.config.vocab_size,
                                   check=self.check)
        from .comm import NcclCommunicator

        return NcclCommunicator(spec["unique_id"], 0, self.tp_size, rc.vocab_part, rc.config.vocab_size)

    def load_rank0(self, folder, *, max_positions: int, progress: bool = False, dtype=None):
        """Rank 0's shard of the model, its communicator attached."""
        from .load import load_shard

        model = load_shard(folder, self.tp_size, 0, self.device, progress=progress, max_positions=max_positions,
                           config=self.config, dtype=dtype)
        model.comm = self.comm
        return model

    def wait_loaded(self) -> list:
        """Wait for every worker's shard (each one's reply: its weight bytes)."""
        return self._collect("loading its shard")

    # ---- steps ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the group's failure, if any."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise WorkerFailed("the tensor-parallel group is closed")

    def send(self, command: str, args: dict, arrays: dict | None = None, **extra) -> None:
        """One step message to every worker (no reply)."""
        self.check()
        if extra:
            args = {**args, **extra}
        self._channel.write(command, args, arrays or {}, self._wait_acks)
        for wake in self._wakes:
            wake.release()

    def call(self, command: str, **args) -> list:
        """A message every worker answers (setup steps); their replies, rank 1 first."""
        self.send(command, args)
        return self._collect(command)

    def _wait_acks(self, seq: int) -> None:
        spins, last = 0, time.monotonic()
        while not self._channel.acked(seq):
            spins += 1
            if spins > 100:
                time.sleep(1e-5 if spins < 1000 else 2e-4)
            now = time.monotonic()
            if now - last > 0.05:
                last = now
                self.check()

    def _collect(self, what: str) -> list:
        out = []
        for q in self._replies:
            while True:
                self.check()
                try:
                    out.append(q.get(timeout=0.05))
                    break
                except queue.Empty:
                    continue
        return out

    # ---- failure --------------------------------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        import multiprocessing as mp

        self._watch_stop = mp.get_context("spawn").Pipe(duplex=False)
        self._watchdog = threading.Thread(target=self._watch, name="xserv-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        stop_r = self._watch_stop[0]
        conns = {c: i for i, c in enumerate(self._conns)}
        sentinels = {p.sentinel: i for i, p in enumerate(self.workers)}
        while True:
            ready = wait([stop_r, *conns, *sentinels])
            if stop_r in ready:
                return
            for c in [c for c in ready if c in conns]:
                i = conns[c]
                try:
                    kind, value = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    continue
                if kind == "ok":
                    self._replies[i].put(value)
                else:
                    self._errors[i + 1] = value
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead and not self.closed:
                i = dead[0]
                self.workers[i].join(1)
                for c in list(conns):  # a last error message may still be in the pipe
                    if conns[c] == i and c.poll():
                        try:
                            kind, value = c.recv()
                            if kind != "ok":
                                self._errors[i + 1] = value
                        except (EOFError, OSError):
                            pass
                rank = i + 1
                why = self._errors.get(rank) or _describe_exit(self.workers[i].exitcode)
                self._fail(WorkerFailed(f"tensor-parallel rank {rank} of {self.tp_size} failed: {why}"))
                return
            if dead:
                return

    def _fail(self, error: WorkerFailed) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
        if self._channel is not None:
            self._channel.abort()
        comm = self.comm
        if comm is not None:
            comm.abort()

    # ---- shutdown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (an exit message; after JOIN_TIMEOUT_S, terminate, then kill), stop the watchdog,
        close the communicator and unlink the shared memory. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        _OPEN_GROUPS.discard(self)
        if self._channel is not None and self.error is None and any(p.is_alive() for p in self.workers):
            try:
                self._channel.write("exit", {}, {}, lambda seq: self._acks_or_timeout(seq, 2.0))
                for wake in self._wakes:
                    wake.release()
            except Exception:
                pass
        elif self._channel is not None:
            self._channel.abort()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.workers:
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        if self._watch_stop is not None:
            self._watch_stop[1].send_bytes(b"x")
            self._watchdog.join(2)
            for c in self._watch_stop:
                c.close()
        for c in self._conns:
            c.close()
        # the named semaphores (sem.mp-* in /dev/shm, spawn context) are unlinked when they are collected
        self._wakes.clear()
        self._conns.clear()
        if self.comm is not None:
            if self.error is not None:
                self.comm.abort()
            self.comm.close()
            self.comm = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for shm in self._shms:
            try:
                shm.close()
            except Exception:
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._shms.clear()

    def _acks_or_timeout(self, seq: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not self._channel.acked(seq) and time.monotonic() < end:
            time.sleep(1e-3)


__all__ = ["StepChannel", "TPGroup", "WorkerFailed", "worker_main"]
