"""The dense decoder's checkpoint side: the Hugging Face weight-name table, what a checkpoint must hold, and loading
it into a model's field tensors.

`DenseCheckpoint` is the loading half of `DenseModel` (xserv/models/dense.py): its classmethods read the model class's
LAYER_WEIGHTS / LAYER_CLASS / FP8_FIELDS and the hooks `layer_weights` / `field_shapes` / `part_rows`, which a model
whose layers differ (qwen3_moe.py) overrides. fill_fields is also the loop of the tensor-parallel shard loader
(xserv/parallel/load.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fp8_format import DEFAULT_BLOCK, E4M3, scale_shape
from ..tensor import Tensor, as_dtype, bfloat16
from .fp8 import SCALE_SUFFIX, dequantize_for_load, join_fp8_fields

# The ops take bf16 activations and weights on both backends (the NumPy references compute in float32 and round
# where the kernels round), so the CPU model is the reference of the CUDA one step by step.
WEIGHT_DTYPE = {"cuda": bfloat16, "cpu": bfloat16}


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
                progress: bool = False, model_fields: dict[str, Tensor] | None = None,
                keep_dtype: tuple[str, ...] = ()) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """Fill a model's field tensors from `pieces`: (layer or None, field, rows [start, stop) of the field or None
    for all of it, host array) in load order, `count` of them (the progress bar's total). A field is allocated
    (`shapes[field]`, `dtype`, on `device`) when its first piece arrives, unless `model_fields` holds it already; a
    kept FP8 field's pieces are e4m3 and allocate it in e4m3, its scales come as "<field>.scale_inv" (float32, the
    128 x 128 block grid of the field's shape);
    each array is cast to `dtype` on the host if it differs and copied (on CUDA uploaded) into its rows, one at a
    time, so the host holds one piece beyond the memory-mapped files. Returns (model-level fields, per-layer fields)
    after the uploads are complete. `keep_dtype`: fields whose pieces keep their own dtype (a hybrid model's float32
    GDN decay inputs). (DenseModel.from_checkpoint's loop; xserv/parallel/load.py's shard loader; the hybrid
    models' loader.)"""
    model_fields = {} if model_fields is None else model_fields
    layer_fields: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]

    from ..progress import progress_bar

    bar = progress_bar(count, "loading weights", enabled=progress, unit="tensor", leave=False)
    try:
        for layer, field, rows, arr in pieces:
            fields = model_fields if layer is None else layer_fields[layer]
            # a kept FP8 field (xserv/models/fp8.py) keeps the file's e4m3 bytes, its "<field>.scale_inv" float32
            want = (arr.dtype if arr.dtype == E4M3 or field.endswith(SCALE_SUFFIX) or field in keep_dtype
                    else np.dtype(dtype))
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


@dataclass
class DenseLayer:
    """One decoder layer's weights as loaded (the fields LAYER_WEIGHTS fills; fused where the kernels take them fused)."""
    input_norm: Tensor  # [H]
    qkv: Tensor  # [q_size + 2 * kv_size, H]: q_proj, k_proj, v_proj rows
    o_proj: Tensor  # [H, q_size]
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2 * I, H]: gate_proj rows then up_proj rows
    down: Tensor  # [H, I]
    q_norm: Tensor | None = None  # [D] (QK_NORM architectures only)
    k_norm: Tensor | None = None  # [D]


class DenseCheckpoint:
    """The checkpoint classmethods of DenseModel: the weight table, validation, loading, the FP8 fields kept."""

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
                        max_positions: int | None = None, dtype=None) -> "DenseCheckpoint":
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
                    max_positions: int | None = None) -> "DenseCheckpoint":
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
