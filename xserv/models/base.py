"""What a model must provide to the engine (docs/models.md says the same in prose).

The engine and its builder (`xserv.engine_builder`) use a model only through these two protocols;
`xserv.models.registry` maps a Hugging Face `architectures[0]` name to the classes that implement them. Nothing here is imported at run time by the engine:
the protocols are the written contract, checked by the tests (`isinstance(model, CausalLM)`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable


class KVLayout(NamedTuple):
    """The paged KV cache a model needs: one K and one V pool per layer of [blocks, block_size, kv_heads, head_dim]
    (the engine adds the block size: `KVCacheSpec(*model.kv_layout, block_size)`)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int


class StatePool(NamedTuple):
    """Per-sequence state a model keeps besides the paged KV cache (xserv/engine/state_cache.py): `layers` tensors
    of `shape` and `dtype` for every sequence (a hybrid model's GDN layers: the conv window and the SSM state)."""
    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: Any


@runtime_checkable
class ModelConfig(Protocol):
    """The fields of a config that code outside the model reads."""
    ARCHITECTURE: str  # the Hugging Face architectures[0] name this config class reads
    vocab_size: int  # logits width; token ids must lie in [0, vocab_size)
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    eos_token_id: list[int]  # from config.json; the engine adds the tokenizer's / generation_config's
    bos_token_id: int | None

    @property
    def context_length(self) -> int: ...  # the longest sequence the model takes (positions 0 .. context_length-1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig": ...

    def to_dict(self) -> dict[str, Any]: ...  # a Hugging Face config.json


@runtime_checkable
class CausalLM(Protocol):
    """A loaded model. `forward` is the only hot-path call; it must allocate nothing when given a workspace that
    fits (the engine captures it in CUDA graphs)."""
    config: ModelConfig
    device: str  # "cuda" or "cpu"
    dtype: Any  # the weights' and the KV cache's element type (NumPy dtype, bf16 today)
    kv_layout: KVLayout
    # Per-sequence state pools (empty for a model whose every layer keeps paged KV). A model with state gets them as
    # `kv_cache.state` (a StateCache: `kv_cache.state[name][layer]`) and a batch's `state_slots`; prefix caching is
    # off for it (a cached prefix would need the state at its end).
    state_layout: tuple[StatePool, ...]

    @classmethod
    def weight_table(cls, config) -> list: ...  # every checkpoint tensor: HF name, shape, where it goes

    @classmethod
    def from_checkpoint(cls, config, reader, device: str = "cuda", progress: bool = True,
                        max_positions: int | None = None, dtype=None) -> "CausalLM": ...

    @classmethod
    def kernel_shapes(cls, config, tp_size: int = 1) -> dict[str, int]: ...  # the kernel pieces a start-up compiles

    @classmethod
    def fp8_load_notice(cls, config) -> str | None: ...  # a line for the user when FP8 weights load dequantized

    def make_workspace(self, max_tokens: int, max_logits: int) -> Any: ...

    def forward(self, batch, kv_cache, workspace=None) -> Any:
        """batch: xserv.engine.batch.Batch (packed tokens, positions, block tables, slot mapping, state slots,
        logits rows);
        kv_cache: per layer `k[i]`, `v[i]` pools laid out as `kv_layout` says. Returns float32 logits
        [rows, vocab_size] (a view into the workspace)."""
        ...

    def weight_bytes(self) -> int: ...
