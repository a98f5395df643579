"""Qwen3 mixture of experts (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder with the MLP of
its sparse layers replaced by a routed mixture of SwiGLU experts (xserv.ops.moe.moe_experts).

A layer i is sparse iff `i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`
(transformers' Qwen3MoeDecoderLayer); the others keep Qwen3's dense MLP of width `intermediate_size`. A sparse
layer's checkpoint holds the router `mlp.gate.weight` [E, H] and per expert e `mlp.experts.{e}.gate_proj.weight`
[I, H], `up_proj` [I, H], `down_proj` [H, I] (I = moe_intermediate_size). They are loaded, each straight from the
memory-mapped file into its rows, into two stacked tensors per layer: `experts_gate_up` [E * 2I, H] (expert e's gate
rows at e*2I, its up rows at e*2I + I: each expert in the dense MLP's fused layout) and `experts_down` [E * H, I]
(expert e's rows at e*H), which the op reads as [E, 2I, H] and [E, H, I] views. A -FP8 checkpoint is dequantized
to bf16 at load by default (on an H100 the bf16 one-token kernels are faster and offline as fast: docs/kernels/moe.md,
"FP8 experts"); with XSERV_FP8_EXPERTS=e4m3 its projections stay e4m3 with their 128 x 128 block scales (an
Fp8Weight per field, half the memory; the op's FP8 expert GEMMs give the dequantized experts' bits), the experts where
H and I are multiples of 128.

The forward is the dense one (xserv/models/dense.py) with its MLP hooks overridden: the unfused path stores the
block's bf16 output where a dense MLP stores its down projection; the fused one-token path projects o, adds it and
normalises with the unfused ops' kernels (a GEMV, fused_add_rmsnorm), and lets moe_experts add its bf16-rounded
output into the fp32 residual. Both round where a dense layer rounds.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from ..ops.moe import MAX_EXPERTS, MAX_TOP_K, expected_touched_experts, moe_experts, moe_workspace
from ..ops.rmsnorm import fused_add_rmsnorm
from ..tensor import Tensor
from .config import positive_int
from .dense import DENSE_LAYER_WEIGHTS, QK_NORM_WEIGHTS, DenseModel, Workspace
from ..fp8_format import DEFAULT_BLOCK, Fp8Weight
from .qwen3 import Qwen3Config, Qwen3Model

# transformers' Qwen3MoeConfig defaults, for the fields a config.json may leave out
_HF_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
# MoE variants other architectures have that this block does not implement: count fields that must be absent or 0
_SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
_ROUTING = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy")}


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    ARCHITECTURE = "Qwen3MoeForCausalLM"
    MODEL_TYPE = "qwen3_moe"
    # router / expert biases (and the score-correction bias of biased top-k routing) are not implemented
    REJECT_TRUE = ("attention_bias", "mlp_bias", "router_bias", "moe_router_bias", "expert_bias", "use_expert_bias",
                   "moe_expert_bias", "e_score_correction_bias")

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be an integer in 1..{MAX_EXPERTS}, got {e!r} (a Qwen3-MoE config "
                             f"without experts is a dense Qwen3: Qwen3ForCausalLM)")
        k = self.num_experts_per_tok
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(e, MAX_TOP_K):
            raise ValueError(f"num_experts_per_tok must be an integer in 1..{min(e, MAX_TOP_K)} "
                             f"(num_experts {e}, at most {MAX_TOP_K}), got {k!r}")
        positive_int("moe_intermediate_size", self.moe_intermediate_size)
        positive_int("decoder_sparse_step", self.decoder_sparse_step)
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 8:
                raise ValueError(f"{name} must be a multiple of 8 for the MoE kernels, got {getattr(self, name)}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        layers = self.mlp_only_layers
        if not isinstance(layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(f"mlp_only_layers must be a list of layer indices in 0..{self.num_hidden_layers - 1}, "
                             f"got {layers!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))

    # ---- the layer rule ----------------------------------------------------------------------------------------
    def is_sparse_layer(self, i: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule: the MoE block, else the dense MLP of intermediate_size."""
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    @property
    def has_dense_layers(self) -> bool:
        return len(self.sparse_layers) < self.num_hidden_layers

    # ---- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3MoeConfig":
        if isinstance(d, dict):
            _reject_unsupported_moe(d)
        base = super().from_dict(d)  # the architecture check and the dense fields (MoE fields at their defaults)
        moe = {k: d.get(k) if d.get(k) is not None else v for k, v in _HF_DEFAULTS.items()}
        if d.get("num_experts") is None and d.get("num_local_experts") is not None:  # transformers >= 5 alias
            moe["num_experts"] = d["num_local_experts"]
        layers = moe["mlp_only_layers"]
        if isinstance(layers, list):
            moe["mlp_only_layers"] = tuple(layers)
        return base.replace(**moe)

    def hf_extra_fields(self) -> dict[str, Any]:
        return {**super().hf_extra_fields(),
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001}


