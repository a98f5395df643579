"""Tensor parallelism: the sharding arithmetic (`sharding.py`: which part of every checkpoint tensor each
rank owns), the shard loader (`load.py`), the collectives (`comm.py`: NCCL on CUDA, shared memory on the CPU) and the
worker processes (`group.py`: rank 0's TPGroup, the step channel, failure handling). `LLM(tensor_parallel_size=N)`
uses them; docs/engine.md, "Tensor parallelism", describes the whole."""
from .load import dequantize_shard, load_shard, shard_from_checkpoint
from .sharding import (COLUMN, KERNEL_MULTIPLE, REPLICATED, ROW, VOCAB, VOCAB_PART_MULTIPLE, RankConfig, Shard,
                       ShardPlan, check_tp, rank_config, shard_plan, valid_tp_sizes, vocab_part_size)

__all__ = ["COLUMN", "KERNEL_MULTIPLE", "REPLICATED", "ROW", "VOCAB", "VOCAB_PART_MULTIPLE", "RankConfig", "Shard",
           "ShardPlan", "check_tp", "dequantize_shard", "load_shard", "rank_config", "shard_from_checkpoint",
           "shard_plan", "valid_tp_sizes", "vocab_part_size"]
