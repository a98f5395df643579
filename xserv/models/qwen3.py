"""Qwen3 (dense): weights and the forward pass, written once against xserv.ops.

The forward takes a Batch (packed tokens of several sequences, positions, block tables, slot mapping, which rows
need logits) and the paged KV cache, so prefill, chunked prefill, decode and mixed batches share one code path.
CUDA tensors run the kernels (bf16 storage, fp32 accumulation); CPU tensors run the NumPy references (float32 math
on the same bf16 tensors, rounding where the kernels round).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops.activation import silu_and_mul
from ..ops.attention import attention_decode, attention_prefill, write_kv_packed
from ..ops.embedding import embedding
from ..ops.linear import linear
from ..ops.rmsnorm import fused_add_rmsnorm
from ..ops.rope import qk_norm_rope, rope_cos_sin_table
from ..tensor import Tensor, as_dtype, bfloat16, float32

LAYER_PREFIX = "model.layers.{i}."
# The ops take bf16 activations and weights on both backends (the NumPy references compute in float32 and round
# where the kernels round), so the CPU model is the reference of the CUDA one step by step.
WEIGHT_DTYPE = {"cuda": bfloat16, "cpu": bfloat16}
# The residual stream between layers stays in float32: rounding it to bf16 twice per layer (as transformers does
# in bf16) put the 8B-shaped model's logits 6e-2 (relative L2) away from transformers' float32 logits.
RESIDUAL_DTYPE = float32


@dataclass
class Qwen3Layer:
    input_norm: Tensor  # [H]
    qkv: Tensor  # [q_size + 2 * kv_size, H]: q_proj, k_proj, v_proj rows
    q_norm: Tensor  # [D]
    k_norm: Tensor  # [D]
    o_proj: Tensor  # [H, q_size]
    post_norm: Tensor  # [H]
    gate_up: Tensor  # [2 * I, H]: gate_proj rows then up_proj rows
    down: Tensor  # [H, I]


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3ForCausalLM checkpoint must hold, with its shape (Hugging Face names)."""
    return config.weight_shapes()


class Workspace:
    """Activation buffers for up to `max_tokens` packed tokens and `max_logits` logit rows. The forward writes
    into views of these, so a step allocates nothing (what a CUDA graph needs)."""

    def __init__(self, config, max_tokens: int, max_logits: int, device: str, dtype):
        c = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.max_tokens, self.max_logits = max_tokens, max_logits

        def buf(cols, dt=dtype, rows=max_tokens):
            return Tensor.empty((rows, cols), dt, device)

        self.hidden = buf(c.hidden_size)
        self.residual = buf(c.hidden_size, RESIDUAL_DTYPE)
        self.normed = buf(c.hidden_size)
        self.qkv = buf(q + 2 * kv)
        self.attn = buf(q)
        self.gate_up = buf(2 * c.intermediate_size)
        self.act = buf(c.intermediate_size)
        self.gathered = buf(c.hidden_size, rows=max_logits)
        self.logits = buf(c.vocab_size, float32, rows=max_logits)

    def fits(self, num_tokens: int, num_logits: int) -> bool:
        return num_tokens <= self.max_tokens and num_logits <= self.max_logits