def _reject_unsupported_moe(d: dict[str, Any]) -> None:
    """A clear error naming the field for the MoE variants of other architectures (shared experts, biased or
    non-softmax routing, grouped top-k, scaled routing weights)."""
    for name in _SHARED_EXPERT_FIELDS:
        if d.get(name):
            raise ValueError(f"{name}={d[name]!r} is not supported: xserv's {Qwen3MoeConfig.ARCHITECTURE} has no "
                             f"shared experts")
    for name, allowed in _ROUTING.items():
        if d.get(name) not in allowed:
            raise ValueError(f"{name}={d[name]!r} is not supported: xserv's {Qwen3MoeConfig.ARCHITECTURE} routes by a "
                             f"softmax over the router logits and a plain top-k")
    for name in ("n_group", "topk_group"):
        if d.get(name) not in (None, 0, 1):
            raise ValueError(f"{name}={d[name]!r} is not supported: xserv's {Qwen3MoeConfig.ARCHITECTURE} has no "
                             f"group-limited routing")
    if d.get("routed_scaling_factor") not in (None, 1, 1.0):
        raise ValueError(f"routed_scaling_factor={d['routed_scaling_factor']!r} is not supported: xserv's "
                         f"{Qwen3MoeConfig.ARCHITECTURE} does not scale the routing weights")


# ---- weights -----------------------------------------------------------------------------------------------------
@dataclass
class Qwen3MoeLayer:
    """A layer's weights: the attention ones, and either the dense MLP's (mlp_only layers) or the router and the
    stacked experts (sparse layers)."""
    input_norm: Tensor  # [H]
    qkv: Tensor  # [q_size + 2 * kv_size, H]
    o_proj: Tensor  # [H, q_size]
    post_norm: Tensor  # [H]
    q_norm: Tensor | None = None  # [D]
    k_norm: Tensor | None = None  # [D]
    gate_up: Tensor | None = None  # dense layers: [2 * intermediate_size, H]
    down: Tensor | None = None  # dense layers: [H, intermediate_size]
    router: Tensor | None = None  # sparse layers: [E, H]
    # [E * 2I, H]: expert e's gate rows at e*2I, its up rows at e*2I + I; [E * H, I]: expert e's rows at e*H (FP8:
    # an Fp8Weight of those shapes)
    experts_gate_up: Tensor | Fp8Weight | None = None
    experts_down: Tensor | Fp8Weight | None = None


_ATTENTION_WEIGHTS = tuple(w for w in DENSE_LAYER_WEIGHTS if w[1] not in ("gate_up", "down"))


def expert_weight_names(e: int) -> tuple[str, str, str]:
    """Expert e's gate, up and down projections under model.layers.{i}."""
    return tuple(f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))


@functools.lru_cache(maxsize=8)
def _sparse_layer_weights(num_experts: int) -> tuple[tuple[str, str, str | None], ...]:
    rows = [("mlp.gate.weight", "router", None)]
    for e in range(num_experts):
        gate, up, down = expert_weight_names(e)
        rows += [(gate, "experts_gate_up", f"experts.{e}.gate"), (up, "experts_gate_up", f"experts.{e}.up"),
                 (down, "experts_down", f"experts.{e}.down")]
    return _ATTENTION_WEIGHTS + tuple(rows) + QK_NORM_WEIGHTS


@functools.lru_cache(maxsize=8)
def _expert_rows(num_experts: int, inter: int, hidden: int) -> dict[str, tuple[int, int]]:
    rows = {}
    for e in range(num_experts):
        rows[f"experts.{e}.gate"] = (e * 2 * inter, e * 2 * inter + inter)
        rows[f"experts.{e}.up"] = (e * 2 * inter + inter, (e + 1) * 2 * inter)
        rows[f"experts.{e}.down"] = (e * hidden, (e + 1) * hidden)
    return rows


# ---- activations -------------------------------------------------------------------------------------------------
class Qwen3MoeWorkspace(Workspace):
    """The dense workspace (its MLP buffers only where the model has dense layers) and moe_experts' buffers."""

    def __init__(self, config: Qwen3MoeConfig, max_tokens: int, max_logits: int, device: str, dtype):
        c = config
        super().__init__(c, max_tokens, max_logits, device, dtype,
                         mlp_width=c.intermediate_size if c.has_dense_layers else 0)
        self.moe = moe_workspace(c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                                 max_tokens, device) if c.sparse_layers else None


# ---- the model ---------------------------------------------------------------------------------------------------
_EXPERT_FIELDS = ("experts_gate_up", "experts_down")
FP8_EXPERTS_ENV = settings.FP8_EXPERTS.name


