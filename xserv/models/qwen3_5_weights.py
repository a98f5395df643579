"""The hybrid decoders' checkpoint side: which tensors a Qwen3.5 / Qwen3-Next folder holds, and how they become the
fused fields the forward reads (xserv/models/qwen3_5.py).

Three layouts hold the same text model (../shared/qwen3.5/ARCHITECTURE.md, sections 3.1 and 10):
- `Qwen3_5ForConditionalGeneration` (the released checkpoints): text under `model.language_model.`, a vision tower
  under `model.visual.` (never read: its bytes stay on disk), the MTP draft module under `mtp.`, `lm_head` on top;
- `Qwen3_5ForCausalLM` (text-only exports): text under `model.`;
- `Qwen3NextForCausalLM`: text under `model.`, the GDN input projections fused and grouped by key head
  (`in_proj_qkvz`, `in_proj_ba`), un-grouped here into Qwen3.5's order.

What the forward gets, per layer:
- a GDN layer: `in_proj` [qkv | z | b | a] rows (one GEMM), `conv` [conv_dim, K], `A_log` / `dt_bias` in float32,
  the gated norm's plain weight, `out_proj`;
- an attention layer: `qkvg` [q | k | v | gate] rows, where q_proj's per-head interleave (head h: its query rows,
  then its gate rows) is split so that queries, keys and values are the packed qkv the attention ops take and the
  gates follow them;
- both: the zero-centred norms' `1 + w` folded into a plain RMSNorm weight (computed in float32, rounded once to the
  weight dtype), and the dense SwiGLU MLP's fused gate/up and down.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tensor import Tensor, as_dtype
from .dense_weights import FLOAT_DTYPES, WEIGHT_DTYPE, Weight, fill_fields
from .qwen3_5_config import FULL_ATTENTION, HybridConfig

# Fields whose checkpoint weight is zero-centred (the model multiplies by 1 + w): folded at load.
ZERO_CENTRED = ("input_norm", "post_norm", "q_norm", "k_norm", "final_norm")
FLOAT32_FIELDS = ("A_log", "dt_bias")
_MLP = (("mlp.gate_proj.weight", "gate_up", "gate"), ("mlp.up_proj.weight", "gate_up", "up"),
        ("mlp.down_proj.weight", "down", None))


@dataclass
class GdnLayer:
    input_norm: Tensor  # [H]
    in_proj: Tensor  # [conv_dim + value_dim + 2 nv, H]
    conv: Tensor  # [conv_dim, K]
    A_log: Tensor  # float32 [nv]
    dt_bias: Tensor  # float32 [nv]
    norm: Tensor  # [dv], the gated RMSNorm's plain weight
    out_proj: Tensor  # [H, value_dim]
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2 I, H]
    down: Tensor  # [H, I]


@dataclass
class AttentionLayer:
    input_norm: Tensor  # [H]
    qkvg: Tensor  # [2 q_size + 2 kv_size, H]
    q_norm: Tensor  # [hd]
    k_norm: Tensor  # [hd]
    o_proj: Tensor  # [H, q_size]
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2 I, H]
    down: Tensor  # [H, I]


def text_prefix(config: HybridConfig) -> str:
    return "model.language_model." if config.NESTED else "model."


def field_shapes(config: HybridConfig, kind: str) -> dict[str, tuple[int, ...]]:
    c = config
    h, i = c.hidden_size, c.intermediate_size
    common = {"input_norm": (h,), "post_norm": (h,), "gate_up": (2 * i, h), "down": (h, i)}
    if kind == FULL_ATTENTION:
        return {**common, "qkvg": (c.qkvg_size, h), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
                "o_proj": (h, c.q_size)}
    nv = c.linear_num_value_heads
    return {**common, "in_proj": (c.gdn_proj_size, h), "conv": (c.conv_dim, c.linear_conv_kernel_dim),
            "A_log": (nv,), "dt_bias": (nv,), "norm": (c.linear_value_head_dim,), "out_proj": (h, c.value_dim)}


def _layer_tensors(c: HybridConfig, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name under the layer prefix, shape, field) of layer i's checkpoint tensors."""
    h, i_mlp = c.hidden_size, c.intermediate_size
    rows = [("input_layernorm.weight", (h,), "input_norm"), ("post_attention_layernorm.weight", (h,), "post_norm"),
            ("mlp.gate_proj.weight", (i_mlp, h), "gate_up"), ("mlp.up_proj.weight", (i_mlp, h), "gate_up"),
            ("mlp.down_proj.weight", (h, i_mlp), "down")]
    if c.layer_types[i] == FULL_ATTENTION:
        return rows + [("self_attn.q_proj.weight", (2 * c.q_size, h), "qkvg"),
                       ("self_attn.k_proj.weight", (c.kv_size, h), "qkvg"),
                       ("self_attn.v_proj.weight", (c.kv_size, h), "qkvg"),
                       ("self_attn.o_proj.weight", (h, c.q_size), "o_proj"),
                       ("self_attn.q_norm.weight", (c.head_dim,), "q_norm"),
                       ("self_attn.k_norm.weight", (c.head_dim,), "k_norm")]
    nv, k = c.linear_num_value_heads, c.linear_conv_kernel_dim
    gdn = [("linear_attn.conv1d.weight", (c.conv_dim, 1, k), "conv"), ("linear_attn.A_log", (nv,), "A_log"),
           ("linear_attn.dt_bias", (nv,), "dt_bias"), ("linear_attn.norm.weight", (c.linear_value_head_dim,), "norm"),
           ("linear_attn.out_proj.weight", (h, c.value_dim), "out_proj")]
    if c.ARCHITECTURE == "Qwen3NextForCausalLM":
        proj = [("linear_attn.in_proj_qkvz.weight", (c.conv_dim + c.value_dim, h), "in_proj"),
                ("linear_attn.in_proj_ba.weight", (2 * nv, h), "in_proj")]
    else:
        proj = [("linear_attn.in_proj_qkv.weight", (c.conv_dim, h), "in_proj"),
                ("linear_attn.in_proj_z.weight", (c.value_dim, h), "in_proj"),
                ("linear_attn.in_proj_b.weight", (nv, h), "in_proj"),
                ("linear_attn.in_proj_a.weight", (nv, h), "in_proj")]
    return rows + proj + gdn


