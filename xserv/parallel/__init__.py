"""Tensor parallelism (issue 32, planned). Today only the sharding arithmetic exists (`sharding.py`): which part of
every checkpoint tensor each rank owns. Nothing in the engine uses it yet; docs/engine.md, "Tensor parallelism",
says what is planned around it."""
from .sharding import (COLUMN, KERNEL_MULTIPLE, REPLICATED, ROW, VOCAB, VOCAB_PART_MULTIPLE, RankConfig, Shard,
                       ShardPlan, check_tp, rank_config, shard_plan, valid_tp_sizes, vocab_part_size)

__all__ = ["COLUMN", "KERNEL_MULTIPLE", "REPLICATED", "ROW", "VOCAB", "VOCAB_PART_MULTIPLE", "RankConfig", "Shard",
           "ShardPlan", "check_tp", "rank_config", "shard_plan", "valid_tp_sizes", "vocab_part_size"]