def fp8_experts_kept(environ=None) -> bool:
    """XSERV_FP8_EXPERTS: "bf16" (the default: a -FP8 checkpoint's experts dequantized at load) or "e4m3" (kept in
    FP8 where their shapes allow: half the experts' memory)."""
    return settings.FP8_EXPERTS.get(environ) == "e4m3"


def _experts_view(field: Tensor | Fp8Weight, experts: int, rows: int, cols: int):
    """The op's [E, rows, cols] view of a stacked experts field: (weight, None), or an FP8 field's (e4m3 weight, its
    scales [E, rows / 128, cols / 128])."""
    if isinstance(field, Fp8Weight):
        bo, bi = DEFAULT_BLOCK
        return field.weight.view(experts, rows, cols), field.scale_inv.view(experts, rows // bo, cols // bi)
    return field.view(experts, rows, cols), None


class Qwen3MoeModel(Qwen3Model):
    LAYER_CLASS = Qwen3MoeLayer
    FP8_FIELDS = DenseModel.FP8_FIELDS + _EXPERT_FIELDS

    def __init__(self, config: Qwen3MoeConfig, device: str, embed: Tensor, layers: list[Qwen3MoeLayer],
                 final_norm: Tensor, lm_head: Tensor, max_positions: int | None = None):
        super().__init__(config, device, embed, layers, final_norm, lm_head, max_positions=max_positions)
        e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        # per layer: the op's [E, 2I, H] and [E, H, I] views of the stacked experts and their FP8 scales (None for
        # bf16 experts), as moe_experts' keyword arguments (None: a dense layer)
        self.experts: list[dict | None] = []
        for layer in layers:
            if layer.router is None:
                self.experts.append(None)
                continue
            (gate_up, gate_up_scale), (down, down_scale) = (_experts_view(layer.experts_gate_up, e, 2 * inter, h),
                                                            _experts_view(layer.experts_down, e, h, inter))
            self.experts.append(dict(gate_up=gate_up, down=down, gate_up_scale=gate_up_scale, down_scale=down_scale))

    # ---- weights ------------------------------------------------------------------------------------------
    @classmethod
    def layer_weights(cls, config: Qwen3MoeConfig, layer: int) -> tuple[tuple[str, str, str | None], ...]:
        return _sparse_layer_weights(config.num_experts) if config.is_sparse_layer(layer) else cls.LAYER_WEIGHTS

    @classmethod
    def _fp8_capable_experts(cls, table, kept: set) -> set:
        """The experts fields (layer, field) of `kept` (the base class's rule) that the FP8 expert GEMMs can take: a
        sparse layer's two fields together where every expert tensor of both is whole 128 x 128 blocks (H and I
        multiples of 128; the op takes both fields FP8 or neither)."""
        whole: dict = {}
        for w in table:
            if w.field in _EXPERT_FIELDS:
                whole[w.layer] = whole.get(w.layer, True) and all(n % b == 0 for n, b in zip(w.shape, DEFAULT_BLOCK))
        return {(layer, f) for layer, ok in whole.items() if ok and all((layer, g) in kept for g in _EXPERT_FIELDS)
                for f in _EXPERT_FIELDS}

    @classmethod
    def kept_fp8_fields(cls, table) -> set:
        """By default none: a mixture-of-experts -FP8 checkpoint loads dequantized to bf16 (its one-token steps are
        latency chains, where the FP8 kernels measured slower and offline no faster: docs/kernels/moe.md, "FP8
        experts"). With XSERV_FP8_EXPERTS=e4m3, the projections the base class keeps, the experts fields only where
        the FP8 expert GEMMs can take them (_fp8_capable_experts)."""
        if not fp8_experts_kept():
            return set()
        kept = super().kept_fp8_fields(table)
        dense = {key for key in kept if key[1] not in _EXPERT_FIELDS}
        return dense | cls._fp8_capable_experts(table, kept)

    @classmethod
    def loads_fp8_experts(cls, config) -> bool:
        """Do this config's experts load as FP8 (a -FP8 checkpoint, XSERV_FP8_EXPERTS=e4m3, whole 128 x 128 blocks)
        on one GPU? (Under tensor parallelism every FP8 weight is dequantized at load.)"""
        if getattr(config, "quantization_config", None) is None:
            return False
        return any(field in _EXPERT_FIELDS for _, field in cls.kept_fp8_fields(cls.weight_table(config)))

    @classmethod
    def kernel_shapes(cls, config, tp_size: int = 1) -> dict[str, int]:
        """The dense model's, and the moe family's piece: moe_fp8=1 for experts that load as FP8 (one GPU only),
        else the bf16 experts' GEMMs."""
        shapes = super().kernel_shapes(config, tp_size)
        shapes["moe"] = 1
        shapes["moe_fp8"] = int(tp_size == 1 and cls.loads_fp8_experts(config))
        return shapes

    @classmethod
    def fp8_load_notice(cls, config) -> str | None:
        """With XSERV_FP8_EXPERTS=e4m3 the base class's line (what still loads dequantized); by default, that the
        checkpoint loads dequantized and how to keep it FP8."""
        quant = getattr(config, "quantization_config", None)
        if quant is None or fp8_experts_kept():
            return super().fp8_load_notice(config)
        return (f"{quant.describe()} mixture-of-experts checkpoint: dequantized to bfloat16 at load (on an H100 "
                f"that decodes 2-4% faster at batch 1 and as fast offline as its FP8 weights); {FP8_EXPERTS_ENV}=e4m3 "
                f"keeps it in FP8 (about half the memory; batch-1 decode measured ~6% slower)")

    @classmethod
    def field_shapes(cls, config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
        e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        return {**super().field_shapes(config), "router": (e, h), "experts_gate_up": (e * 2 * inter, h),
                "experts_down": (e * h, inter)}

    @classmethod
    def part_rows(cls, config: Qwen3MoeConfig) -> dict[str, tuple[int, int]]:
        return {**super().part_rows(config),
                **_expert_rows(config.num_experts, config.moe_intermediate_size, config.hidden_size)}

    def expert_bytes(self) -> int:
        """The bytes of one expert's gate, up and down projections (FP8 experts: their e4m3 bytes and scales)."""
        layer = next((layer for layer in self.layers if layer.router is not None), None)
        if layer is None:
            c = self.config
            return 3 * c.moe_intermediate_size * c.hidden_size * np.dtype(self.dtype).itemsize
        return (layer.experts_gate_up.nbytes + layer.experts_down.nbytes) // self.config.num_experts

    def step_weight_bytes(self, experts_per_layer: float) -> float:
        """The weight bytes a forward reads when `experts_per_layer` experts are touched in each sparse layer:
        everything but the experts (the routers included), plus that many experts' gate/up and down per sparse
        layer. weight_bytes() is the total (every expert)."""
        e = self.config.num_experts
        if not 0 <= experts_per_layer <= e:
            raise ValueError(f"experts_per_layer must be in [0, {e}], got {experts_per_layer!r}")
        stacked = sum(layer.experts_gate_up.nbytes + layer.experts_down.nbytes
                      for layer in self.layers if layer.router is not None)
        sparse = len(self.config.sparse_layers)
        return float(self.weight_bytes() - stacked) + float(experts_per_layer) * sparse * self.expert_bytes()

    def expected_experts_per_layer(self, num_tokens: int) -> float:
        """The expected number of distinct experts a sparse layer touches for `num_tokens` tokens whose top-k sets
        are uniform and independent: E * (1 - (1 - k / E) ** num_tokens) (with step_weight_bytes: a roofline)."""
        return expected_touched_experts(self.config.num_experts, self.config.num_experts_per_tok, num_tokens)

    def make_workspace(self, max_tokens: int, max_logits: int) -> Qwen3MoeWorkspace:
        self.reserve_fp8_scratch(max_tokens)
        return Qwen3MoeWorkspace(self.config, max_tokens, max_logits, self.device, self.dtype)

    # ---- forward: the dense decoder's, with the sparse layers' MLP replaced -----------------------------------
    def _mlp(self, i, layer, ws, normed, out, gate_up, act) -> None:
        experts = self.experts[i]
        if experts is None:
            return super()._mlp(i, layer, ws, normed, out, gate_up, act)
        c = self.config
        moe_experts(normed, layer.router, top_k=c.num_experts_per_tok, renormalize=c.norm_topk_prob, out=out,
                    workspace=ws.moe, **experts)

    # a sparse layer's moe_experts adds into the fp32 residual: at tp > 1 a partial sum, so the unfused path there
    FUSED_TP = False

    def _post_attention_fused(self, i, layer, ws, attn, residual, act) -> None:
        """A sparse layer of the one-token path: o projection (GEMV) and fused_add_rmsnorm as in the unfused path,
        then moe_experts adds its bf16-rounded output into the fp32 residual (what the next fused_add_rmsnorm
        would do with a stored bf16 output)."""
        experts = self.experts[i]
        if experts is None:
            return super()._post_attention_fused(i, layer, ws, attn, residual, act)
        c = self.config
        t = residual.shape[0]
        hidden, normed = ws.hidden[:t], ws.normed[:t]
        self._project(attn, layer.o_proj, hidden)
        fused_add_rmsnorm(hidden, residual, layer.post_norm, self.eps, out=normed)
        moe_experts(normed, layer.router, top_k=c.num_experts_per_tok, renormalize=c.norm_topk_prob, out=residual,
                    workspace=ws.moe, **experts)