class Qwen3Model:
    def __init__(self, config, device: str, embed: Tensor, layers: list[Qwen3Layer], final_norm: Tensor,
                 lm_head: Tensor, max_positions: int | None = None):
        self.config = config
        self.device = device
        self.dtype = embed.dtype
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        c = config
        self.num_q_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size = self.num_q_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.eps = float(c.rms_norm_eps)
        self.scale = float(self.head_dim) ** -0.5
        self.max_positions = int(max_positions or c.max_position_embeddings)
        table = rope_cos_sin_table(self.head_dim, self.max_positions, c.rope_theta, c.rope_scaling)
        self.cos_sin = Tensor.from_numpy(np.ascontiguousarray(table, np.float32), device)

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, config, reader, device: str = "cuda", progress: bool = True,
                        max_positions: int | None = None, dtype=None) -> "Qwen3Model":
        """Upload a checkpoint into `dtype` tensors (default: WEIGHT_DTYPE[device]; other float dtypes in the file
        are cast one tensor at a time on the host). Fused q/k/v and gate/up weights are filled slice by slice in
        place; on CUDA every tensor goes from the memory-mapped file straight to device memory."""
        shapes = expected_shapes(config)
        extra = {}
        if config.tie_word_embeddings and "lm_head.weight" in reader.names():
            extra["lm_head.weight"] = (config.vocab_size, config.hidden_size)  # present but unused
        reader.validate({**shapes, **extra})
        dtype = as_dtype(dtype) if dtype is not None else WEIGHT_DTYPE[device]
        c = config
        q, kv, h, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(shapes), desc="loading weights", unit="tensor", leave=False)

        def upload(name: str, dest: Tensor | None = None) -> Tensor:
            arr = reader.get(name)
            if arr.dtype != dtype:
                arr = arr.astype(dtype)
            if dest is None:
                dest = Tensor.empty(arr.shape, dtype, device)
            dest.copy_(np.ascontiguousarray(arr))
            if bar is not None:
                bar.update(1)
            return dest

        try:
            embed = upload("model.embed_tokens.weight")
            layers = []
            for i in range(c.num_hidden_layers):
                p = LAYER_PREFIX.format(i=i)
                qkv = Tensor.empty((q + 2 * kv, h), dtype, device)
                upload(p + "self_attn.q_proj.weight", qkv[0:q])
                upload(p + "self_attn.k_proj.weight", qkv[q:q + kv])
                upload(p + "self_attn.v_proj.weight", qkv[q + kv:q + 2 * kv])
                gate_up = Tensor.empty((2 * inter, h), dtype, device)
                upload(p + "mlp.gate_proj.weight", gate_up[0:inter])
                upload(p + "mlp.up_proj.weight", gate_up[inter:2 * inter])
                layers.append(Qwen3Layer(
                    input_norm=upload(p + "input_layernorm.weight"),
                    qkv=qkv,
                    q_norm=upload(p + "self_attn.q_norm.weight"),
                    k_norm=upload(p + "self_attn.k_norm.weight"),
                    o_proj=upload(p + "self_attn.o_proj.weight"),
                    post_norm=upload(p + "post_attention_layernorm.weight"),
                    gate_up=gate_up,
                    down=upload(p + "mlp.down_proj.weight"),
                ))
            final_norm = upload("model.norm.weight")
            lm_head = embed if c.tie_word_embeddings else upload("lm_head.weight")
        finally:
            if bar is not None:
                bar.close()
        if device == "cuda":
            from ..runtime import synchronize

            synchronize()
        model = cls(config, device, embed, layers, final_norm, lm_head, max_positions=max_positions)
        if device == "cpu":  # frozen: lets the CPU GEMM cache its float32 copies (xserv/ops/linear.py)
            for tensor in model.weight_tensors():
                tensor.array.flags.writeable = False
        return model

    def weight_tensors(self) -> list[Tensor]:
        tensors = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += list(vars(layer).values())
        return tensors

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weight_tensors())

    def make_workspace(self, max_tokens: int, max_logits: int) -> Workspace:
        return Workspace(self.config, max_tokens, max_logits, self.device, self.dtype)

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, batch, kv_cache, workspace: Workspace | None = None) -> Tensor:
        """Logits float32 [batch.num_logits, vocab] for the rows batch.logits_indices names (every row if None)."""
        t = batch.num_tokens
        n = t if batch.logits_indices is None else batch.logits_indices.shape[0]
        if workspace is None or not workspace.fits(t, n):
            workspace = self.make_workspace(t, n)
        ws = workspace
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        residual = ws.residual[:t]
        normed = ws.normed[:t]
        hidden = ws.hidden[:t]
        qkv = ws.qkv[:t]
        qkv3 = qkv.view(t, hq + 2 * hkv, d)
        attn = ws.attn[:t]
        attn3 = attn.view(t, hq, d)
        gate_up = ws.gate_up[:t]
        act = ws.act[:t]

        embedding(batch.input_ids, self.embed, out=hidden)
        residual.zero_()  # the first layer's add starts the float32 stream from the embeddings, exactly
        for i, layer in enumerate(self.layers):
            fused_add_rmsnorm(hidden, residual, layer.input_norm, self.eps, out=normed)
            linear(normed, layer.qkv, out=qkv)
            qk_norm_rope(qkv3, layer.q_norm, layer.k_norm, batch.positions, self.cos_sin, hq, hkv, self.eps)
            write_kv_packed(qkv3, hq, kv_cache.k[i], kv_cache.v[i], batch.slot_mapping)
            if batch.max_q_len > 1:
                attention_prefill(qkv3, kv_cache.k[i], kv_cache.v[i], batch.cu_seqlens_q, batch.kv_lens,
                                  batch.block_tables, self.scale, batch.max_q_len, out=attn3, num_q_heads=hq)
            else:
                attention_decode(qkv3, kv_cache.k[i], kv_cache.v[i], batch.kv_lens, batch.block_tables,
                                 self.scale, batch.max_kv_len, out=attn3, num_q_heads=hq)
            linear(attn, layer.o_proj, out=hidden)
            fused_add_rmsnorm(hidden, residual, layer.post_norm, self.eps, out=normed)
            linear(normed, layer.gate_up, out=gate_up)
            silu_and_mul(gate_up, out=act)
            linear(act, layer.down, out=hidden)
        fused_add_rmsnorm(hidden, residual, self.final_norm, self.eps, out=normed)
        if batch.logits_indices is not None:
            rows = ws.gathered[:n]
            embedding(batch.logits_indices, normed, out=rows)
        else:
            rows = normed
        return linear(rows, self.lm_head, out=ws.logits[:n])