def weight_table(config: HybridConfig) -> list[Weight]:
    """The text model's tensors, every one of which a checkpoint must hold (what loading reads)."""
    c, p = config, text_prefix(config)
    table = [Weight(p + "embed_tokens.weight", (c.vocab_size, c.hidden_size), None, "embed")]
    for i in range(c.num_hidden_layers):
        table += [Weight(f"{p}layers.{i}.{name}", shape, i, field) for name, shape, field in _layer_tensors(c, i)]
    table.append(Weight(p + "norm.weight", (c.hidden_size,), None, "final_norm"))
    if not c.tie_word_embeddings:
        table.append(Weight("lm_head.weight", (c.vocab_size, c.hidden_size), None, "lm_head"))
    return table


def extra_tensors(config: HybridConfig) -> list[Weight]:
    """Tensors a released folder holds beside the text model and that loading leaves on disk: the MTP draft module
    (`mtp.*`: its embedding-side and hidden-side norms, fc over [embedding | hidden], one full-attention layer, a
    norm) and, for the multimodal architecture, the vision tower (`model.visual.*`). The random checkpoint writer
    includes them, so loaders are tested against what users download."""
    c = config
    h = c.hidden_size
    out = []
    if c.mtp_num_hidden_layers:
        out += [Weight("mtp.pre_fc_norm_embedding.weight", (h,), None, "mtp_norm"),
                Weight("mtp.pre_fc_norm_hidden.weight", (h,), None, "mtp_norm"),
                Weight("mtp.fc.weight", (h, 2 * h), None, "mtp")]
        full = c.replace(layer_types=(FULL_ATTENTION,) * c.num_hidden_layers)
        for j in range(c.mtp_num_hidden_layers):
            out += [Weight(f"mtp.layers.{j}.{name}", shape, None, "mtp_norm" if name.endswith("norm.weight") else "mtp")
                    for name, shape, _ in _layer_tensors(full, 0)]
        out.append(Weight("mtp.norm.weight", (h,), None, "mtp_norm"))
    vision = c.outer.get("vision_config") if c.NESTED else None
    if isinstance(vision, dict):
        out += _vision_tensors(vision)
    return out


