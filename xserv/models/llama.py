"""Llama 3 (`LlamaForCausalLM`): the shared dense decoder without q/k head norms, with Llama 3's RoPE scaling
(`rope_type: "llama3"`). `head_dim` may be absent (hidden_size / heads); projection biases are rejected."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import DenseConfig
from .dense import DENSE_LAYER_WEIGHTS, DenseModel


@dataclass(frozen=True)
class LlamaConfig(DenseConfig):
    ARCHITECTURE = "LlamaForCausalLM"
    MODEL_TYPE = "llama"
    ROPE_SCALINGS = ("llama3",)
    DEFAULTS = {"rope_theta": 10_000.0, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6}
    REJECT_TRUE = ("attention_bias", "mlp_bias")

    def hf_extra_fields(self) -> dict[str, Any]:
        return {"mlp_bias": False, "pretraining_tp": 1}


class LlamaModel(DenseModel):
    LAYER_WEIGHTS = DENSE_LAYER_WEIGHTS
    QK_NORM = False
