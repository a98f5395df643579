"""Per-sequence recurrent state: the second kind of per-sequence memory, beside the paged KV cache, for models with
layers that keep a fixed-size state instead of keys and values (the Gated DeltaNet layers of the hybrid models keep a
conv window and an SSM state per sequence).

A model names its pools (`state_layout`: xserv.models.base.StatePool); each pool is one allocation of
[layers, slots + 1, *shape], so a layer's view [slots + 1, *shape] is contiguous. A running sequence owns slot
`seq.slot` (the scheduler's per-sequence row, also the sampler's), taken at admission and returned at finish, abort or
preemption; the kernels start a sequence whose step begins at position 0 from zeros, so a slot is never cleared. The
last slot is scratch: the padding rows of a graph-replayed decode step and one-off forwards outside the scheduler
(LLM.logits) use it.
"""
from __future__ import annotations

import numpy as np

from ..tensor import Tensor


def slot_bytes(layout) -> int:
    """Bytes of one sequence's state across every pool of `layout`."""
    return sum(p.layers * int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in layout)


class StateCache:
    def __init__(self, layout, num_slots: int, device: str):
        if num_slots < 1:
            raise ValueError(f"a state cache needs at least one slot, got {num_slots}")
        self.layout = tuple(layout)
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.device = device
        self.pools: dict[str, list[Tensor]] = {}
        self._storage = []
        for pool in self.layout:
            storage = Tensor.zeros((pool.layers, num_slots + 1, *pool.shape), pool.dtype, device)
            self._storage.append(storage)
            self.pools[pool.name] = [storage[i] for i in range(pool.layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._storage)

    def __getitem__(self, name: str) -> list[Tensor]:
        """The per-layer views [slots + 1, *shape] of pool `name`."""
        return self.pools[name]
