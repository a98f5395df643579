"""The engine: KV cache, batches, model runner, generation loop."""
