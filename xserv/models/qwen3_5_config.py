"""The configs of the hybrid Gated DeltaNet decoders: Qwen3.5 / 3.6 / 3.8 (`Qwen3_5ForConditionalGeneration`, whose
config.json nests the text model under `text_config` beside a vision tower's), their text-only export
(`Qwen3_5ForCausalLM`, flat, model_type `qwen3_5_text`) and Qwen3-Next (`Qwen3NextForCausalLM`, flat).

Which layer is which comes from `layer_types` ("linear_attention": Gated DeltaNet, "full_attention": gated softmax
attention), or, when a config has none, from `full_attention_interval` as transformers builds it (layer i is full
attention iff (i + 1) % interval == 0). Only the text model is read: the vision tower's fields are kept as they are
so that a config round-trips (make-test-model writes it back), and mrope reduces to plain RoPE for text positions
(../shared/qwen3.5/ARCHITECTURE.md, section 4.5).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .config import DenseConfig, positive_int

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
_GDN_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads")
# Fields of the MoE variants (Qwen3.5-MoE, Qwen3-Next's sparse layers): their sparse block is not implemented here.
_MOE_FIELDS = ("num_experts", "num_local_experts")


def _layer_schedule(d: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
        interval = d.get("full_attention_interval", 4)
        positive_int("full_attention_interval", interval)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"layer_types must list one entry per layer ({num_layers}), got {types!r}")
    bad = sorted({t for t in types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)}, key=str)
    if bad:
        raise ValueError(f"layer_types holds {bad!r}: each entry must be {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
    return tuple(types)


@dataclass(frozen=True)
class HybridConfig(DenseConfig):
    """The text decoder shared by the three architectures. `outer`: the config.json fields outside the text model
    (vision tower, image token ids, ...), kept for to_dict."""
    ARCHITECTURE: ClassVar[str] = ""
    MODEL_TYPE: ClassVar[str] = ""
    TEXT_MODEL_TYPE: ClassVar[str] = ""
    NESTED: ClassVar[bool] = False  # config.json nests the text model under text_config
    DEFAULTS = {"rope_theta": 10_000_000.0, "max_position_embeddings": 262144, "head_dim": 256}

    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    partial_rotary_factor: float = 0.25
    mtp_num_hidden_layers: int = 0
    outer: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    text_extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.quantization_config is not None:
            raise ValueError(f"{self.ARCHITECTURE} with a quantization_config (an FP8 release) is not supported yet: "
                             f"load the bfloat16 checkpoint")
        for name in _GDN_FIELDS:
            positive_int(name, getattr(self, name))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if not self.layer_types:  # transformers' default schedule: every fourth layer full attention
            object.__setattr__(self, "layer_types", _layer_schedule({}, self.num_hidden_layers))
        object.__setattr__(self, "layer_types", _layer_schedule({"layer_types": self.layer_types},
                                                                self.num_hidden_layers))
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        rot = self.rotary_dim
        if rot % 2 or rot != self.head_dim * f:
            raise ValueError(f"head_dim * partial_rotary_factor must be an even integer, got {self.head_dim} * {f}")

    # ---- derived sizes --------------------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_proj_size(self) -> int:
        """Columns of a GDN layer's fused input projection: [qkv | z | b | a]."""
        return self.conv_dim + self.value_dim + 2 * self.linear_num_value_heads

    @property
    def qkvg_size(self) -> int:
        """Columns of an attention layer's fused projection: [q | k | v | gate]."""
        return 2 * self.q_size + 2 * self.kv_size

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    # ---- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HybridConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(d).__name__}")
        outer, text = cls._split(d)
        for name in _MOE_FIELDS:
            if text.get(name):
                raise ValueError(f"{name}={text[name]!r}: the mixture-of-experts layers of this architecture are not "
                                 f"supported yet (xserv runs its dense-MLP models)")
        # the base parser checks the architecture against ARCHITECTURE / MODEL_TYPE of the outer dict
        flat = {**text, "architectures": outer.get("architectures"), "model_type": cls.MODEL_TYPE}
        if outer.get("quantization_config") is not None:  # a multimodal release quantizes at the top level
            flat["quantization_config"] = outer["quantization_config"]
        if flat["architectures"] is None:
            flat.pop("architectures")
        rp = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
        # mrope (interleaved T/H/W sections) is plain RoPE for text: every row of positions is the token index
        flat["rope_parameters"] = {k: v for k, v in rp.items() if k not in ("mrope_section", "mrope_interleaved")}
        flat["rope_parameters"].setdefault("rope_type", "default")
        base = super().from_dict(flat)
        extra = {name: text.get(name, getattr(cls, name)) for name in _GDN_FIELDS}
        factor = text.get("partial_rotary_factor", rp.get("partial_rotary_factor", 0.25))
        tie = outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        text_extra = {k: v for k, v in text.items() if k in ("output_gate_type", "mamba_ssm_dtype",
                                                             "mtp_use_dedicated_embeddings", "attn_output_gate")}
        if text.get("attn_output_gate", True) is not True:
            raise ValueError("attn_output_gate=false is not supported: the gated attention layers of these models "
                             "always gate their output")
        return base.replace(
            layer_types=_layer_schedule(text, base.num_hidden_layers),
            partial_rotary_factor=factor, tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0),
            outer={k: v for k, v in outer.items() if k not in ("architectures", "model_type", "text_config",
                                                               "tie_word_embeddings")},
            text_extra=text_extra, **extra)

    @classmethod
    def _split(cls, d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(outer fields, text model fields) of a config.json dict."""
        if cls.NESTED:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"a {cls.ARCHITECTURE} config needs a text_config object")
            return d, dict(text)
        return d, dict(d)

    def text_fields(self) -> dict[str, Any]:
        """The text model's config.json fields."""
        d = super().to_dict()
        for name in ("architectures", "rope_scaling", "rope_theta", "torch_dtype"):
            d.pop(name, None)
        d.update({name: getattr(self, name) for name in _GDN_FIELDS})
        d.update(model_type=self.TEXT_MODEL_TYPE, dtype=self.dtype, layer_types=list(self.layer_types),
                 full_attention_interval=self._interval(), partial_rotary_factor=self.partial_rotary_factor,
                 mtp_num_hidden_layers=self.mtp_num_hidden_layers,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor,
                                  "mrope_interleaved": True, "mrope_section": self._mrope_section()},
                 **{"attn_output_gate": True, **self.text_extra})
        return d

    def _interval(self) -> int:
        full = self.attention_layers
        return full[0] + 1 if full else self.num_hidden_layers + 1

    def _mrope_section(self) -> list[int]:
        """Qwen3.5's T/H/W split of the rotary frequencies ([11, 11, 10] for 32), scaled to this rotary_dim."""
        half = self.rotary_dim // 2
        h = w = round(half * 11 / 32)
        return [half - h - w, h, w]

    def to_dict(self) -> dict[str, Any]:
        text = self.text_fields()
        if not self.NESTED:
            return {**text, "architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE, **self.outer}
        return {"architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE, **self.outer,
                "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}


@dataclass(frozen=True)
class Qwen3_5Config(HybridConfig):
    """Qwen3.5 / 3.6 / 3.8 as released: the multimodal checkpoint, text path under model.language_model."""
    ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
    MODEL_TYPE = "qwen3_5"
    TEXT_MODEL_TYPE = "qwen3_5_text"
    NESTED = True


@dataclass(frozen=True)
class Qwen3_5TextConfig(HybridConfig):
    """A text-only export of the same decoder (weights under model.*)."""
    ARCHITECTURE = "Qwen3_5ForCausalLM"
    MODEL_TYPE = "qwen3_5_text"
    TEXT_MODEL_TYPE = "qwen3_5_text"


@dataclass(frozen=True)
class Qwen3NextConfig(HybridConfig):
    """Qwen3-Next: the same decoder with grouped input projections (un-grouped at load). Its released sizes are
    mixture-of-experts models; a config whose every layer has the dense MLP (mlp_only_layers) loads here."""
    ARCHITECTURE = "Qwen3NextForCausalLM"
    MODEL_TYPE = "qwen3_next"
    TEXT_MODEL_TYPE = "qwen3_next"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3NextConfig":
        if isinstance(d, dict) and d.get("num_experts"):
            layers = d.get("num_hidden_layers")
            dense = set(d.get("mlp_only_layers") or ())
            if not isinstance(layers, int) or dense != set(range(layers)):
                raise ValueError(f"num_experts={d['num_experts']!r}: Qwen3-Next's mixture-of-experts layers are not "
                                 f"supported yet (xserv runs Qwen3-Next configs whose every layer is in mlp_only_layers)")
            d = {k: v for k, v in d.items() if k != "num_experts"}
        return super().from_dict(d)