def _vision_tensors(v: dict) -> list[Weight]:
    """The Qwen3-VL vision tower of the multimodal checkpoints: a 3-D patch embedding, learned position embeddings,
    `depth` pre-LayerNorm ViT blocks with biases, and the 2x2 patch merger into the text hidden size."""
    d, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    merged = d * v.get("spatial_merge_size", 2) ** 2
    patch = (v.get("in_channels", 3), v.get("temporal_patch_size", 2), v["patch_size"], v["patch_size"])
    shapes = [("patch_embed.proj.weight", (d, *patch)), ("patch_embed.proj.bias", (d,)),
              ("pos_embed.weight", (v.get("num_position_embeddings", 2304), d))]
    for b in range(v["depth"]):
        shapes += [(f"blocks.{b}.{n}", s) for n, s in (
            ("norm1.weight", (d,)), ("norm1.bias", (d,)), ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
            ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)), ("norm2.weight", (d,)), ("norm2.bias", (d,)),
            ("mlp.linear_fc1.weight", (inter, d)), ("mlp.linear_fc1.bias", (inter,)),
            ("mlp.linear_fc2.weight", (d, inter)), ("mlp.linear_fc2.bias", (d,)))]
    shapes += [("merger.norm.weight", (d,)), ("merger.norm.bias", (d,)),
               ("merger.linear_fc1.weight", (merged, merged)), ("merger.linear_fc1.bias", (merged,)),
               ("merger.linear_fc2.weight", (out, merged)), ("merger.linear_fc2.bias", (out,))]
    return [Weight("model.visual." + n, s, None, "visual_norm" if "norm" in n else "visual") for n, s in shapes]


def random_init(w: Weight, config: HybridConfig, perturb_norms: bool) -> tuple[float, float]:
    """(mean, std) of a random checkpoint's values for w. Zero-centred norms are 0 in transformers' initialisation
    (gain 1 + 0); perturbed, N(0, 0.1), so that a kernel ignoring a norm weight shows in the logits. The gated norm's
    plain weight is 1 (+ N(0, 0.1)). The GDN decay inputs are drawn where trained models put them: A_log around 0
    (A ~ 1) and dt_bias around -2 (softplus ~ 0.13), a per-token decay near 0.88, so that the state carries a few
    tokens back and the tests see it; the depthwise conv taps have the scale of a 4-tap filter."""
    zero_centred = w.field in ZERO_CENTRED or w.field == "mtp_norm"
    if zero_centred or w.field == "norm":
        mean = 0.0 if zero_centred else 1.0
        return (mean, 0.1 if perturb_norms else 0.0)
    if w.field == "visual_norm":
        return (1.0 if w.name.endswith("weight") else 0.0, 0.0)
    if w.field == "A_log":
        return (0.0, 0.5)
    if w.field == "dt_bias":
        return (-2.0, 0.5)
    if w.field == "conv":
        return (0.0, 0.3)
    return (0.0, config.initializer_range)


def validate(config: HybridConfig, reader) -> None:
    """The text model's tensors must be there in their shapes (the vision tower and MTP module are not read)."""
    table = weight_table(config)
    expected = {w.name: w.shape for w in table}
    dtypes = {w.name: FLOAT_DTYPES for w in table}
    if config.tie_word_embeddings and "lm_head.weight" in reader.names():
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        dtypes["lm_head.weight"] = FLOAT_DTYPES
    if any(n.endswith(".weight_scale_inv") for n in reader.names()):
        raise ValueError("FP8 hybrid checkpoints are not supported yet: load the bfloat16 release")
    reader.validate(expected, dtypes, ignored_prefixes=("mtp.", "model.visual."))


