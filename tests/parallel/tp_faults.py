"""Failures injected into a tensor-parallel worker process for tests. A worker is spawned (a fresh interpreter), so a
monkeypatch in the test process does not reach it; the test instead swaps xserv.parallel.group.worker_main for a
function here, which the spawned process imports by name (pytest's tests/ folder is on the sys.path it inherits)."""
from __future__ import annotations


def worker_with_bad_shard(rank: int, spec: dict, conn, wake) -> None:
    """xserv's worker_main, except that rank 1's shard fails to load (a ValueError, as a corrupt file would raise)."""
    import xserv.parallel.load as load
    from xserv.parallel.group import worker_main

    real = load.load_shard

    def load_shard(folder, tp, rank_, *args, **kwargs):
        if rank_ == 1:
            raise ValueError("a bad shard on this rank")
        return real(folder, tp, rank_, *args, **kwargs)

    load.load_shard = load_shard
    worker_main(rank, spec, conn, wake)
