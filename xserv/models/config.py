"""What every dense decoder config shares: read from a Hugging Face `config.json`, validated on construction.

`DenseConfig` holds the fields the engine and the shared layers read (sizes, heads, RoPE, special tokens, context
length). An architecture subclasses it in its own module (`qwen3.py`, `llama.py`) and states only what differs: its
HF names, its defaults, the RoPE scalings it accepts and the HF fields it must reject. Presets are config.json files
in `xserv/presets/` (`<name>.json`; Qwen3's bare sizes like `0.6b` mean `qwen3-0.6b`), so a random checkpoint and a
real one go through one code path.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .fp8 import Fp8BlockQuantization

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
QWEN3_SIZES = ("0.6b", "1.7b", "4b", "8b", "14b", "32b")
QWEN3_MOE_SIZES = ("30b-a3b", "235b-a22b")
# the hybrid Gated DeltaNet models (xserv/models/qwen3_5.py): the real sizes, and a tiny one with their head shapes
HYBRID_PRESETS = ("qwen3.5-tiny", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.6-27b",
                  "qwen3.8-27b")
PRESET_NAMES = (("tiny",) + QWEN3_SIZES + ("llama3-tiny", "llama3-1b", "llama3-8b") + ("moe-tiny",)
                + QWEN3_MOE_SIZES + HYBRID_PRESETS)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def presets_dir() -> Path:
    """The folder holding the preset JSON files, generation_config.json and the tokenizer: the package xserv.presets,
    which ships with the wheel, so a checkout and an install read the same place."""
    return Path(__file__).resolve().parents[1] / "presets"


def preset_dict(name: str) -> dict[str, Any]:
    """The raw config.json dict of a preset: 'tiny', '0.6b' ... '32b' (Qwen3; a 'qwen3-' prefix is accepted),
    'moe-tiny', '30b-a3b', '235b-a22b' (Qwen3-MoE), 'llama3-tiny', 'llama3-1b', 'llama3-8b', and the hybrids
    'qwen3.5-tiny', 'qwen3.5-0.8b' ... 'qwen3.6-27b', 'qwen3.8-27b'."""
    key = name.lower()
    bare = key.removeprefix("qwen3-")
    if bare in ("tiny", "moe-tiny") or bare in QWEN3_SIZES + QWEN3_MOE_SIZES:  # bare names are Qwen3's
        key = f"qwen3-{bare}"
    elif key not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")
    return json.loads((presets_dir() / f"{key}.json").read_text())


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


# The numeric fields each scaled RoPE needs (checked here; xserv.ops.rope.rope_inv_freq computes with them) and the
# optional ones it may carry.
_ROPE_REQUIRED = {"yarn": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}
_ROPE_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"), "llama3": ()}


# quant_method values of Hugging Face configs that xserv recognises but cannot load (named in the error)
_UNSUPPORTED_QUANT_METHODS = ("awq", "gptq", "bitsandbytes", "compressed-tensors", "fbgemm_fp8", "torchao", "hqq",
                              "eetq", "aqlm", "quanto", "higgs", "vptq", "bitnet", "spqr", "mxfp4", "quark",
                              "auto-round", "gguf", "modelopt", "marlin", "exl2")


def parse_quantization_config(value) -> Fp8BlockQuantization | None:
    """None for an unquantized checkpoint; the validated FP8 settings for quant_method "fp8" (fine-grained e4m3
    blocks, dynamic activations); a ValueError naming the method or the field for anything else."""
    if value is None or isinstance(value, Fp8BlockQuantization):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"quantization_config must be an object or null, got {value!r}")
    method = value.get("quant_method")
    if method == Fp8BlockQuantization.QUANT_METHOD:
        return Fp8BlockQuantization.from_dict(value)
    if method is None:
        raise ValueError("quantization_config has no quant_method: xserv loads unquantized checkpoints and "
                         "fine-grained FP8 ones (quant_method 'fp8')")
    known = " (a format xserv does not implement)" if str(method).lower() in _UNSUPPORTED_QUANT_METHODS else ""
    raise ValueError(f"quantization_config.quant_method={method!r} is not supported{known}: xserv loads unquantized "
                     f"checkpoints and fine-grained FP8 ones (quant_method 'fp8', e4m3 weights with "
                     f"weight_block_size, dynamic activations)")


def normalize_rope_scaling(rs, supported: tuple[str, ...], max_position_embeddings: int) -> dict[str, Any] | None:
    """None for plain RoPE, else a copy with 'rope_type' set and its numbers checked. A YaRN config without
    original_max_position_embeddings gets max_position_embeddings (as transformers does)."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be null or an object, got {rs!r}")
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in supported:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: this architecture supports none or "
                         f"{', '.join(repr(t) for t in supported)}")
    out = {k: v for k, v in rs.items() if k != "type"}
    out["rope_type"] = rope_type
    for key in _ROPE_REQUIRED[rope_type]:
        if out.get(key) is None:
            raise ValueError(f"rope_scaling.{key} is required for {rope_type}")
    for key in _ROPE_REQUIRED[rope_type] + _ROPE_OPTIONAL[rope_type]:
        if out.get(key) is not None:
            out[key] = _number(f"rope_scaling.{key}", out[key])
    if out["factor"] < 1:
        raise ValueError(f"rope_scaling.factor must be >= 1, got {out['factor']!r}")
    ompe = out.get("original_max_position_embeddings")
    if ompe is None:
        ompe = max_position_embeddings
    if ompe != int(ompe):
        raise ValueError(f"rope_scaling.original_max_position_embeddings must be an integer, got {ompe!r}")
    out["original_max_position_embeddings"] = positive_int("rope_scaling.original_max_position_embeddings", int(ompe))
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError("rope_scaling.high_freq_factor must be larger than low_freq_factor")
    return out


