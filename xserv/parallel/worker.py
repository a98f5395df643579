"""A worker process of a tensor-parallel group (ranks 1..tp-1, spawned by TPGroup.start in group.py): bind its GPU,
join the communicator, load its shard (`load_shard`), then repeat rank 0's runner step by step from the messages of
the StepChannel (channel.py). Replies and its failure go back to rank 0 through its Pipe; its own watchdog thread
ends the process when rank 0 aborts the group or dies.
"""
from __future__ import annotations

import os
import threading
import time
import traceback

from .channel import StepChannel, _wait_message
from .comm import ShmCommunicator


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

