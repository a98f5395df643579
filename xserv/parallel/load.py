"""Tensor-parallel weight loading (every rank of a TPGroup loads through it): one rank's model from the
memory-mapped safetensors files, built through the rank's ShardPlan (sharding.py), so a rank never holds a whole
checkpoint tensor in host memory.

`load_shard(folder, tp_size, rank)` builds the registered model class for the rank-local config
(`RankConfig.config`: heads, kv heads and MLP widths divided, `vocab_size` the full vocabulary) whose fields hold
exactly the rank's shards in the single-GPU layout at the local sizes. Per checkpoint tensor, `Shard.take` gives a
view of the mapped file tensor (a column slice is strided); the loader's one host copy of it is shard-sized (cast to
the weight dtype, or for FP8 dequantized from the scale blocks that cover the shard) and goes into the shard's
destination rows: on CUDA uploaded the way DenseModel.from_checkpoint uploads (dense_weights.fill_fields, the loop both
share). The embed / lm_head rows past the vocabulary (ShardPlan.vocab_padding) are zeros. At tp 1 the result is
from_checkpoint's model, tensor for tensor.

Reading a row-parallel shard (o_proj, down, the experts' down: a column slice of a row-major tensor) touches the
file pages of the whole tensor: those are the page cache, shared by every rank's mapping, not copies per rank.
A CUDA rank uploads to the process's current device (xserv.runtime's); each worker binds GPU `rank` first
(group.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..models.dense_weights import WEIGHT_DTYPE, fill_fields
from ..models.fp8 import dequantize_for_load
from ..tensor import Tensor, as_dtype
from .sharding import RankConfig, ShardPlan, check_tp, shard_plan

_CHUNK_ELEMENTS = 1 << 21  # dequantize_shard's float32 temporaries: about this many elements at a time


def dequantize_shard(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], offset: tuple[int, int],
                     out_dtype) -> np.ndarray:
    """The dequantized shard of an FP8 weight: q the shard's e4m3 elements (Shard.take of the file tensor),
    scale_inv the scale blocks that cover it (`scales[shard.scale_index]`), offset where the shard starts in its
    first block (Shard.scale_offset). Element (i, j) is float32(q) * scale_inv[(i + row) // bo, (j + col) // bi]
    rounded to out_dtype: the same product and rounding as fp8.dequantize_blockwise of the whole tensor, so a shard
    equals the slice of the dequantized tensor bit for bit. A shard that starts on a block boundary goes through
    fp8.dequantize_for_load (the single-GPU loader's threaded path)."""
    if tuple(offset) == (0, 0):
        return dequantize_for_load(q, scale_inv, block, out_dtype)
    (bo, bi), (ro, co) = block, offset
    rows, cols = q.shape
    need = (-(-(ro + rows) // bo), -(-(co + cols) // bi))
    if tuple(scale_inv.shape) != need:
        raise ValueError(f"the scales covering a {list(q.shape)} shard at offset {list(offset)} in {bo}x{bi} blocks "
                         f"must be {list(need)}, got {list(scale_inv.shape)}")
    col_scale = np.repeat(np.asarray(scale_inv, np.float32), bi, axis=1)[:, co:co + cols]  # [block rows, cols]
    block_row = (np.arange(rows) + ro) // bo
    out = np.empty((rows, cols), dtype=out_dtype)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        qf = q[r0:r1].astype(np.float32)
        qf *= col_scale[block_row[r0:r1]]
        out[r0:r1] = qf.astype(out_dtype)
    return out


def vocab_fields(config) -> tuple[str, ...]:
    """The vocab-parallel fields a model holds: embed, and lm_head unless the embeddings are tied."""
    return ("embed",) if config.tie_word_embeddings else ("embed", "lm_head")


def shard_pieces(plan: ShardPlan, reader, dtype):
    """(layer, field, destination rows, host array) of each shard of the plan, in file order, for fill_fields:
    the view of the mapped file tensor (cast by fill_fields), or for an FP8 shard its dequantized copy."""
    for s in plan.shards:
        arr = s.take(reader.get(s.name))
        if s.block is not None:
            arr = dequantize_shard(arr, reader.get(s.name + "_scale_inv")[s.scale_index], s.block, s.scale_offset,
                                   dtype)
        yield s.layer, s.field, s.dest_rows, arr


def shard_from_checkpoint(model_cls, config, reader, tp_size: int, rank: int, device: str = "cpu",
                          progress: bool = False, max_positions: int | None = None, dtype=None):
    """Rank `rank` of `tp_size`'s model from an open CheckpointReader (the reader-level twin of
    model_cls.from_checkpoint): the checkpoint is validated against the full config's weight table (headers only),
    the rank's fields are filled shard by shard, the vocab padding rows zeroed. The model's `rank_config` attribute
    is the RankConfig it holds."""
    plan = shard_plan(config, model_cls, tp_size, rank)  # validates the split (a ValueError naming the field)
    model_cls.validate_checkpoint(config, reader)
    dtype = as_dtype(dtype) if dtype is not None else WEIGHT_DTYPE[device]
    model_fields: dict[str, Tensor] = {}
    if plan.vocab_padding is not None:  # allocated here: a rank may hold padding rows only (no shard of them)
        p0, p1 = plan.vocab_padding
        for f in vocab_fields(config):
            model_fields[f] = Tensor.empty(plan.field_shapes[f], dtype, device)
            model_fields[f][p0:p1].zero_()
    rc: RankConfig = plan.rank_config
    model_fields, layer_fields = fill_fields(shard_pieces(plan, reader, dtype), len(plan.shards), plan.field_shapes,
                                             config.num_hidden_layers, dtype, device, progress, model_fields)
    model = model_cls.from_fields(rc.config, device, model_fields, layer_fields, max_positions)
    model.rank_config = rc
    return model


def load_shard(folder, tp_size: int, rank: int, device: str = "cpu", progress: bool = False,
               max_positions: int | None = None, config=None, dtype=None):
    """Rank `rank` of `tp_size`'s model of a Hugging Face model folder (its config.json unless `config` is given):
    the registered model class at the rank-local config, holding only the rank's shards (see the module docstring).
    Checked before anything is read: the model splits tp_size ways and, on CUDA, tp_size ranks fit the visible
    GPUs (sharding.check_tp's ValueErrors)."""
    from ..models.checkpoint import CheckpointReader
    from ..models.registry import config_from_pretrained, model_class

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    config = config if config is not None else config_from_pretrained(folder)
    model_cls = model_class(config)
    if device == "cuda":
        from ..runtime import device_count

        check_tp(config, tp_size, device_count(), model_cls)
    with CheckpointReader(Path(folder)) as reader:
        return shard_from_checkpoint(model_cls, config, reader, tp_size, rank, device, progress=progress,
                                     max_positions=max_positions, dtype=dtype)


__all__ = ["dequantize_shard", "load_shard", "shard_from_checkpoint", "shard_pieces", "vocab_fields"]
