"""The fused one-token decode path at tensor parallel size > 1 (xserv/models/dense.py `_post_attention_fused_tp`;
the all-reduce with the residual add in its epilogue: Communicator.all_reduce_add, cuda_src/allreduce.cu
allreduce_oneshot_add_bf16, reference ipc.reference_sum_add).

On the CPU (CI): the reference; ShmCommunicator.all_reduce_add over 2 spawned ranks against it; a TP=2 model's
fused one-token path (run directly: the CPU never picks it) against its unfused path on the same ranks, bit for bit
(the same rounding points: the bf16 sum of the partials added into the fp32 residual); which models and
communicators let fused_forward_ok pick it. On 2 GPUs the kernel is checked by tools/check_ipc_allreduce.py
(tests/parallel/test_ipc_allreduce.py) and the model's fused path at TP=2 by tests/parallel/test_tp_engine.py (decode steps are one
token: fused_forward_ok picks it wherever the IPC all-reduce is on)."""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np
import pytest

from qwen3_reference import perturbed_model_dir  # noqa: F401
from xserv.parallel.ipc import reference_sum, reference_sum_add
from xserv.tensor import bfloat16

BLOCK = 4  # KV-cache block size of the forwards below
WORLD = 2


def test_reference_sum_add_adds_the_rounded_sum(rng):
    parts = (rng.standard_normal((WORLD, 1000)) + 0.3).astype(bfloat16)
    residual = (rng.standard_normal(1000) * 4 + 1).astype(np.float32)
    total, new = reference_sum_add(parts, residual)
    np.testing.assert_array_equal(total, reference_sum(parts))
    np.testing.assert_array_equal(new, residual + total.astype(np.float32))
    unrounded = residual + parts[0].astype(np.float32) + parts[1].astype(np.float32)
    assert not np.array_equal(new, unrounded)  # the sum is rounded to bf16 before the add, as the unfused path does


def _run_ranks(target, *args, timeout=120.0) -> list:
    """target(rank, comm_name, q, *args) in WORLD spawned processes sharing a ShmCommunicator segment; their results
    in rank order."""
    from xserv.parallel.comm import ShmCommunicator

    shm = shared_memory.SharedMemory(create=True, size=ShmCommunicator.segment_bytes(WORLD))
    try:
        shm.buf[:] = bytes(shm.size)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=target, args=(r, shm.name, q, *args)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout)
        for rank, res in results.items():
            if isinstance(res, str):
                raise AssertionError(f"rank {rank}: {res}")
        return [results[r] for r in range(WORLD)]
    finally:
        shm.close()
        shm.unlink()


def _all_reduce_add_rank(rank, name, q, parts, residual):
    try:
        from xserv.parallel.comm import ShmCommunicator
        from xserv.tensor import Tensor

        comm = ShmCommunicator(name, rank, WORLD, 8, 16)
        t, res = Tensor.from_numpy(parts[rank].copy(), "cpu"), Tensor.from_numpy(residual.copy(), "cpu")
        assert comm.adds_residual(t.numel)
        comm.all_reduce_add(t, res)
        with pytest.raises(ValueError, match="residual must be float32"):
            comm.all_reduce_add(t, Tensor.from_numpy(residual.astype(bfloat16), "cpu"))
        q.put((rank, (t.numpy().copy(), res.numpy().copy())))
        comm.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_shm_all_reduce_add_matches_the_reference(rng):
    parts = (rng.standard_normal((WORLD, 3, 40)) + 0.2).astype(bfloat16)
    residual = (rng.standard_normal((3, 40)) * 3 - 1).astype(np.float32)
    want_sum, want_res = reference_sum_add(parts.reshape(WORLD, -1), residual.reshape(-1))
    for got_sum, got_res in _run_ranks(_all_reduce_add_rank, parts, residual):
        np.testing.assert_array_equal(got_sum.reshape(-1), want_sum)
        np.testing.assert_array_equal(got_res.reshape(-1), want_res)


def _fused_vs_unfused_rank(rank, name, q, folder, seq, steps):
    try:
        from xserv.engine.batch import SeqChunk, make_batch
        from xserv.engine.kv_cache import KVCache, KVCacheSpec
        from xserv.models.registry import config_from_pretrained, model_class
        from xserv.parallel.comm import ShmCommunicator
        from xserv.parallel.load import load_shard
        from xserv.parallel.sharding import rank_config

        config = config_from_pretrained(folder)
        rc = rank_config(config, WORLD, rank, model_class(config))
        model = load_shard(folder, WORLD, rank, "cpu", max_positions=64, config=config)
        model.comm = ShmCommunicator(name, rank, WORLD, rc.vocab_part, rc.config.vocab_size)
        table = list(range(8))
        out = {}
        for fused in (True, False):
            cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, "cpu", model.dtype)
            model.forward(make_batch([SeqChunk(seq, 0, table, "last")], BLOCK, "cpu"), cache)
            logits = []
            for j in range(steps):
                batch = make_batch([SeqChunk([3 + j], len(seq) + j, table, "last")], BLOCK, "cpu")
                if fused:  # the CPU never picks it (fused_forward_ok): run it directly, on the ops' references
                    got = model._forward_fused(batch, cache, model.make_workspace(1, 1), 1, 1)
                else:
                    got = model.forward(batch, cache)
                logits.append(got.numpy().copy())
            out[fused] = logits
        q.put((rank, (out[True], out[False])))
        model.comm.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_fused_path_at_tp2_is_the_unfused_path_on_the_cpu(perturbed_model_dir):  # noqa: F811
    """Each rank's fused one-token path (the o / down partials through all_reduce_add, the norms in the GEMV
    prologues) gives the unfused path's logits bit for bit, on both ranks (every rank gets the full vocabulary)."""
    (fused0, unfused0), (fused1, unfused1) = _run_ranks(_fused_vs_unfused_rank, str(perturbed_model_dir),
                                                        [791, 6722, 315, 9625, 374], 3)
    for a, b, c, d in zip(fused0, unfused0, fused1, unfused1):
        assert np.all(np.isfinite(a)) and a.shape[0] == 1
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(c, d)


@pytest.mark.parametrize("adds", [True, False])
def test_fused_tp_ok_follows_the_communicator_and_the_blocks(adds):
    """At tp > 1 the fused path is allowed where the communicator adds into the residual (the IPC kernel, for a
    message it takes) and the model's layers take it (not a sparse MoE block, which adds its own partial into the
    residual); at tp 1 always."""
    from xserv.models.dense import DenseModel
    from xserv.models.qwen3_moe import Qwen3MoeModel

    seen = []

    def me(cls, comm):
        return SimpleNamespace(comm=comm, FUSED_TP=cls.FUSED_TP, config=SimpleNamespace(hidden_size=64))

    comm = _Comm(adds, seen)
    assert DenseModel.fused_tp_ok(me(DenseModel, comm), 1) == adds
    assert seen == [64]  # asked about the one-token message, [1, hidden]
    assert not DenseModel.fused_tp_ok(me(Qwen3MoeModel, comm), 1)
    assert DenseModel.fused_tp_ok(me(DenseModel, None), 1) and DenseModel.fused_tp_ok(me(Qwen3MoeModel, None), 1)


class _Comm:
    def __init__(self, adds: bool, seen: list):
        self.adds, self.seen = adds, seen

    def adds_residual(self, numel: int) -> bool:
        self.seen.append(numel)
        return self.adds
