"""The dense decoder shared by Qwen3 and Llama: weights, the weight-name table, and the forward pass, written once
against xserv.ops.

A layer is pre-norm attention (fused QKV GEMM, optional q/k head RMSNorm, RoPE, paged attention, o_proj) and a
pre-norm SwiGLU MLP (fused gate/up GEMM, down). An architecture subclasses `DenseModel` and sets `LAYER_WEIGHTS`
(its Hugging Face names) and `QK_NORM`; nothing else differs. A mixture-of-experts model (qwen3_moe.py) reuses
the loading and the forward through the hooks `layer_weights` / `field_shapes` / `part_rows` (its layers differ)
and `_mlp` / `_post_attention_fused` (its sparse MLP block).

The forward takes a Batch (packed tokens of several sequences, positions, block tables, slot mapping, which rows
need logits) and the paged KV cache, so prefill, chunked prefill, decode and mixed batches share one code path.
CUDA tensors run the kernels (bf16 storage, fp32 accumulation); CPU tensors run the NumPy references (float32 math
on the same bf16 tensors, rounding where the kernels round).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..ops.activation import silu_and_mul
from ..ops.attention import attention_decode, attention_decode_rope, attention_prefill
from ..ops.embedding import embedding
from ..ops.gemv import (fp8_row_supported, gemv_supported, linear_add, linear_gemv, prefer_gemv, rmsnorm_linear,
                        rmsnorm_linear_silu_mul)
from ..ops.linear import linear
from ..ops.rmsnorm import fused_add_rmsnorm
from ..ops.rope import qk_norm_rope_write_kv, rope_cos_sin_table
from ..tensor import Tensor, as_dtype, bfloat16, float32
from .base import KVLayout
from ..ops.fp8_linear import Fp8Scratch, linear_fp8
from ..fp8_format import DEFAULT_BLOCK, E4M3, Fp8Weight, scale_shape
from .fp8 import SCALE_SUFFIX, dequantize_for_load, join_fp8_fields

# The ops take bf16 activations and weights on both backends (the NumPy references compute in float32 and round
# where the kernels round), so the CPU model is the reference of the CUDA one step by step.
WEIGHT_DTYPE = {"cuda": bfloat16, "cpu": bfloat16}
# The residual stream between layers stays in float32: rounding it to bf16 twice per layer (as transformers does
# in bf16) put the 8B-shaped model's logits 6e-2 (relative L2) away from transformers' float32 logits.
RESIDUAL_DTYPE = float32


@dataclass
class DenseLayer:
    input_norm: Tensor  # [H]
    qkv: Tensor  # [q_size + 2 * kv_size, H]: q_proj, k_proj, v_proj rows
    o_proj: Tensor  # [H, q_size]
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2 * I, H]: gate_proj rows then up_proj rows
    down: Tensor  # [H, I]
    q_norm: Tensor | None = None  # [D] (QK_NORM architectures only)
    k_norm: Tensor | None = None  # [D]


# ---- the weight-name table ---------------------------------------------------------------------------------------
# One row per Hugging Face tensor of a layer: (name under "model.layers.{i}.", DenseLayer field, part of the fused
# field or None). The fused fields' parts are listed in their row order.
DENSE_LAYER_WEIGHTS = (
    ("input_layernorm.weight", "input_norm", None),
    ("self_attn.q_proj.weight", "qkv", "q"),
    ("self_attn.k_proj.weight", "qkv", "k"),
    ("self_attn.v_proj.weight", "qkv", "v"),
    ("self_attn.o_proj.weight", "o_proj", None),
    ("post_attention_layernorm.weight", "post_norm", None),
    ("mlp.gate_proj.weight", "gate_up", "gate"),
    ("mlp.up_proj.weight", "gate_up", "up"),
    ("mlp.down_proj.weight", "down", None),
)
QK_NORM_WEIGHTS = (
    ("self_attn.q_norm.weight", "q_norm", None),
    ("self_attn.k_norm.weight", "k_norm", None),
)
NORM_FIELDS = ("input_norm", "post_norm", "q_norm", "k_norm", "final_norm")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def field_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shape of each fused/loaded tensor of a layer, and the model-level ones."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    return {"input_norm": (h,), "qkv": (config.qkv_size, h), "o_proj": (h, config.q_size), "post_norm": (h,),
            "gate_up": (2 * i, h), "down": (h, i), "q_norm": (d,), "k_norm": (d,),
            "embed": (config.vocab_size, h), "final_norm": (h,), "lm_head": (config.vocab_size, h)}


def part_rows(config) -> dict[str, tuple[int, int]]:
    """Row range [start, stop) of each part inside its fused tensor."""
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, i), "up": (i, 2 * i)}


# Fields whose tensors an FP8 checkpoint keeps in its float dtype: besides the norms, the embeddings, lm_head and the
# MoE router (qwen3_moe.py's `router`, `mlp.gate`: Qwen's FP8 MoE checkpoints list it in modules_to_not_convert).
UNQUANTIZED_FIELDS = NORM_FIELDS + ("embed", "lm_head", "router")
FLOAT_DTYPES = (np.dtype(bfloat16), np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Weight:
    """One tensor of a checkpoint: its Hugging Face name and shape, and where the model keeps it. An FP8
    checkpoint's quantized linear weights (`block` set) are float8_e4m3fn with a float32 `scale_name` tensor
    of `scale_shape` beside them (xserv/models/fp8.py)."""
    name: str
    shape: tuple[int, ...]
    layer: int | None  # None: a model-level tensor (embed, final_norm, lm_head)
    field: str  # DenseLayer field, or DenseModel attribute for model-level tensors
    rows: tuple[int, int] | None = None  # rows inside the fused field; None: the whole field
    block: tuple[int, int] | None = None  # FP8 checkpoints: the quantization block [rows, columns]; None: a float

    @property
    def is_norm(self) -> bool:
        return self.field in NORM_FIELDS

    @property
    def quantized(self) -> bool:
        return self.block is not None

    @property
    def scale_name(self) -> str:
        """The name of a quantized weight's inverse scales: `*.weight` -> `*.weight_scale_inv`."""
        return self.name + "_scale_inv"

    @property
    def scale_shape(self) -> tuple[int, int]:
        return scale_shape(self.shape, self.block)


