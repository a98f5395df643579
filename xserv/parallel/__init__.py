"""Tensor parallelism (issue 32, planned). What exists: the sharding arithmetic (`sharding.py`: which part of every
checkpoint tensor each rank owns) and the shard loader (`load.py`: one rank's model from the memory-mapped
checkpoint, its shards only). Nothing in the engine uses them yet; docs/engine.md, "Tensor parallelism", says what
is planned around them."""
from .load import dequantize_shard, load_shard, shard_from_checkpoint
from .sharding import (COLUMN, KERNEL_MULTIPLE, REPLICATED, ROW, VOCAB, VOCAB_PART_MULTIPLE, RankConfig, Shard,
                       ShardPlan, check_tp, rank_config, shard_plan, valid_tp_sizes, vocab_part_size)

__all__ = ["COLUMN", "KERNEL_MULTIPLE", "REPLICATED", "ROW", "VOCAB", "VOCAB_PART_MULTIPLE", "RankConfig", "Shard",
           "ShardPlan", "check_tp", "dequantize_shard", "load_shard", "rank_config", "shard_from_checkpoint",
           "shard_plan", "valid_tp_sizes", "vocab_part_size"]
