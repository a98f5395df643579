"""Qwen3 model configuration: read from a Hugging Face `config.json`, validated on construction.

Presets (the real Qwen3 dense sizes plus a CI-sized `tiny`) build the same object, so a random checkpoint and a real
one go through one code path.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
PRESET_NAMES = ("tiny", "0.6b", "1.7b", "4b", "8b", "14b", "32b")

# The CI-sized model. vocab is the real Qwen3 one so the real tokenizer works end to end. head_dim 64 because the
# CUDA attention kernels support 64 and 128 only. hidden 64 with 4 q heads x 64 makes q_size (256) != hidden,
# which catches code that assumes head_dim == hidden / heads; 2 KV heads make GQA groups of 2 with more than one
# KV head (catches KV-head indexing bugs). intermediate 192 is not a power of two. Tied embeddings keep the file at
# one 151936 x 64 bf16 matrix (19 MB) plus ~0.5 MB of layers.
TINY_CONFIG: dict[str, Any] = {
    "architectures": [SUPPORTED_ARCHITECTURE],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "head_dim": 64,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def presets_dir() -> Path:
    """The folder holding the preset JSON files and the tokenizer (installed package or repo checkout)."""
    try:
        from importlib.resources import files

        p = Path(str(files("xserv.presets")))
        if (p / "generation_config.json").is_file():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    p = Path(__file__).resolve().parents[2] / "models" / "presets"
    if (p / "generation_config.json").is_file():
        return p
    raise FileNotFoundError("xserv presets not found (neither package xserv.presets nor models/presets/ in the repo)")


def preset_dict(name: str) -> dict[str, Any]:
    """The raw config.json dict of a preset ('tiny', '0.6b', ..., '32b'; a 'qwen3-' prefix is accepted)."""
    key = name.lower().removeprefix("qwen3-")
    if key == "tiny":
        return json.loads(json.dumps(TINY_CONFIG))
    if key not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESET_NAMES)}")
    return json.loads((presets_dir() / f"qwen3-{key}.json").read_text())


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _normalize_rope_scaling(rs) -> dict[str, Any] | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be null or an object, got {rs!r}")
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}: xserv supports none or 'yarn'")
    out = dict(rs)
    out.pop("type", None)
    out["rope_type"] = "yarn"
    factor = out.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ValueError(f"rope_scaling.factor must be a number >= 1 for yarn, got {factor!r}")
    out["factor"] = float(factor)
    ompe = out.get("original_max_position_embeddings")
    if ompe is not None:
        _positive_int("rope_scaling.original_max_position_embeddings", ompe)
    for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        v = out.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"rope_scaling.{k} must be a number, got {v!r}")
    return out


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list, hash=False)
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        rope_scaling = _normalize_rope_scaling(self.rope_scaling)
        if rope_scaling is not None and rope_scaling.get("original_max_position_embeddings") is None:
            # as transformers does: the pretraining context is the configured one unless the config says otherwise
            rope_scaling["original_max_position_embeddings"] = self.max_position_embeddings
        object.__setattr__(self, "rope_scaling", rope_scaling)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(SUPPORTED_DTYPES)}")
        if self.attention_bias:
            raise ValueError("attention_bias=true is not supported: Qwen3 attention projections have no bias")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}: Qwen3 uses 'silu'")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        object.__setattr__(self, "eos_token_id", _eos_list(self.eos_token_id))
        if self.bos_token_id is not None and (isinstance(self.bos_token_id, bool) or not isinstance(self.bos_token_id, int)):
            raise ValueError(f"bos_token_id must be an int or null, got {self.bos_token_id!r}")
        for t in self.eos_token_id + ([self.bos_token_id] if self.bos_token_id is not None else []):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"special token id {t} is outside the vocabulary (size {self.vocab_size})")

    # ---- derived sizes ------------------------------------------------------------------------------------
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
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        layer = h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * i + 2 * h + 2 * self.head_dim
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * layer + h

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face Qwen3ForCausalLM checkpoint of this config holds, name -> shape."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.q_size, h),
                p + "self_attn.k_proj.weight": (self.kv_size, h),
                p + "self_attn.v_proj.weight": (self.kv_size, h),
                p + "self_attn.o_proj.weight": (h, self.q_size),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    # ---- RoPE ---------------------------------------------------------------------------------------------
    def yarn_parameters(self) -> dict[str, float] | None:
        """YaRN settings resolved the way transformers resolves them (None without YaRN): factor,
        original_max_position_embeddings, beta_fast, beta_slow, attention_factor (the cos/sin scale)."""
        rs = self.rope_scaling
        if rs is None:
            return None
        factor = rs["factor"]
        ompe = rs.get("original_max_position_embeddings") or self.max_position_embeddings

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = rs.get("attention_factor")
        if attention_factor is None:
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                attention_factor = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)
        return {
            "factor": float(factor),
            "original_max_position_embeddings": int(ompe),
            "beta_fast": float(rs.get("beta_fast") or 32.0),
            "beta_slow": float(rs.get("beta_slow") or 1.0),
            "attention_factor": float(attention_factor),
            "truncate": bool(rs.get("truncate", True)),
        }

    def rope_inv_freq(self):
        """RoPE inverse frequencies, float32 [head_dim // 2], YaRN applied when configured (as transformers
        computes them). Multiply cos/sin by `rope_attention_factor`."""
        import numpy as np

        dim = self.head_dim
        pos_freqs = self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inv_freq = 1.0 / pos_freqs
        yarn = self.yarn_parameters()
        if yarn is None:
            return inv_freq.astype(np.float32)

        def correction_dim(num_rotations):
            return dim * math.log(yarn["original_max_position_embeddings"] / (num_rotations * 2 * math.pi)) / (
                2 * math.log(self.rope_theta))

        low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
        if yarn["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / yarn["factor"] * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq.astype(np.float32)

    @property
    def rope_attention_factor(self) -> float:
        yarn = self.yarn_parameters()
        return 1.0 if yarn is None else yarn["attention_factor"]

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        if not isinstance(d, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if archs is not None:
            if isinstance(archs, str):
                archs = [archs]
            other = [a for a in archs if a != SUPPORTED_ARCHITECTURE]
            if other or not archs:
                raise ValueError(f"unsupported architecture {', '.join(map(str, other)) or '(empty list)'}: "
                                 f"xserv supports {SUPPORTED_ARCHITECTURE}")
        elif d.get("model_type") not in (None, "qwen3"):
            raise ValueError(f"unsupported architecture (model_type {d.get('model_type')!r}): "
                             f"xserv supports {SUPPORTED_ARCHITECTURE}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"model config lacks required field(s): {', '.join(missing)}")
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
        dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(dtype, dtype)
        eps = d.get("rms_norm_eps", 1e-6)
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):  # transformers >= 5 layout
            rp = d["rope_parameters"]
            rope_theta = rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=1_000_000.0 if rope_theta is None else rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            dtype=dtype,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    @classmethod
    def from_json(cls, path) -> "Qwen3Config":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"model config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_pretrained(cls, folder) -> "Qwen3Config":
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
        return cls.from_json(folder / "config.json")

    @classmethod
    def preset(cls, name: str, **overrides) -> "Qwen3Config":
        d = preset_dict(name)
        d.update(overrides)
        return cls.from_dict(d)

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json dict for this config."""
        return {
            "architectures": [SUPPORTED_ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id) or None,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