def checkpoint_expectations(table: list[Weight]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[np.dtype, ...]]]:
    """(shape, accepted dtypes) of every tensor a checkpoint with this weight table holds: the table's weights
    (e4m3 when quantized, else a float dtype) and the quantized ones' float32 scales."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, tuple[np.dtype, ...]] = {}
    for w in table:
        shapes[w.name] = w.shape
        dtypes[w.name] = (E4M3,) if w.quantized else FLOAT_DTYPES
        if w.quantized:
            shapes[w.scale_name] = w.scale_shape
            dtypes[w.scale_name] = (np.dtype(np.float32),)
    return shapes, dtypes


def fill_fields(pieces, count: int, shapes: dict[str, tuple[int, ...]], num_layers: int, dtype, device: str,
                progress: bool = False, model_fields: dict[str, Tensor] | None = None
                ) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Fill a model's field tensors from `pieces`: (layer or None, field, rows [start, stop) of the field or None
    for all of it, host array) in load order, `count` of them (the progress bar's total). A field is allocated
    (`shapes[field]`, `dtype`, on `device`) when its first piece arrives, unless `model_fields` holds it already; a
    kept FP8 field's pieces are e4m3 and allocate it in e4m3, its scales come as "<field>.scale_inv" (float32, the
    128 x 128 block grid of the field's shape);
    each array is cast to `dtype` on the host if it differs and copied (on CUDA uploaded) into its rows, one at a
    time, so the host holds one piece beyond the memory-mapped files. Returns (model-level fields, per-layer fields)
    after the uploads are complete. (DenseModel.from_checkpoint's loop; xserv/parallel/load.py's shard loader.)"""
    model_fields = {} if model_fields is None else model_fields
    layer_fields: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]

    from ..progress import progress_bar

    bar = progress_bar(count, "loading weights", enabled=progress, unit="tensor", leave=False)
    try:
        for layer, field, rows, arr in pieces:
            fields = model_fields if layer is None else layer_fields[layer]
            # a kept FP8 field (xserv/models/fp8.py) keeps the file's e4m3 bytes, its "<field>.scale_inv" float32
            want = arr.dtype if arr.dtype == E4M3 or field.endswith(SCALE_SUFFIX) else np.dtype(dtype)
            if field not in fields:
                shape = (scale_shape(shapes[field[:-len(SCALE_SUFFIX)]], DEFAULT_BLOCK)
                         if field.endswith(SCALE_SUFFIX) else shapes[field])
                fields[field] = Tensor.empty(shape, want, device)
            dest = fields[field] if rows is None else fields[field][rows[0]:rows[1]]
            dest.copy_(np.ascontiguousarray(arr if arr.dtype == want else arr.astype(want)))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if device == "cuda":
        from ..runtime import synchronize

        synchronize()
    return model_fields, layer_fields