@dataclass(frozen=True)
class DenseConfig:
    """A dense decoder-only transformer: pre-norm RMSNorm blocks, GQA attention with rotate-half RoPE, SwiGLU MLP.
    Subclasses set the class-level settings below; the instance fields are the same for every architecture."""

    ARCHITECTURE: ClassVar[str] = ""  # the Hugging Face `architectures[0]` name
    MODEL_TYPE: ClassVar[str] = ""
    ROPE_SCALINGS: ClassVar[tuple[str, ...]] = ()  # rope_type values accepted besides plain RoPE
    DEFAULTS: ClassVar[dict[str, Any]] = {}  # HF fields' defaults where the architecture's differ from HF's
    REJECT_TRUE: ClassVar[tuple[str, ...]] = ("attention_bias",)  # HF flags xserv does not implement

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list, hash=False)
    initializer_range: float = 0.02
    # quant_method "fp8" (fine-grained e4m3 blocks): the weights are dequantized at load (xserv/models/fp8.py)
    quantization_config: Fp8BlockQuantization | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rope_scaling", normalize_rope_scaling(self.rope_scaling, self.ROPE_SCALINGS,
                                                                        self.max_position_embeddings))
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(SUPPORTED_DTYPES)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        object.__setattr__(self, "eos_token_id", _eos_list(self.eos_token_id))
        if self.bos_token_id is not None and (isinstance(self.bos_token_id, bool) or not isinstance(self.bos_token_id, int)):
            raise ValueError(f"bos_token_id must be an int or null, got {self.bos_token_id!r}")
        for t in self.eos_token_id + ([self.bos_token_id] if self.bos_token_id is not None else []):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"special token id {t} is outside the vocabulary (size {self.vocab_size})")
        object.__setattr__(self, "quantization_config", parse_quantization_config(self.quantization_config))

    # ---- derived sizes (the one place they are derived) ------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, or with YaRN factor x the original
        length when that is longer (Llama 3's scaling is already counted in its max_position_embeddings)."""
        rs = self.rope_scaling
        if rs is None or rs["rope_type"] != "yarn":
            return self.max_position_embeddings
        return max(self.max_position_embeddings, int(rs["factor"] * rs["original_max_position_embeddings"]))

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DenseConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if archs is not None:
            archs = [archs] if isinstance(archs, str) else archs
            other = [a for a in archs if a != cls.ARCHITECTURE]
            if other or not archs:
                raise ValueError(f"unsupported architecture {', '.join(map(str, other)) or '(empty list)'} for "
                                 f"{cls.__name__}, which reads {cls.ARCHITECTURE}")
        elif d.get("model_type") not in (None, cls.MODEL_TYPE):
            raise ValueError(f"unsupported architecture (model_type {d.get('model_type')!r}) for {cls.__name__}, "
                             f"which reads {cls.ARCHITECTURE}")
        d = dict(d)
        if d.get("rope_theta") is None and isinstance(d.get("rope_parameters"), dict):  # transformers >= 5 layout
            rp = d["rope_parameters"]
            d["rope_theta"] = rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default" and d.get("rope_scaling") is None:
                d["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        # the architecture's defaults fill fields that are absent or null
        d = {**cls.DEFAULTS, **{k: v for k, v in d.items() if v is not None or k not in cls.DEFAULTS}}
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"model config lacks required field(s): {', '.join(missing)}")
        for flag in cls.REJECT_TRUE:
            if d.get(flag):
                raise ValueError(f"{flag}=true is not supported: xserv's {cls.ARCHITECTURE} has no bias terms")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: xserv implements the 'silu' (SwiGLU) MLP")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not isinstance(heads, int) or heads < 1 or d["hidden_size"] % heads:
                raise ValueError("model config has no head_dim and hidden_size is not a multiple of num_attention_heads")
            head_dim = d["hidden_size"] // heads
        dtype = d.get("torch_dtype", d.get("dtype")) or "bfloat16"
        if not isinstance(dtype, str):
            raise ValueError(f"dtype must be a string, got {dtype!r}")
        dtype = dtype.removeprefix("torch.")
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        rope_theta = d.get("rope_theta")
        defaults = {f.name: f.default for f in dataclasses.fields(DenseConfig) if f.default is not dataclasses.MISSING}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", defaults["rms_norm_eps"]),
            rope_theta=defaults["rope_theta"] if rope_theta is None else rope_theta,
            rope_scaling=d.get("rope_scaling"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", defaults["max_position_embeddings"]),
            dtype=dtype,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
            quantization_config=d.get("quantization_config"),
        )

    @classmethod
    def from_json(cls, path) -> "DenseConfig":
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_pretrained(cls, folder) -> "DenseConfig":
        return cls.from_json(config_json_path(folder))

    @classmethod
    def preset(cls, name: str, **overrides) -> "DenseConfig":
        d = preset_dict(name)
        d.update(overrides)
        return cls.from_dict(d)

    def replace(self, **changes) -> "DenseConfig":
        return dataclasses.replace(self, **changes)

    def hf_extra_fields(self) -> dict[str, Any]:
        """Fields of the architecture's config.json that xserv does not read but transformers expects."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json dict for this config."""
        eos = self.eos_token_id
        quantization = {"quantization_config": self.quantization_config.to_dict()} if self.quantization_config else {}
        return {
            "architectures": [self.ARCHITECTURE],
            "model_type": self.MODEL_TYPE,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos) or None,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            **self.hf_extra_fields(),
            **quantization,
        }


def config_json_path(folder) -> Path:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    return folder / "config.json"


def read_config_json(path) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model config not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