def _placements(config: HybridConfig, name: str, field: str, arr: np.ndarray):
    """(field, first row, array) pieces of one checkpoint tensor inside its fused field."""
    c = config
    if field == "qkvg":
        q, kv = c.q_size, c.kv_size
        if name.endswith("q_proj.weight"):  # per head: hd query rows, then hd gate rows
            per_head = arr.reshape(c.num_attention_heads, 2, c.head_dim, -1)
            yield field, 0, per_head[:, 0].reshape(q, -1)
            yield field, q + 2 * kv, per_head[:, 1].reshape(q, -1)
        elif name.endswith("k_proj.weight"):
            yield field, q, arr
        else:
            yield field, q + kv, arr
        return
    if field == "in_proj":
        yield from _in_proj_pieces(c, name, arr)
        return
    if field == "conv":
        yield field, 0, arr.reshape(arr.shape[0], arr.shape[-1])
        return
    rows = {"mlp.gate_proj.weight": 0, "mlp.up_proj.weight": c.intermediate_size}
    yield field, next((r for suffix, r in rows.items() if name.endswith(suffix)), 0), arr


def _in_proj_pieces(c: HybridConfig, name: str, arr: np.ndarray):
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    z_row, b_row = c.conv_dim, c.conv_dim + c.value_dim
    if name.endswith("in_proj_qkv.weight"):
        yield "in_proj", 0, arr
    elif name.endswith("in_proj_z.weight"):
        yield "in_proj", z_row, arr
    elif name.endswith("in_proj_b.weight"):
        yield "in_proj", b_row, arr
    elif name.endswith("in_proj_a.weight"):
        yield "in_proj", b_row + nv, arr
    elif name.endswith("in_proj_qkvz.weight"):  # nk groups of [q_g | k_g | v_g (r heads) | z_g (r heads)]
        r = nv // nk
        g = arr.reshape(nk, 2 * dk + 2 * r * dv, -1)
        yield "in_proj", 0, g[:, :dk].reshape(nk * dk, -1)
        yield "in_proj", c.key_dim, g[:, dk:2 * dk].reshape(nk * dk, -1)
        yield "in_proj", 2 * c.key_dim, g[:, 2 * dk:2 * dk + r * dv].reshape(nv * dv, -1)
        yield "in_proj", z_row, g[:, 2 * dk + r * dv:].reshape(nv * dv, -1)
    elif name.endswith("in_proj_ba.weight"):  # nk groups of [b_g (r) | a_g (r)]
        r = nv // nk
        g = arr.reshape(nk, 2 * r, -1)
        yield "in_proj", b_row, g[:, :r].reshape(nv, -1)
        yield "in_proj", b_row + nv, g[:, r:].reshape(nv, -1)
    else:
        raise ValueError(f"internal: no placement for {name}")


def _convert(field: str, arr: np.ndarray, dtype) -> np.ndarray:
    """A piece in the dtype its field keeps: float32 for the GDN's decay inputs, `1 + w` rounded once to `dtype` for
    a zero-centred norm, else as it is (fill_fields casts it)."""
    if field in FLOAT32_FIELDS:
        return arr.astype(np.float32)
    if field in ZERO_CENTRED:
        return (1.0 + arr.astype(np.float32)).astype(dtype)
    return arr


# how many pieces a checkpoint tensor makes in its fused field (_placements), for the progress bar's total
_PIECES = {"q_proj.weight": 2, "in_proj_qkvz.weight": 4, "in_proj_ba.weight": 2}


def load_fields(config: HybridConfig, reader, device: str, dtype=None, progress: bool = False):
    """(model-level fields, per-layer field dicts) of a checkpoint: each tensor read from the memory-mapped file,
    placed and converted, and copied into its rows one piece at a time (dense_weights.fill_fields)."""
    validate(config, reader)
    dtype = as_dtype(dtype) if dtype is not None else WEIGHT_DTYPE[device]
    table = weight_table(config)
    shapes = {"embed": (config.vocab_size, config.hidden_size), "final_norm": (config.hidden_size,),
              "lm_head": (config.vocab_size, config.hidden_size)}
    for kind in set(config.layer_types):  # the two kinds' fields: shared names have the same shape
        shapes.update(field_shapes(config, kind))

    def pieces():
        for w in table:
            for field, row, piece in _placements(config, w.name, w.field, reader.get(w.name)):
                yield w.layer, field, (row, row + piece.shape[0]), _convert(field, piece, dtype)

    count = sum(next((n for suffix, n in _PIECES.items() if w.name.endswith(suffix)), 1) for w in table)
    return fill_fields(pieces(), count, shapes, config.num_hidden_layers, dtype, device, progress,
                       keep_dtype=FLOAT32_FIELDS)