# ---- activations ------------------------------------------------------------------------------------------------
class Workspace:
    """Activation buffers for up to `max_tokens` packed tokens and `max_logits` logit rows. The forward writes
    into views of these, so a step allocates nothing (what a CUDA graph needs)."""

    def __init__(self, config, max_tokens: int, max_logits: int, device: str, dtype, mlp_width: int | None = None):
        """mlp_width: the dense MLP's intermediate size (default config.intermediate_size); 0: no dense MLP
        buffers (a model whose every layer is sparse)."""
        c = config
        inter = c.intermediate_size if mlp_width is None else mlp_width
        self.max_tokens, self.max_logits = max_tokens, max_logits

        def buf(cols, dt=dtype, rows=max_tokens):
            return Tensor.empty((rows, cols), dt, device)

        self.hidden = buf(c.hidden_size)
        self.residual = buf(c.hidden_size, RESIDUAL_DTYPE)
        self.normed = buf(c.hidden_size)
        self.qkv = buf(c.qkv_size)
        self.attn = buf(c.q_size)
        self.gate_up = buf(2 * inter) if inter else None
        self.act = buf(inter) if inter else None
        self.gathered = buf(c.hidden_size, rows=max_logits)
        self.logits = buf(c.vocab_size, float32, rows=max_logits)

    def fits(self, num_tokens: int, num_logits: int) -> bool:
        return num_tokens <= self.max_tokens and num_logits <= self.max_logits


