"""The processes of a tensor-parallel model: rank 0 is the process that owns the LLM (tokenizer, scheduler, block
manager, sampler, and its own shard of the model); ranks 1..tp-1 are worker processes started here with spawn, one
per GPU (on the CPU backend, one per rank), each running `worker_main`: bind its GPU, join the communicator, load
its shard (`load_shard`), then repeat rank 0's runner step by step.

Messaging. Rank 0 -> workers: one shared-memory segment (`StepChannel`) holds the latest message: a small pickled
header (the command, its integer arguments, each array's dtype / shape / offset) and the arrays' raw bytes (token
ids, positions, slot mapping, block tables, a decode graph's metadata image): NumPy arrays copied in, never pickled
tensors. Rank 0 writes a message once every worker has taken the previous one (their ack counters), bumps the
sequence number and posts each worker's wake-up semaphore; a worker spins on the sequence number for a while after
each message (CUDA; a decode step's next message comes within milliseconds) and otherwise sleeps on its semaphore. (A
semaphore, not a multiprocessing Event: an Event's set() waits for its sleepers to wake, so a worker killed while it
slept in wait() made rank 0's next set() block for good, before any failure check.) Workers -> rank 0:
one Pipe each, for replies ("ok" with a value) and a failure ("error" with the phase and the exception); read only
by rank 0's watchdog thread, which routes replies to `call()`.

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
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref

import numpy as np

from .comm import ShmCommunicator

CHANNEL_HEADER = 4096  # int64 fields: seq, header bytes, abort; the acks at 64-byte strides from byte 64
_ALIGN = 64
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


# ---- the worker process -------------------------------------------------------------------------------------------
def _bind_device(rank: int) -> None:
    """Make GPU `rank` this process's xserv device (the runtime context is created on first use with device 0)."""
    from .. import runtime

    if runtime._runtime is None:
        runtime._runtime = runtime.Runtime(rank)


def _worker_watchdog(channel: StepChannel, parent_pid: int) -> None:
    """Exit this worker at once when rank 0 raised the abort flag or died (a collective may be blocked on the GPU
    or in shared memory: no cleanup is waited for; rank 0 unlinks the shared memory)."""
    while True:
        time.sleep(0.1)
        if channel.aborted or os.getppid() != parent_pid:
            os._exit(3)


def worker_main(rank: int, spec: dict, conn, wake) -> None:
    """Rank `rank` (>= 1): bind the GPU, join the communicator, load the shard, then follow rank 0's messages."""
    from multiprocessing import shared_memory

    phase = "starting"
    try:
        shm = shared_memory.SharedMemory(name=spec["channel"])
        channel = StepChannel(shm, spec["tp_size"])
        threading.Thread(target=_worker_watchdog, args=(channel, spec["parent_pid"]), daemon=True).start()
        device, tp = spec["device"], spec["tp_size"]
        from ..models.registry import config_from_pretrained, model_class
        from .sharding import rank_config

        config = config_from_pretrained(spec["folder"])
        rc = rank_config(config, tp, rank, model_class(config))
        phase = "joining the communicator"
        if device == "cuda":
            _bind_device(rank)
            from .comm import NcclCommunicator

            comm = NcclCommunicator(spec["comm"]["unique_id"], rank, tp, rc.vocab_part, rc.config.vocab_size)
        else:
            comm = ShmCommunicator(spec["comm"]["name"], rank, tp, rc.vocab_part, rc.config.vocab_size)
        phase = "loading its shard"
        from .load import load_shard

        model = load_shard(spec["folder"], tp, rank, device, max_positions=spec["max_positions"], config=config,
                           dtype=spec["dtype"])
        model.comm = comm
        conn.send(("ok", model.weight_bytes()))
        phase = "setting up"
        state = {"model": model, "workspace": None, "runner": None, "rc": rc}
        seen = 0  # the channel's first message is number 1 (it may already be there: rank 0 does not wait for us)
        spin_s = spec["spin_s"]
        while True:
            seen = _wait_message(channel, wake, seen, spin_s)
            command, args, arrays = channel.read(rank)
            if command == "exit":
                break
            reply = _handle(state, command, args, arrays)
            if reply is not None:
                conn.send(("ok", reply))
        runner = state["runner"]
        if runner is not None:
            runner.close()
        comm.close()
        conn.send(("ok", "exited"))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to rank 0, then the process ends
        try:
            last = traceback.extract_tb(e.__traceback__)[-1]
            where = f" ({os.path.basename(last.filename)}:{last.lineno})"
        except Exception:
            where = ""
        try:
            conn.send(("error", f"{type(e).__name__} while {phase}: {e}{where}"))
        except Exception:
            pass
        os._exit(1)
    os._exit(0)


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


def _handle(state: dict, command: str, args: dict, arrays: dict):
    """Setup commands (with a reply) and step commands (the runner's `follow`)."""
    model = state["model"]
    if command == "prepare":  # the workspace, then the KV tokens this rank's memory allows (CUDA)
        state["workspace"] = model.make_workspace(args["max_tokens"], args["max_logits"])
        if model.device != "cuda":
            return 0
        from ..engine.kv_cache import KVCache, KVCacheSpec, kv_cache_dtype

        spec = KVCacheSpec(*model.kv_layout, args["block_size"])
        dtype = kv_cache_dtype(args.get("kv_cache_dtype", "auto"), model.dtype)
        return KVCache.capacity_tokens(spec, dtype, args["memory_fraction"])
    if command == "runner":
        from ..engine.kv_cache import KVCache, KVCacheSpec, kv_cache_dtype
        from ..engine.model_runner import ModelRunner

        spec = KVCacheSpec(*model.kv_layout, args["block_size"])
        dtype = kv_cache_dtype(args.get("kv_cache_dtype", "auto"), model.dtype)
        kv = KVCache.create(spec, model.device, dtype, num_tokens=args["num_tokens"])
        runner = ModelRunner(model, kv, max_num_batched_tokens=args["max_num_batched_tokens"],
                             max_num_seqs=args["max_num_seqs"], max_model_len=args["max_model_len"],
                             workspace=state["workspace"])
        runner.token_offset = state["rc"].vocab[0]
        state["runner"] = runner
        return kv.num_blocks
    state["runner"].follow(command, args, arrays)
    return None


__all__ = ["StepChannel", "TPGroup", "WorkerFailed", "worker_main"]
