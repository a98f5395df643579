"""Hugging Face `architectures[0]` name -> (config class, model class). Adding a model = a module with those two
classes (see docs/models.md for what they must provide) and one line here."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import CheckpointReader
from .config import DenseConfig, config_json_path, read_config_json
from .dense import DenseModel
from .llama import LlamaConfig, LlamaModel
from .qwen3 import Qwen3Config, Qwen3Model
from .qwen3_5 import HybridModel, Qwen3_5Config, Qwen3_5TextConfig, Qwen3NextConfig
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel

ARCHITECTURES: dict[str, tuple[type[DenseConfig], type[DenseModel]]] = {
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3Model),
    "LlamaForCausalLM": (LlamaConfig, LlamaModel),
    "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeModel),
    "Qwen3_5ForConditionalGeneration": (Qwen3_5Config, HybridModel),
    "Qwen3_5ForCausalLM": (Qwen3_5TextConfig, HybridModel),
    "Qwen3NextForCausalLM": (Qwen3NextConfig, HybridModel),
}


def _known() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def architecture_of(d: dict[str, Any]) -> str:
    """The registered architecture a config.json dict names (its `architectures`, else its `model_type`)."""
    if not isinstance(d, dict):
        raise ValueError(f"a model config must be a JSON object, got {type(d).__name__}")
    archs = d.get("architectures")
    if archs is not None:
        archs = [archs] if isinstance(archs, str) else archs
        if not isinstance(archs, list) or not archs:
            raise ValueError(f"config.json 'architectures' must be a non-empty list, got {d.get('architectures')!r}")
        if len(archs) > 1 or archs[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {', '.join(map(str, archs))}: xserv supports {_known()}")
        return archs[0]
    by_type = {config_cls.MODEL_TYPE: name for name, (config_cls, _) in ARCHITECTURES.items()}
    model_type = d.get("model_type")
    if model_type is None:
        raise ValueError(f"config.json names no architecture (neither 'architectures' nor 'model_type'); "
                         f"xserv supports {_known()}")
    if model_type not in by_type:
        raise ValueError(f"unsupported architecture (model_type {model_type!r}): xserv supports {_known()}")
    return by_type[model_type]


def config_from_dict(d: dict[str, Any]) -> DenseConfig:
    """The config object of the architecture the dict names."""
    config_cls, _ = ARCHITECTURES[architecture_of(d)]
    return config_cls.from_dict(d)


def config_from_pretrained(folder) -> DenseConfig:
    """The config of a Hugging Face model folder (its config.json), whatever its registered architecture."""
    return config_from_dict(read_config_json(config_json_path(folder)))


def model_class(config) -> type[DenseModel]:
    """The model class that runs a config (an instance of a registered config class)."""
    for config_cls, model_cls in ARCHITECTURES.values():
        if type(config) is config_cls:
            return model_cls
    raise ValueError(f"{type(config).__name__} is not a registered model config; xserv supports {_known()}")


def load_model(folder, device: str = "cuda", progress: bool = True, max_positions: int | None = None,
               dtype=None, config=None) -> DenseModel:
    """Read a Hugging Face model folder's config and weights into the registered model class."""
    config = config if config is not None else config_from_pretrained(folder)
    with CheckpointReader(Path(folder)) as reader:
        return model_class(config).from_checkpoint(config, reader, device, progress=progress,
                                                   max_positions=max_positions, dtype=dtype)