# ---- the model ----------------------------------------------------------------------------------------------------
class DenseModel:
    """Implements xserv.models.base.CausalLM for the dense decoder family."""

    LAYER_WEIGHTS: ClassVar[tuple[tuple[str, str, str | None], ...]] = DENSE_LAYER_WEIGHTS
    QK_NORM: ClassVar[bool] = False  # q/k head RMSNorm before RoPE (Qwen3)
    LAYER_CLASS: ClassVar[type] = DenseLayer  # what from_checkpoint builds from a layer's loaded fields
    # The projections an FP8 checkpoint's weights may stay FP8 in (they go through _project / linear_fp8); any other
    # quantized field (the MoE experts) is dequantized at load.
    FP8_FIELDS: ClassVar[tuple[str, ...]] = ("qkv", "o_proj", "gate_up", "down")

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

    # ---- weights ------------------------------------------------------------------------------------------
    # The three hooks below describe the checkpoint; a model whose layers differ (MoE: sparse and dense layers)
    # overrides them and reuses weight_table / from_checkpoint as they are.
    @classmethod
    def layer_weights(cls, config, layer: int) -> tuple[tuple[str, str, str | None], ...]:
        """Layer `layer`'s rows of (HF name under model.layers.{i}., layer field, part)."""
        return cls.LAYER_WEIGHTS

    @classmethod
    def field_shapes(cls, config) -> dict[str, tuple[int, ...]]:
        return field_shapes(config)

    @classmethod
    def part_rows(cls, config) -> dict[str, tuple[int, int]]:
        return part_rows(config)

    @classmethod
    def weight_table(cls, config) -> list[Weight]:
        """Every tensor a Hugging Face checkpoint of this architecture and config holds, in file order: what
        loading checks and fills, and what a random checkpoint is made of. With an FP8 quantization_config, the
        linear weights outside UNQUANTIZED_FIELDS and modules_to_not_convert are quantized (`block` set): the
        checkpoint also holds their `*.weight_scale_inv` (checkpoint_expectations)."""
        shapes, rows = cls.field_shapes(config), cls.part_rows(config)
        quant = getattr(config, "quantization_config", None)

        def weight(name, field, part=None, layer=None):
            span = rows[part] if part else None
            shape = (span[1] - span[0],) + shapes[field][1:] if span else shapes[field]
            quantized = (quant is not None and field not in UNQUANTIZED_FIELDS
                         and not quant.excludes(name.removesuffix(".weight")))
            return Weight(name, shape, layer, field, span, quant.weight_block_size if quantized else None)

        table = [weight("model.embed_tokens.weight", "embed")]
        for n in range(config.num_hidden_layers):
            table += [weight(layer_prefix(n) + suffix, field, part, n)
                      for suffix, field, part in cls.layer_weights(config, n)]
        table.append(weight("model.norm.weight", "final_norm"))
        if not config.tie_word_embeddings:
            table.append(weight("lm_head.weight", "lm_head"))
        return table

    @classmethod
    def from_checkpoint(cls, config, reader, device: str = "cuda", progress: bool = True,
                        max_positions: int | None = None, dtype=None) -> "DenseModel":
        """Upload a checkpoint into `dtype` tensors (default: WEIGHT_DTYPE[device]; other float dtypes in the file
        are cast one tensor at a time on the host). Fused tensors are allocated once and filled part by part in
        place; on CUDA every tensor goes from the memory-mapped file straight to device memory. FP8 weights
        (config.quantization_config) are dequantized on the host into `dtype`, each checkpoint tensor with its
        own scales before it is copied into its rows (fp8.dequantize_blockwise's rounding), except the projections
        kept_fp8_fields names, which stay e4m3 with their scales (an Fp8Weight) when no dtype is asked for."""
        table = cls.weight_table(config)
        cls.validate_checkpoint(config, reader, table)
        keep = cls.kept_fp8_fields(table) if dtype is None else set()
        dtype = as_dtype(dtype) if dtype is not None else WEIGHT_DTYPE[device]

        def pieces():
            for w in table:
                arr = reader.get(w.name)
                if (w.layer, w.field) in keep:  # e4m3 bytes as they are, then the scales' block rows
                    yield w.layer, w.field, w.rows, arr
                    rows = None if w.rows is None else (w.rows[0] // w.block[0], -(-w.rows[1] // w.block[0]))
                    yield w.layer, w.field + SCALE_SUFFIX, rows, reader.get(w.scale_name)
                    continue
                if w.quantized:  # dequantized on the host, one checkpoint tensor at a time
                    arr = dequantize_for_load(arr, reader.get(w.scale_name), w.block, dtype)
                yield w.layer, w.field, w.rows, arr

        count = len(table) + sum((w.layer, w.field) in keep for w in table)
        model_fields, layer_fields = fill_fields(pieces(), count, cls.field_shapes(config),
                                                 config.num_hidden_layers, dtype, device, progress)
        return cls.from_fields(config, device, model_fields, layer_fields, max_positions)

    @classmethod
    def kept_fp8_fields(cls, table: list[Weight]) -> set[tuple[int | None, str]]:
        """The (layer, field) projections of FP8_FIELDS that load as Fp8Weight: every checkpoint tensor of the
        field quantized in 128 x 128 blocks (the FP8 kernels' block), each starting on a block row, so the parts'
        scale rows stack into the field's. The rest is dequantized at load."""
        parts: dict[tuple[int | None, str], list[Weight]] = {}
        for w in table:
            if w.field in cls.FP8_FIELDS:
                parts.setdefault((w.layer, w.field), []).append(w)
        return {key for key, ws in parts.items()
                if all(w.block == DEFAULT_BLOCK and (w.rows is None or w.rows[0] % DEFAULT_BLOCK[0] == 0)
                       for w in ws)}

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

    @classmethod
    def fp8_load_notice(cls, config) -> str | None:
        """One line for the user when an FP8 checkpoint has quantized weights that load dequantized (no FP8 kernel
        takes them: MoE experts, blocks other than 128 x 128, fused parts off the block grid); None otherwise."""
        quant = getattr(config, "quantization_config", None)
        if quant is None:
            return None
        table = cls.weight_table(config)
        keep = cls.kept_fp8_fields(table)
        quantized = [w for w in table if w.quantized]
        dequantized = [w for w in quantized if (w.layer, w.field) not in keep]
        if not dequantized:
            return None
        return (f"{quant.describe()} checkpoint: {len(dequantized)} of its {len(quantized)} quantized weights are "
                f"dequantized to bfloat16 at load (xserv's FP8 kernels take 128x128-block projections only; e.g. "
                f"{dequantized[0].name}); the other {len(quantized) - len(dequantized)} stay FP8")

    @classmethod
    def validate_checkpoint(cls, config, reader, table: list[Weight] | None = None) -> None:
        """Check that the checkpoint holds the tensors `cls.weight_table(config)` lists, in their shapes and
        accepted dtypes (one ValueError listing every problem; the FP8 hint when the config lacks its
        quantization_config)."""
        expected, dtypes = checkpoint_expectations(table if table is not None else cls.weight_table(config))
        if config.tie_word_embeddings and "lm_head.weight" in reader.names():
            expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)  # present but unused
            dtypes["lm_head.weight"] = FLOAT_DTYPES
        try:
            reader.validate(expected, dtypes)
        except ValueError as e:
            if getattr(config, "quantization_config", None) is None and any(
                    n.endswith(".weight_scale_inv") for n in reader.names()):
                raise ValueError(f"{e}\n  (the checkpoint holds FP8 *.weight_scale_inv tensors, but its config.json "
                                 f"has no quantization_config: an FP8 checkpoint needs Qwen's quant_method 'fp8' "
                                 f"one)") from None
            raise

    @classmethod
    def from_fields(cls, config, device: str, model_fields: dict[str, Tensor], layer_fields: list[dict[str, Tensor]],
                    max_positions: int | None = None) -> "DenseModel":
        """The model of loaded field tensors (fill_fields' result): lm_head is the embedding when there is no
        lm_head field (tied embeddings); CPU weights are frozen."""
        embed = model_fields["embed"]
        layers = [cls.LAYER_CLASS(**join_fp8_fields(f)) for f in layer_fields]
        model = cls(config, device, embed, layers, model_fields["final_norm"],
                    model_fields.get("lm_head", embed), max_positions=max_positions)
        if device == "cpu":  # frozen: lets the CPU GEMM cache its float32 copies (xserv/ops/linear.py)
            for tensor in model.weight_tensors():
                tensor.array.flags.writeable = False
        return model

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

    def make_workspace(self, max_tokens: int, max_logits: int) -> Workspace:
        self.reserve_fp8_scratch(max_tokens)
        return Workspace(self.config, max_tokens, max_logits, self.device, self.dtype)

    def reserve_fp8_scratch(self, max_tokens: int) -> None:
        """FP8 weights on CUDA: the buffers linear_fp8's many-row paths use (the quantized activations, or a
        dequantized weight), sized for forwards of up to max_tokens tokens and this model's largest FP8 weight, made
        with the workspace (before any graph capture) so that a step allocates nothing; the largest one is kept."""
        if self.device != "cuda" or not self._fp8 or (self.fp8_scratch is not None
                                                      and self.fp8_scratch.max_rows >= max_tokens):
            return
        shapes = [t.shape for layer in self.layers for t in vars(layer).values() if isinstance(t, Fp8Weight)]
        self.fp8_scratch = Fp8Scratch(max_tokens, max(k for _, k in shapes), max(n * k for n, k in shapes))

    # ---- forward ------------------------------------------------------------------------------------------
    def fused_forward_ok(self, num_tokens: int, num_logits: int) -> bool:
        """Does a CUDA forward of this many tokens take the fused skinny-GEMM path (every projection a GEMV
        kernel with its norm / activation / residual add folded in: xserv/ops/gemv.py)? FP8 projections take the
        FP8 entries of the same ops (one row), where every one of them fits (fp8_row_supported)."""
        c = self.config
        return (self.fused_tp_ok(num_tokens) and self.device == "cuda" and self.fused_gemv
                and num_tokens <= self.FUSED_MAX_TOKENS and self.fused_fp8_ok() and all(
                    gemv_supported(m, k) for m, k in ((num_tokens, c.hidden_size), (num_tokens, c.q_size),
                                                      (num_tokens, c.intermediate_size), (num_logits, c.hidden_size))))

    def fused_tp_ok(self, num_tokens: int) -> bool:
        """At tp > 1 the fused path sends the o / down partial sums through comm.all_reduce_add (the all-reduce with
        the residual add in its epilogue: the IPC kernel). With NCCL only, or a block that adds its own output into
        the residual (FUSED_TP False), the unfused path. The same answer on every rank."""
        return self.comm is None or (self.FUSED_TP and self.comm.adds_residual(num_tokens * self.config.hidden_size))

    def fused_fp8_ok(self) -> bool:
        """Does every FP8 projection of the layers fit the fused one-row FP8 GEMVs (the gate/up weight with the
        paired SiLU-and-mul epilogue)? True for a model without FP8 weights. Computed once (the weights are fixed)."""
        if self._fp8_fused_ok is None:
            self._fp8_fused_ok = all(fp8_row_supported(*w.shape, paired=field == "gate_up")
                                     for layer in self.layers for field, w in vars(layer).items()
                                     if isinstance(w, Fp8Weight))
        return self._fp8_fused_ok

    # Up to this many tokens a forward runs the fused GEMV path. Measured (docs/kernels/gemv.md, H100): one token
    # gains 32% (0.6B) and 8% (8B) per decode step; at 4 tokens the prologues, recomputed by every CTA, cost more
    # than the launches they save (8B: 468 vs 609 tok/s), so wider steps keep the unfused ops (and the SiLU-and-mul
    # epilogue, rmsnorm_linear_silu_mul, takes one row).
    FUSED_MAX_TOKENS: ClassVar[int] = 1
    # Does the fused path hold at tp > 1 (every layer's row-parallel outputs through _post_attention_fused_tp)?
    FUSED_TP: ClassVar[bool] = True

    def forward(self, batch, kv_cache, workspace: Workspace | None = None) -> Tensor:
        """Logits float32 [rows, vocab] for the rows batch.logits_indices names (every row if None)."""
        t = batch.num_tokens
        n = t if batch.logits_indices is None else batch.logits_indices.shape[0]
        if workspace is None or not workspace.fits(t, n):
            workspace = self.make_workspace(t, n)
        ws = workspace
        if self.fused_forward_ok(t, n):
            return self._forward_fused(batch, kv_cache, ws, t, n)
        c = self.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        residual = ws.residual[:t]
        normed = ws.normed[:t]
        hidden = ws.hidden[:t]
        qkv = ws.qkv[:t]
        qkv3 = qkv.view(t, hq + 2 * hkv, d)
        attn = ws.attn[:t]
        attn3 = attn.view(t, hq, d)
        gate_up = ws.gate_up[:t] if ws.gate_up is not None else None
        act = ws.act[:t] if ws.act is not None else None

        embedding(batch.input_ids, self.embed, out=hidden, feed=batch.feed)
        comm = self.comm  # tp > 1: each rank's vocab part gave its own ids' rows (zeros for the others): summed
        if comm is not None:
            comm.all_reduce(hidden)
        residual.zero_()  # the first layer's add starts the float32 stream from the embeddings, exactly
        for i, layer in enumerate(self.layers):
            fused_add_rmsnorm(hidden, residual, layer.input_norm, self.eps, out=normed)
            self._project(normed, layer.qkv, qkv)
            self._attention(i, layer, batch, kv_cache, qkv3, attn3)
            self._project(attn, layer.o_proj, hidden)
            if comm is not None:  # row-parallel o_proj: each rank's heads' partial sum
                comm.all_reduce(hidden)
            fused_add_rmsnorm(hidden, residual, layer.post_norm, self.eps, out=normed)
            self._mlp(i, layer, ws, normed, hidden, gate_up, act)
            if comm is not None:  # row-parallel down (dense MLP or every expert): the partial sums
                comm.all_reduce(hidden)
        fused_add_rmsnorm(hidden, residual, self.final_norm, self.eps, out=normed)
        if batch.logits_indices is not None:
            rows = ws.gathered[:n]
            embedding(batch.logits_indices, normed, out=rows)
        else:
            rows = normed
        if comm is not None:  # vocab-parallel lm_head: this rank's columns, gathered into the full vocabulary
            return comm.gather_logits(self._project(rows, self.lm_head, comm.logits_part(n)), ws.logits[:n])
        return self._project(rows, self.lm_head, ws.logits[:n])

    def _mlp(self, i: int, layer: DenseLayer, ws: Workspace, normed: Tensor, out: Tensor, gate_up: Tensor,
             act: Tensor) -> None:
        """Layer i's MLP on the normalised rows (the unfused path): out bf16 [t, H]; gate_up and act are the
        workspace's views for this forward's t rows."""
        self._project(normed, layer.gate_up, gate_up)
        silu_and_mul(gate_up, out=act)
        self._project(act, layer.down, out)

    def _project(self, x: Tensor, weight: Tensor | Fp8Weight, out: Tensor) -> Tensor:
        """out = x @ weight^T: the GEMV kernel for the few-row shapes where it beats cuBLASLt, else cuBLASLt; an FP8
        weight's own op (linear_fp8 picks its kernel by the row count)."""
        if isinstance(weight, Fp8Weight):
            scratch = self.fp8_scratch if self.fp8_scratch is not None and self.fp8_scratch.max_rows >= x.shape[0] \
                else None
            return linear_fp8(x, weight.weight, weight.scale_inv, out=out, scratch=scratch)
        m, k = x.shape
        if self.device == "cuda" and self.fused_gemv and prefer_gemv(m, weight.shape[0], k):
            return linear_gemv(x, weight, out=out)
        return linear(x, weight, out=out)

    def _attention(self, i: int, layer: DenseLayer, batch, kv_cache, qkv3: Tensor, attn3: Tensor) -> None:
        """Layer i's attention block between the projections. Decode batches (one token per sequence): q/k norm,
        RoPE, the KV-cache write and attention in one kernel (qkv is only read). Prefill: q/k norm and RoPE with the
        KV-cache write (one kernel, in place on qkv), then attention."""
        hq, hkv = self.config.num_attention_heads, self.config.num_key_value_heads
        q_norm, k_norm = (layer.q_norm, layer.k_norm) if self.QK_NORM else (None, None)
        # an FP8 KV cache (engine/kv_cache.py): its per-layer scales, and the bf16 copy prefill reads
        scales = {"k_scale": kv_cache.k_scales[i], "v_scale": kv_cache.v_scales[i]} if getattr(kv_cache, "fp8", False) else {}
        if batch.max_q_len == 1 and self.fused_attention:
            attention_decode_rope(qkv3, q_norm, k_norm, batch.positions, self.cos_sin, hq, self.eps, kv_cache.k[i],
                                  kv_cache.v[i], batch.slot_mapping, batch.kv_lens, batch.block_tables, self.scale,
                                  batch.max_kv_len, out=attn3, **scales)
            return
        qk_norm_rope_write_kv(qkv3, q_norm, k_norm, batch.positions, self.cos_sin, hq, hkv, self.eps, kv_cache.k[i],
                              kv_cache.v[i], batch.slot_mapping, pdl=True, **scales)
        if batch.max_q_len == 1:
            attention_decode(qkv3, kv_cache.k[i], kv_cache.v[i], batch.kv_lens, batch.block_tables, self.scale,
                             batch.max_kv_len, out=attn3, num_q_heads=hq, **scales)
            return
        if scales:
            scales["kv_scratch"] = kv_cache.prefill_scratch
        attention_prefill(qkv3, kv_cache.k[i], kv_cache.v[i], batch.cu_seqlens_q, batch.kv_lens, batch.block_tables,
                          self.scale, batch.max_q_len, out=attn3, num_q_heads=hq, **scales)

    def _post_attention_fused(self, i: int, layer: DenseLayer, ws: Workspace, attn: Tensor, residual: Tensor,
                              act: Tensor) -> None:
        """The fused path's rest of layer i after attention: the o projection added into the fp32 residual, the
        post-attention RMSNorm, the MLP and its residual add (three GEMV launches)."""
        linear_add(attn, layer.o_proj, residual)
        rmsnorm_linear_silu_mul(residual, layer.post_norm, self.eps, layer.gate_up, out=act)
        linear_add(act, layer.down, residual)

    def _post_attention_fused_tp(self, layer: DenseLayer, ws: Workspace, attn: Tensor, residual: Tensor,
                                 act: Tensor) -> None:
        """`_post_attention_fused` at tp > 1: the o / down GEMVs write this rank's partial sums (bf16), each
        all-reduced with the residual add in the all-reduce's epilogue (the same rounding points as the unfused
        path: the bf16 sum added into the fp32 residual); the RMSNorm stays in the gate/up GEMV's prologue."""
        hidden = ws.hidden[:residual.shape[0]]
        self._project(attn, layer.o_proj, hidden)
        self.comm.all_reduce_add(hidden, residual)
        rmsnorm_linear_silu_mul(residual, layer.post_norm, self.eps, layer.gate_up, out=act)
        self._project(act, layer.down, hidden)
        self.comm.all_reduce_add(hidden, residual)

    def _forward_fused(self, batch, kv_cache, ws: Workspace, t: int, n: int) -> Tensor:
        """The forward of one token as 5 launches per layer, chained by programmatic dependent launch: decode
        attention with QK-norm, RoPE and the KV write folded in (`_attention`), and the four projections as GEMV
        kernels that apply the RMSNorm before them (reading the fp32 residual stream), the SiLU-and-mul after the
        gate/up projection (its tiles pair gate and up rows), or the residual add after the o / down projections.
        Same rounding points as `forward`'s unfused ops."""
        c = self.config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        residual = ws.residual[:t]
        qkv, attn = ws.qkv[:t], ws.attn[:t]
        act = ws.act[:t] if ws.act is not None else None
        qkv3, attn3 = qkv.view(t, hq + 2 * hkv, d), attn.view(t, hq, d)
        comm = self.comm
        # the float32 stream starts from the embeddings, exactly (tp > 1: each rank's vocab part gives its own ids'
        # rows and zeros for the others, summed into the zeroed residual)
        if comm is None:
            embedding(batch.input_ids, self.embed, out=residual, feed=batch.feed)
        else:
            hidden = ws.hidden[:t]
            embedding(batch.input_ids, self.embed, out=hidden, feed=batch.feed)
            residual.zero_()
            comm.all_reduce_add(hidden, residual)
        for i, layer in enumerate(self.layers):
            rmsnorm_linear(residual, layer.input_norm, self.eps, layer.qkv, out=qkv)
            self._attention(i, layer, batch, kv_cache, qkv3, attn3)
            if comm is None:
                self._post_attention_fused(i, layer, ws, attn, residual, act)
            else:
                self._post_attention_fused_tp(layer, ws, attn, residual, act)
        if comm is None:
            return rmsnorm_linear(residual, self.final_norm, self.eps, self.lm_head, out=ws.logits[:n],
                                  rows=batch.logits_indices)
        part = rmsnorm_linear(residual, self.final_norm, self.eps, self.lm_head, out=comm.logits_part(n),
                              rows=batch.logits_indices)
        return comm.gather_logits(part, ws.logits[:n])
