"""Qwen3: configuration, checkpoint reading, random test checkpoints."""
