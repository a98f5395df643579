"""Tensor-parallel sharding arithmetic (the loader and the tensor-parallel engine use it): for a model config,
a tensor-parallel size `tp` and a rank, which part of every checkpoint tensor the rank owns and where that part goes
in the rank's fused / stacked fields, so that a loader reads only its shard from the memory-mapped safetensors files.

The plan is derived from the model class's weight table (`weight_table`, `field_shapes`, `part_rows`: the hooks
xserv/models/dense_weights.py defines and qwen3_moe.py overrides), so dense Qwen3, Llama and Qwen3-MoE need no
code here; what a field does under tensor parallelism is one line of FIELD_SPLITS (a field without a line is a
ValueError).
The destinations come from the same table built for the rank-local config (`RankConfig.config`: heads, kv heads,
intermediate and moe_intermediate divided by tp), so a rank's fields keep the single-GPU layout at the local sizes.

Megatron-style layout, one all-reduce after each row-parallel projection:
- column-parallel (output rows split; the rank computes its slice of the output features):
  q/k/v by heads: rank r holds q heads [r*Hq/tp, (r+1)*Hq/tp). KV heads are split the same way when
  num_key_value_heads >= tp (tp must divide it); when num_key_value_heads < tp (tp must be a multiple of it) each
  rank holds one kv head, the one its q heads use (kv head = first q head of the rank // (Hq / Hkv)), so each kv
  head is replicated on tp / Hkv ranks (its K/V cache too).
  gate/up by intermediate columns: the rank's gate rows then its up rows (the fused gate_up field, so SiLU-and-mul
  pairs gate column j with up column j on the same rank).
  MoE experts: expert-internal tensor parallelism, not expert parallelism: every rank holds every expert, each
  expert's gate/up rows split by moe_intermediate columns like the dense MLP (the stacked experts_gate_up field:
  expert e's local gate rows at e*2m, its up rows at e*2m + m, m = moe_intermediate / tp). The router is replicated,
  so every rank routes every token identically and computes its partial sum of the same experts.
- row-parallel (input columns split; the rank computes a partial sum of the whole output, then all-reduce):
  o_proj columns by q heads, down columns by intermediate, each expert's down columns by moe_intermediate.
- vocab-parallel: embed_tokens and lm_head rows by token id. Each rank holds vocab_part rows:
  vocab_part = ceil(vocab_size / tp) rounded up to a multiple of VOCAB_PART_MULTIPLE (8) when tp > 1, vocab_size
  at tp 1; padded vocab = tp * vocab_part. Rank r holds token ids [r*vocab_part, (r+1)*vocab_part) that exist; the
  rows past vocab_size (ShardPlan.vocab_padding, all on the last rank(s)) are zero-filled by the loader. The
  embedding looks up the ids in its range (zero rows for the others) and the ranks' rows are all-reduced (an exact
  sum: one non-zero term per row); the ranks' logits [rows, vocab_part] are gathered on rank 0 into
  [rows, padded vocab], of which the sampler sees the first vocab_size columns: the full vocabulary, padding cut off.
  Qwen3's 151,936 and Llama 3's 128,256 need no padding up to tp 8.
- replicated: every norm (input, post-attention, final, q/k head norms) and the MoE router.

Each rank's MLP slices must stay a multiple of KERNEL_MULTIPLE (8) columns (the GEMM/GEMV and MoE kernels' width
granularity), checked with the divisibility rules before any loading (`rank_config`, `check_tp`).

FP8 checkpoints (`Weight.block`): a shard boundary may fall inside a quantization block (Qwen3-30B-A3B-FP8 at tp 4:
192 of 768 columns per rank, blocks of 128): `Shard.scale_index` / `scale_offset` give the scale blocks that cover
the shard and where the shard starts in them, which is all phase 1's dequantize-at-load needs; native FP8 GEMMs on
shards would want block-aligned boundaries.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ..models.dense_weights import NORM_FIELDS, layer_prefix

COLUMN = "column"  # output rows split: the rank computes its slice of the output features
ROW = "row"  # input columns split: the rank computes a partial sum of the whole output (all-reduce after)
VOCAB = "vocab"  # rows split by token id, padded (embed_tokens, lm_head)
REPLICATED = "replicated"  # every rank holds the whole tensor

KERNEL_MULTIPLE = 8  # each rank's intermediate / moe_intermediate slice: a multiple of this many columns
VOCAB_PART_MULTIPLE = 8  # each rank's embed / lm_head rows (tp > 1): a multiple of this many

# field -> (how it is split, the config dimension the split divides; None: not split). One line per field of the
# model classes' weight tables; a field missing here is a ValueError (no silent replication of a new projection).
FIELD_SPLITS: dict[str, tuple[str, str | None]] = {
    "qkv": (COLUMN, "num_attention_heads"),  # q rows by q heads, k/v rows by kv heads (split or replicated)
    "o_proj": (ROW, "num_attention_heads"),
    "gate_up": (COLUMN, "intermediate_size"),
    "down": (ROW, "intermediate_size"),
    "experts_gate_up": (COLUMN, "moe_intermediate_size"),
    "experts_down": (ROW, "moe_intermediate_size"),
    "embed": (VOCAB, "vocab_size"),
    "lm_head": (VOCAB, "vocab_size"),
    "router": (REPLICATED, None),
    **{f: (REPLICATED, None) for f in NORM_FIELDS},
}
_MODEL_FIELDS = ("embed", "final_norm", "lm_head")  # DenseModel.weight_table's model-level fields


# ---- the rank-local sizes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankConfig:
    """What rank `rank` of `tp_size` owns, in global coordinates, and the rank-local model config.

    `config` is the model config with num_attention_heads, num_key_value_heads, intermediate_size and (MoE)
    moe_intermediate_size divided as the rank holds them: building the model class's tables for it gives the rank's
    field shapes, except for the vocabulary: `config.vocab_size` stays the full vocabulary (the width of the
    gathered logits the sampler sees; token-id checks), while the rank's embed / lm_head hold `vocab_part` rows. A
    dimension the model does not use (the intermediate_size of a MoE model without dense layers) is not divided."""
    tp_size: int
    rank: int
    config: Any
    q_heads: tuple[int, int]  # global q heads [start, stop)
    kv_heads: tuple[int, int]  # global kv heads [start, stop)
    kv_replicas: int  # ranks holding each kv head: 1 (split) or tp / num_key_value_heads (replicated)
    intermediate: tuple[int, int] | None  # global intermediate columns [start, stop); None: no dense MLP
    moe_intermediate: tuple[int, int] | None  # each expert's global moe_intermediate columns; None: no experts
    vocab: tuple[int, int]  # the real token ids this rank's embed / lm_head rows hold [start, stop)
    vocab_part: int  # embed / lm_head rows on every rank (padding included)
    padded_vocab_size: int  # tp_size * vocab_part

    @property
    def num_attention_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_key_value_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def kv_replicated(self) -> bool:
        return self.kv_replicas > 1

    @property
    def intermediate_size(self) -> int | None:
        return None if self.intermediate is None else self.intermediate[1] - self.intermediate[0]

    @property
    def moe_intermediate_size(self) -> int | None:
        return None if self.moe_intermediate is None else self.moe_intermediate[1] - self.moe_intermediate[0]


def vocab_part_size(vocab_size: int, tp_size: int) -> int:
    """Embed / lm_head rows per rank: vocab_size at tp 1, else ceil(vocab_size / tp) rounded up to a multiple of
    VOCAB_PART_MULTIPLE (the padded vocabulary is tp times that)."""
    if tp_size == 1:
        return vocab_size
    return -(-math.ceil(vocab_size / tp_size) // VOCAB_PART_MULTIPLE) * VOCAB_PART_MULTIPLE


def _model_class(config, model_cls):
    if model_cls is not None:
        return model_cls
    from ..models.registry import model_class

    return model_class(config)


def _rule(field: str, name: str) -> tuple[str, str | None]:
    rule = FIELD_SPLITS.get(field)
    if rule is None:
        raise ValueError(f"no tensor-parallel rule for field {field!r} (checkpoint tensor {name}): add its split to "
                         f"FIELD_SPLITS in xserv/parallel/sharding.py")
    return rule


def _split_dims(config, model_cls) -> frozenset[str]:
    """The config dimensions the model's tensors split (which MLP widths exist: a MoE model without dense layers
    has no intermediate_size to divide)."""
    dims = set()
    for n in range(config.num_hidden_layers):
        for suffix, field, _ in model_cls.layer_weights(config, n):
            dims.add(_rule(field, layer_prefix(n) + suffix)[1])
    dims.update(FIELD_SPLITS[f][1] for f in _MODEL_FIELDS)
    dims.discard(None)
    return frozenset(dims)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tp_problem(config, tp: int, dims: frozenset[str]) -> str | None:
    """Why `tp` ranks cannot shard this model (a message naming the config field), or None."""
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hq % tp:
        return (f"num_attention_heads ({hq}) is not divisible by tensor_parallel_size {tp}: each rank needs a whole "
                f"number of query heads")
    if hkv % tp and tp % hkv:
        return (f"num_key_value_heads ({hkv}) and tensor_parallel_size {tp}: one must divide the other (kv heads are "
                f"split when num_key_value_heads >= tp, each replicated on tp / num_key_value_heads ranks when fewer)")
    for name in ("intermediate_size", "moe_intermediate_size"):
        if name not in dims:
            continue
        width = getattr(config, name)
        if width % tp:
            return f"{name} ({width}) is not divisible by tensor_parallel_size {tp}"
        if (width // tp) % KERNEL_MULTIPLE:
            kernels = "the MoE expert kernels" if name.startswith("moe") else "the GEMM/GEMV and SiLU-and-mul kernels"
            return (f"{name} ({width}) / tensor_parallel_size {tp} = {width // tp} is not a multiple of "
                    f"{KERNEL_MULTIPLE}: {kernels} need each rank's slice a multiple of {KERNEL_MULTIPLE} wide")
    return None


def _check_tp_size(tp_size) -> None:
    if not _is_count(tp_size) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")


def valid_tp_sizes(config, model_cls=None) -> list[int]:
    """Every tensor_parallel_size this model can be sharded into (GPU count aside)."""
    dims = _split_dims(config, _model_class(config, model_cls))
    hq = config.num_attention_heads
    return [t for t in range(1, hq + 1) if hq % t == 0 and _tp_problem(config, t, dims) is None]


def _validate(config, tp_size, model_cls) -> frozenset[str]:
    _check_tp_size(tp_size)
    dims = _split_dims(config, model_cls)
    problem = _tp_problem(config, tp_size, dims)
    if problem is not None:
        sizes = ", ".join(map(str, valid_tp_sizes(config, model_cls)))
        raise ValueError(f"{problem} (tensor_parallel_size values this model allows: {sizes})")
    return dims


def rank_config(config, tp_size: int, rank: int, model_cls=None) -> RankConfig:
    """What rank `rank` of `tp_size` owns (validated: a ValueError naming the config field when the model cannot be
    split `tp_size` ways). model_cls: the model class (default: the registry's for this config)."""
    model_cls = _model_class(config, model_cls)
    dims = _validate(config, tp_size, model_cls)
    tp = tp_size
    if not _is_count(rank) or not 0 <= rank < tp:
        raise ValueError(f"rank must be an integer in 0..{tp - 1} (tensor_parallel_size {tp}), got {rank!r}")
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    nq = hq // tp
    q0 = rank * nq
    if hkv >= tp:
        nkv, replicas = hkv // tp, 1
        kv0 = rank * nkv
    else:  # tp is a multiple of hkv: this rank's q heads all lie in one GQA group, whose kv head it holds
        nkv, replicas = 1, tp // hkv
        kv0 = q0 // (hq // hkv)
    changes: dict[str, int] = {"num_attention_heads": nq, "num_key_value_heads": nkv}
    spans: dict[str, tuple[int, int] | None] = {}
    for name in ("intermediate_size", "moe_intermediate_size"):
        spans[name] = None
        if name in dims:
            width = getattr(config, name) // tp
            spans[name] = (rank * width, (rank + 1) * width)
            changes[name] = width
    v = config.vocab_size
    part = vocab_part_size(v, tp)
    v0 = min(rank * part, v)
    return RankConfig(tp_size=tp, rank=rank, config=config.replace(**changes), q_heads=(q0, q0 + nq),
                      kv_heads=(kv0, kv0 + nkv), kv_replicas=replicas, intermediate=spans["intermediate_size"],
                      moe_intermediate=spans["moe_intermediate_size"], vocab=(v0, min(v0 + part, v)),
                      vocab_part=part, padded_vocab_size=tp * part)


def check_tp(config, tp_size: int, num_gpus: int, model_cls=None) -> None:
    """The checks to run before loading anything: tp_size ranks fit the GPUs and the model splits tp_size ways
    (a ValueError naming the field otherwise)."""
    _check_tp_size(tp_size)
    if not _is_count(num_gpus) or num_gpus < 0:
        raise ValueError(f"num_gpus must be a non-negative integer, got {num_gpus!r}")
    if tp_size > num_gpus:
        raise ValueError(f"tensor_parallel_size {tp_size} needs {tp_size} GPUs (one rank per GPU), but num_gpus is "
                         f"{num_gpus}")
    _validate(config, tp_size, _model_class(config, model_cls))


# ---- the plan ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor's part on one rank: the source slice of the file tensor (`rows`, and `cols` for a
    row-parallel split) and the rows of the rank's field it fills (`dest_rows`: the row offset in a fused or stacked
    field; every column of the destination). `take(file_array)` is the source slice as a view (basic slicing of the
    memory-mapped array: nothing is read until it is copied; a column slice is strided, so the loader's contiguous
    copy is shard-sized, never the whole tensor)."""
    name: str  # the Hugging Face tensor name
    layer: int | None  # None: a model-level tensor
    field: str  # the layer / model field it goes to
    split: str  # COLUMN, ROW, VOCAB or REPLICATED
    file_shape: tuple[int, ...]  # the checkpoint tensor's shape
    rows: tuple[int, int]  # source rows [start, stop) of the file tensor
    cols: tuple[int, int] | None  # source columns [start, stop); None: every column (and every 1-D tensor)
    dest_rows: tuple[int, int]  # rows [start, stop) of the rank's field tensor
    block: tuple[int, int] | None = None  # FP8: the quantization block of the file tensor (Weight.block)

    @property
    def col_range(self) -> tuple[int, int] | None:
        """The source columns, explicit (None for a 1-D tensor)."""
        if len(self.file_shape) < 2:
            return None
        return self.cols if self.cols is not None else (0, self.file_shape[1])

    @property
    def shape(self) -> tuple[int, ...]:
        rows = self.rows[1] - self.rows[0]
        cols = self.col_range
        return (rows,) if cols is None else (rows, cols[1] - cols[0])

    @property
    def index(self) -> tuple[slice, ...]:
        """The source slice, for `file_array[shard.index]`."""
        rows = slice(*self.rows)
        return (rows,) if len(self.file_shape) < 2 else (rows, slice(*self.col_range))

    def take(self, array):
        """The shard of the file tensor `array` (a view)."""
        if tuple(array.shape) != self.file_shape:
            raise ValueError(f"{self.name}: expected the file tensor of shape {self.file_shape}, "
                             f"got {tuple(array.shape)}")
        return array[self.index]

    @property
    def scale_index(self) -> tuple[slice, slice] | None:
        """FP8 weights: the slice of `*.weight_scale_inv` whose blocks cover the shard (None: not quantized)."""
        if self.block is None:
            return None
        (bo, bi), (r0, r1), (c0, c1) = self.block, self.rows, self.col_range
        return slice(r0 // bo, -(-r1 // bo)), slice(c0 // bi, -(-c1 // bi))

    @property
    def scale_offset(self) -> tuple[int, int] | None:
        """FP8 weights: where the shard starts inside its first scale block (row, column): the shard's element
        (i, j) is scaled by scale_inv[scale_index][(i + row) // bo, (j + column) // bi]."""
        if self.block is None:
            return None
        return self.rows[0] % self.block[0], self.col_range[0] % self.block[1]


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Every checkpoint tensor's shard on one rank, in weight-table (file) order, and the shapes of the rank's
    fields (model_cls.field_shapes of the rank-local config; embed / lm_head with vocab_part rows)."""
    rank_config: RankConfig
    shards: tuple[Shard, ...]
    field_shapes: dict[str, tuple[int, ...]]
    vocab_padding: tuple[int, int] | None  # rows of the rank's embed / lm_head no checkpoint row fills: zero them

    @property
    def tp_size(self) -> int:
        return self.rank_config.tp_size

    @property
    def rank(self) -> int:
        return self.rank_config.rank

    @functools.cached_property
    def by_name(self) -> dict[str, Shard]:
        return {s.name: s for s in self.shards}

    def __getitem__(self, name: str) -> Shard:
        return self.by_name[name]


def _source(w, split: str, dim: str | None, part: str | None, rc: RankConfig, head_dim: int):
    """(rows, cols) of the file tensor that rank rc owns."""
    full_rows = (0, w.shape[0])
    if split == REPLICATED:
        return full_rows, None
    if split == VOCAB:
        return rc.vocab, None
    if dim == "num_attention_heads":
        if split == ROW:  # o_proj: the input columns of this rank's q heads
            return full_rows, (rc.q_heads[0] * head_dim, rc.q_heads[1] * head_dim)
        if part not in ("q", "k", "v"):
            raise ValueError(f"{w.name}: a {w.field} row range that is none of the q, k, v parts")
        heads = rc.q_heads if part == "q" else rc.kv_heads
        return (heads[0] * head_dim, heads[1] * head_dim), None
    span = rc.intermediate if dim == "intermediate_size" else rc.moe_intermediate
    return (span, None) if split == COLUMN else (full_rows, span)


def shard_plan(config, model_cls=None, tp_size: int = 1, rank: int = 0) -> ShardPlan:
    """Rank `rank`'s shard of every tensor of `model_cls.weight_table(config)` (model_cls None: the registry's class
    for this config). Validates first (rank_config's ValueErrors). At tp_size 1 every shard is the whole tensor at
    the single-GPU loader's destination."""
    model_cls = _model_class(config, model_cls)
    rc = rank_config(config, tp_size, rank, model_cls)
    local_table = {w.name: w for w in model_cls.weight_table(rc.config)}
    qkv_parts = {span: p for p, span in model_cls.part_rows(config).items() if p in ("q", "k", "v")}
    shards = []
    for w in model_cls.weight_table(config):
        split, dim = _rule(w.field, w.name)
        rows, cols = _source(w, split, dim, qkv_parts.get(w.rows) if w.field == "qkv" else None, rc,
                             config.head_dim)
        if rows[0] == rows[1]:  # a rank past the last token id (a vocabulary smaller than tp * vocab_part)
            continue
        local = local_table[w.name]
        dest = (0, rows[1] - rows[0]) if split == VOCAB else local.rows or (0, local.shape[0])
        shard = Shard(w.name, w.layer, w.field, split, w.shape, rows, cols, dest, w.block)
        if split != VOCAB and (shard.shape != local.shape or dest[1] - dest[0] != shard.shape[0]):
            raise RuntimeError(f"{w.name}: the {split} shard {shard.shape} disagrees with the rank-local weight table "
                               f"({local.shape} at rows {dest}) of {model_cls.__name__}")
        shards.append(shard)
    shapes = dict(model_cls.field_shapes(rc.config))
    for f in ("embed", "lm_head"):
        shapes[f] = (rc.vocab_part,) + tuple(shapes[f][1:])
    real = rc.vocab[1] - rc.vocab[0]
    return ShardPlan(rc, tuple(shards), shapes, (real, rc.vocab_part) if real < rc.vocab_part else None)
