"""The dense decoder shared by Qwen3 and Llama: the model class, its layer, and which kernels it launches.

An architecture subclasses `DenseModel` and sets `LAYER_WEIGHTS` (its Hugging Face names) and `QK_NORM`; nothing
else differs. The class is put together from two halves: loading (DenseCheckpoint, xserv/models/dense_weights.py:
the weight-name table, checkpoint checks, fill_fields) and the forward pass (DenseForward,
xserv/models/dense_forward.py: the workspace, the unfused and fused paths). A mixture-of-experts model
(qwen3_moe.py) reuses both through the hooks `layer_weights` / `field_shapes` / `part_rows` (its layers differ)
and `_mlp` / `_post_attention_fused` (its sparse MLP block).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..fp8_format import Fp8Weight
from ..ops.rope import rope_cos_sin_table
from ..tensor import Tensor
from .base import KVLayout
from .dense_forward import DenseForward, Workspace
from .dense_weights import DENSE_LAYER_WEIGHTS, QK_NORM_WEIGHTS, DenseCheckpoint, DenseLayer

# what the architectures (qwen3.py, llama.py, qwen3_moe.py) import from here: the model, its tables and workspace
__all__ = ["DENSE_LAYER_WEIGHTS", "QK_NORM_WEIGHTS", "DenseLayer", "DenseModel", "Workspace"]


class DenseModel(DenseCheckpoint, DenseForward):
    """Implements xserv.models.base.CausalLM for the dense decoder family."""

    LAYER_WEIGHTS: ClassVar[tuple[tuple[str, str, str | None], ...]] = DENSE_LAYER_WEIGHTS
    QK_NORM: ClassVar[bool] = False  # q/k head RMSNorm before RoPE (Qwen3)
    LAYER_CLASS: ClassVar[type] = DenseLayer  # what from_checkpoint builds from a layer's loaded fields
    # The projections an FP8 checkpoint's weights may stay FP8 in (they go through _project / linear_fp8); any other
    # quantized field (the MoE experts) is dequantized at load.
    FP8_FIELDS: ClassVar[tuple[str, ...]] = ("qkv", "o_proj", "gate_up", "down")
    state_layout: ClassVar[tuple] = ()  # every layer keeps paged KV: no per-sequence state

    def __init__(self, config, device: str, embed: Tensor, layers: list[DenseLayer], final_norm: Tensor,
                 lm_head: Tensor, max_positions: int | None = None):
        self.config = config
        self.device = device
        self.dtype = embed.dtype
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.eps = float(config.rms_norm_eps)
        self.scale = float(config.head_dim) ** -0.5
        self.max_positions = int(max_positions or config.context_length)
        self.fused_gemv = True  # small forwards take the fused GEMV path (False: the unfused ops, for comparison)
        self.fused_attention = True  # decode: QK-norm/RoPE/KV write inside attention (False: the two kernels)
        # tensor parallelism (xserv/parallel): this rank's Communicator, joined at the row-parallel outputs; None at tp 1
        self.comm = None
        self._fp8 = self.has_fp8_weights
        self._fp8_fused_ok: bool | None = None  # do the fused FP8 GEMVs take every FP8 projection (fused_forward_ok)
        self.fp8_scratch = None  # linear_fp8's buffers (reserve_fp8_scratch, with the workspace)
        table = rope_cos_sin_table(config.head_dim, self.max_positions, config.rope_theta, config.rope_scaling)
        self.cos_sin = Tensor.from_numpy(np.ascontiguousarray(table, np.float32), device)

    @property
    def kv_layout(self) -> KVLayout:
        c = self.config
        return KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    @classmethod
    def kernel_shapes(cls, config, tp_size: int = 1) -> dict[str, int]:
        """The shapes of the kernels this model's steps launch, whose pieces a start-up compiles (runtime/compiler.py,
        startup_families): head dim and query heads per kv head of `config` (a rank's config under tensor
        parallelism: replicated kv heads change the group), and fp8=1 for a checkpoint with FP8 weights (the
        gemv_fp8 and fp8 families)."""
        shapes = {"head_dim": int(config.head_dim),
                  "group": int(config.num_attention_heads // config.num_key_value_heads)}
        if getattr(config, "quantization_config", None) is not None:
            shapes["fp8"] = 1
        return shapes

    def weight_tensors(self) -> list[Tensor]:
        """Every weight tensor (an Fp8Weight's e4m3 bytes and scales both)."""
        tensors = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            for t in vars(layer).values():
                if isinstance(t, Fp8Weight):
                    tensors += t.tensors()
                elif t is not None:
                    tensors.append(t)
        return tensors

    def num_parameters(self) -> int:
        """Weights' element count (an FP8 weight's scales are not parameters)."""
        scales = {id(t.scale_inv) for layer in self.layers for t in vars(layer).values() if isinstance(t, Fp8Weight)}
        return sum(int(np.prod(t.shape)) for t in self.weight_tensors() if id(t) not in scales)

    @property
    def has_fp8_weights(self) -> bool:
        return any(isinstance(t, Fp8Weight) for layer in self.layers for t in vars(layer).values())

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weight_tensors())
