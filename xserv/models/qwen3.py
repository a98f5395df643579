"""Qwen3 (dense, `Qwen3ForCausalLM`): the shared dense decoder with a head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import DenseConfig
from .dense import DENSE_LAYER_WEIGHTS, QK_NORM_WEIGHTS, DenseModel


@dataclass(frozen=True)
class Qwen3Config(DenseConfig):
    ARCHITECTURE = "Qwen3ForCausalLM"
    MODEL_TYPE = "qwen3"
    ROPE_SCALINGS = ("yarn",)
    DEFAULTS = {"rope_theta": 1_000_000.0, "max_position_embeddings": 40960}

    def hf_extra_fields(self) -> dict[str, Any]:
        return {"max_window_layers": self.num_hidden_layers, "sliding_window": None, "use_sliding_window": False}


class Qwen3Model(DenseModel):
    LAYER_WEIGHTS = DENSE_LAYER_WEIGHTS + QK_NORM_WEIGHTS
    QK_NORM = True
