"""The hybrid Gated DeltaNet decoders (Qwen3.5 / 3.6 / 3.8, their text-only export, Qwen3-Next with dense MLPs): the
model class, its workspace and its forward. ../shared/qwen3.5/ARCHITECTURE.md is the specification.

Three of every four layers are Gated DeltaNet (linear attention): a fused input projection [qkv | z | b | a], a causal
depthwise conv + SiLU over qkv, the gated delta rule with a float32 state per sequence, a gated RMSNorm with z, and
the output projection. The others are gated softmax attention: one projection [q | k | v | gate], q/k head norms,
RoPE on the first quarter of each head, paged attention with head_dim 256, the output times sigmoid(gate), o_proj.
Every layer has the dense SwiGLU MLP. The GDN layers keep their state in the engine's StateCache (`kv_cache.state`,
pools "conv" and "ssm", indexed by GDN layer), the attention layers keep paged KV (`kv_cache.k[j]`, indexed by
attention layer): `kv_layout` counts only those.

Rounding points follow transformers' bf16 model (the ops say where); the residual stream stays float32 between
layers as in the dense decoder (xserv/models/dense_forward.py says why).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..ops.activation import silu_and_mul
from ..ops.attention import attention_decode_rope, attention_output_gate, attention_prefill
from ..ops.embedding import embedding
from ..ops.gdn import causal_conv1d_silu, gated_delta_rule, gated_rmsnorm_silu
from ..ops.gemv import gemv_supported, linear_add, rmsnorm_linear, rmsnorm_linear_silu_mul
from ..ops.rmsnorm import fused_add_rmsnorm
from ..ops.rope import qk_norm_rope_write_kv, rope_cos_sin_table
from ..tensor import Tensor, bfloat16, float32
from . import qwen3_5_weights as W
from .base import KVLayout, StatePool
from .dense_forward import RESIDUAL_DTYPE, DenseForward
from .qwen3_5_config import FULL_ATTENTION, HybridConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3NextConfig

__all__ = ["HybridModel", "Qwen3_5Config", "Qwen3_5TextConfig", "Qwen3NextConfig"]


def state_layout(c: HybridConfig) -> tuple[StatePool, ...]:
    """Each GDN layer's per-sequence state: the last K-1 conv inputs (bf16 [K-1, conv_dim]) and the SSM state
    (float32 [nv, dk, dv])."""
    n = len(c.gdn_layers)
    return (StatePool("conv", n, (c.linear_conv_kernel_dim - 1, c.conv_dim), bfloat16),
            StatePool("ssm", n, (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), float32))


class HybridWorkspace:
    """Activation buffers for up to `max_tokens` packed tokens and `max_logits` logit rows (a step allocates
    nothing: what a CUDA graph needs)."""

    def __init__(self, c: HybridConfig, max_tokens: int, max_logits: int, device: str, dtype, logits_width: int):
        self.max_tokens, self.max_logits = max_tokens, max_logits

        def buf(cols, dt=dtype, rows=max_tokens):
            return Tensor.empty((rows, cols), dt, device)

        self.hidden = buf(c.hidden_size)
        self.residual = buf(c.hidden_size, RESIDUAL_DTYPE)
        self.normed = buf(c.hidden_size)
        self.proj = buf(c.gdn_proj_size)  # GDN: [qkv | z | b | a]
        self.conv_out = buf(c.conv_dim)
        self.delta_out = buf(c.value_dim)
        self.gated = buf(c.value_dim)
        self.qkvg = buf(c.qkvg_size)  # attention: [q | k | v | gate]
        self.attn = buf(c.q_size)
        self.gate_up = buf(2 * c.intermediate_size)
        self.act = buf(c.intermediate_size)
        self.gathered = buf(c.hidden_size, rows=max_logits)
        self.logits = buf(logits_width, float32, rows=max_logits)

    def fits(self, num_tokens: int, num_logits: int) -> bool:
        return num_tokens <= self.max_tokens and num_logits <= self.max_logits


class HybridModel(DenseForward):
    """Implements xserv.models.base.CausalLM for the hybrid decoders. DenseForward supplies the projection
    (`_project`: GEMV or cuBLASLt by shape) and the unfused MLP."""

    # Up to this many tokens a CUDA forward takes the fused GEMV path (the dense decoder's measured choice: one row;
    # docs/kernels/gemv.md).
    FUSED_MAX_TOKENS: ClassVar[int] = 1
    TOKENIZER_PRESET: ClassVar[str] = "tokenizer_qwen3_5"
    GENERATION_CONFIG_PRESET: ClassVar[str] = "generation_config_qwen3_5.json"

    def __init__(self, config: HybridConfig, device: str, embed: Tensor, layers: list, final_norm: Tensor,
                 lm_head: Tensor, max_positions: int | None = None):
        self.config = config
        self.device = device
        self.dtype = embed.dtype
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.tied = lm_head is embed  # (limit_logits makes the head a view of the table's first rows)
        self.eps = float(config.rms_norm_eps)
        self.scale = float(config.head_dim) ** -0.5
        self.max_positions = int(max_positions or config.context_length)
        self.logits_width = config.vocab_size  # limit_logits: the tokenizer's tokens only
        self.fused_gemv = True
        self.comm = None
        self._fp8 = False
        self.fp8_scratch = None
        # the ordinal of each layer among its kind: attention layer j uses KV pool j, GDN layer j state slot pools j
        self.ordinal = [sum(1 for t in config.layer_types[:i] if t == kind)
                        for i, kind in enumerate(config.layer_types)]
        table = rope_cos_sin_table(config.rotary_dim, self.max_positions, config.rope_theta, None)
        self.cos_sin = Tensor.from_numpy(np.ascontiguousarray(table, np.float32), device)

    # ---- what the engine reads ----------------------------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        c = self.config
        return KVLayout(len(c.attention_layers), c.num_key_value_heads, c.head_dim)

    @property
    def state_layout(self) -> tuple[StatePool, ...]:
        return state_layout(self.config)

    def limit_logits(self, num_tokens: int) -> int:
        """Compute logits for the first `num_tokens` ids only (the tokenizer's: these checkpoints pad the head to
        248,320 rows past its 248,077 tokens), so that a padding row is never sampled. Returns the new width."""
        if not 0 < num_tokens <= self.config.vocab_size:
            raise ValueError(f"num_tokens must be in 1..{self.config.vocab_size}, got {num_tokens}")
        self.lm_head = self.lm_head[:num_tokens]
        self.logits_width = num_tokens
        return num_tokens

    @classmethod
    def kernel_shapes(cls, config, tp_size: int = 1) -> dict[str, int]:
        return {"head_dim": int(config.head_dim),
                "group": int(config.num_attention_heads // config.num_key_value_heads), "gdn": 1}

    @classmethod
    def fp8_load_notice(cls, config) -> str | None:
        return None

    # ---- checkpoint ---------------------------------------------------------------------------------------------
    @classmethod
    def weight_table(cls, config) -> list:
        return W.weight_table(config)

    @classmethod
    def extra_tensors(cls, config) -> list:
        return W.extra_tensors(config)

    @classmethod
    def random_init(cls, weight, config, perturb_norms: bool) -> tuple[float, float]:
        return W.random_init(weight, config, perturb_norms)

    @classmethod
    def validate_checkpoint(cls, config, reader, table=None) -> None:
        W.validate(config, reader)

    @classmethod
    def from_checkpoint(cls, config, reader, device: str = "cuda", progress: bool = True,
                        max_positions: int | None = None, dtype=None) -> "HybridModel":
        model_fields, layer_fields = W.load_fields(config, reader, device, dtype, progress)
        layers = [(W.AttentionLayer if kind == FULL_ATTENTION else W.GdnLayer)(**fields)
                  for kind, fields in zip(config.layer_types, layer_fields)]
        embed = model_fields["embed"]
        model = cls(config, device, embed, layers, model_fields["final_norm"], model_fields.get("lm_head", embed),
                    max_positions=max_positions)
        if device == "cpu":  # frozen: lets the CPU GEMM cache its float32 copies (xserv/ops/linear.py)
            for t in model.weight_tensors():
                t.array.flags.writeable = False
        return model

    def weight_tensors(self) -> list[Tensor]:
        tensors = [self.embed, self.final_norm] + ([] if self.tied else [self.lm_head])
        for layer in self.layers:
            tensors += list(vars(layer).values())
        return tensors

    def num_parameters(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.weight_tensors())

    @property
    def has_fp8_weights(self) -> bool:
        return False

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weight_tensors())

    # ---- forward ------------------------------------------------------------------------------------------------
    def make_workspace(self, max_tokens: int, max_logits: int) -> HybridWorkspace:
        return HybridWorkspace(self.config, max_tokens, max_logits, self.device, self.dtype, self.logits_width)

    def fused_forward_ok(self, num_tokens: int, num_logits: int) -> bool:
        """Does a CUDA forward of this many tokens take the fused GEMV path (the one-token decode step: each
        projection a GEMV kernel with the RMSNorm before it or the residual add after it folded in, as the dense
        decoder's; xserv/ops/gemv.py)?"""
        c = self.config
        return (self.device == "cuda" and self.fused_gemv and num_tokens <= self.FUSED_MAX_TOKENS
                and all(gemv_supported(num_tokens, k) for k in (c.hidden_size, c.q_size, c.value_dim,
                                                                 c.intermediate_size))
                and gemv_supported(num_logits, c.hidden_size))

    def forward(self, batch, kv_cache, workspace: HybridWorkspace | None = None) -> Tensor:
        """Logits float32 [rows, logits_width] for the rows batch.logits_indices names (every row if None)."""
        if batch.state_slots is None:
            raise ValueError("a hybrid model's batch needs state_slots (the engine's per-sequence state rows)")
        state = getattr(kv_cache, "state", None)
        if state is None:
            raise ValueError("a hybrid model needs the engine's state cache (kv_cache.state)")
        t = batch.num_tokens
        n = t if batch.logits_indices is None else batch.logits_indices.shape[0]
        if workspace is None or not workspace.fits(t, n):
            workspace = self.make_workspace(t, n)
        if self.fused_forward_ok(t, n):
            return self._forward_fused(batch, kv_cache, state, workspace, t, n)
        ws = workspace
        residual, normed, hidden = ws.residual[:t], ws.normed[:t], ws.hidden[:t]
        embedding(batch.input_ids, self.embed, out=hidden, feed=batch.feed)
        residual.zero_()  # the first layer's add starts the float32 stream from the embeddings, exactly
        for i, layer in enumerate(self.layers):
            fused_add_rmsnorm(hidden, residual, layer.input_norm, self.eps, out=normed)
            if self.config.layer_types[i] == FULL_ATTENTION:
                qkvg = self._project(normed, layer.qkvg, ws.qkvg[:t])
                mixed, out_proj = self._attention(self.ordinal[i], layer, batch, kv_cache, ws, qkvg), layer.o_proj
            else:
                proj = self._project(normed, layer.in_proj, ws.proj[:t])
                mixed, out_proj = self._gated_delta(self.ordinal[i], layer, batch, state, ws, proj), layer.out_proj
            self._project(mixed, out_proj, hidden)
            fused_add_rmsnorm(hidden, residual, layer.post_norm, self.eps, out=normed)
            self._mlp(i, layer, ws, normed, hidden, ws.gate_up[:t], ws.act[:t])
        fused_add_rmsnorm(hidden, residual, self.final_norm, self.eps, out=normed)
        rows = normed
        if batch.logits_indices is not None:
            rows = ws.gathered[:n]
            embedding(batch.logits_indices, normed, out=rows)
        return self._project(rows, self.lm_head, ws.logits[:n])

    def _forward_fused(self, batch, kv_cache, state, ws: HybridWorkspace, t: int, n: int) -> Tensor:
        """The one-token step with the norms and residual adds inside the projections' GEMV kernels (the same
        rounding points as `forward`'s ops): per layer, the normed input projection, the mixer, the output projection
        added into the float32 residual, the normed gate/up projection with SiLU-and-mul, the down projection added."""
        residual = ws.residual[:t]
        embedding(batch.input_ids, self.embed, out=residual, feed=batch.feed)  # the float32 stream, exactly
        for i, layer in enumerate(self.layers):
            if self.config.layer_types[i] == FULL_ATTENTION:
                qkvg = rmsnorm_linear(residual, layer.input_norm, self.eps, layer.qkvg, out=ws.qkvg[:t])
                linear_add(self._attention(self.ordinal[i], layer, batch, kv_cache, ws, qkvg), layer.o_proj, residual)
            else:
                proj = rmsnorm_linear(residual, layer.input_norm, self.eps, layer.in_proj, out=ws.proj[:t])
                linear_add(self._gated_delta(self.ordinal[i], layer, batch, state, ws, proj), layer.out_proj, residual)
            act = rmsnorm_linear_silu_mul(residual, layer.post_norm, self.eps, layer.gate_up, out=ws.act[:t])
            linear_add(act, layer.down, residual)
        return rmsnorm_linear(residual, self.final_norm, self.eps, self.lm_head, out=ws.logits[:n],
                              rows=batch.logits_indices)

    def _gated_delta(self, j: int, layer, batch, state, ws: HybridWorkspace, proj: Tensor) -> Tensor:
        """GDN layer j (its ordinal among GDN layers: its state pools) from its fused projection [t, qkv|z|b|a] to
        the gated norm's output bf16 [t, value_dim] (before out_proj)."""
        c, t = self.config, batch.num_tokens
        nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        meta = (batch.cu_seqlens_q, batch.kv_lens, batch.state_slots)
        u = causal_conv1d_silu(proj, layer.conv, state["conv"][j], *meta, conv_dim=c.conv_dim,
                               max_q_len=batch.max_q_len, out=ws.conv_out[:t])
        o = gated_delta_rule(u, proj, layer.A_log, layer.dt_bias, state["ssm"][j], *meta,
                             num_k_heads=c.linear_num_key_heads, num_v_heads=nv, head_k_dim=c.linear_key_head_dim,
                             head_v_dim=dv, ba_col=c.conv_dim + c.value_dim, max_q_len=batch.max_q_len,
                             out=ws.delta_out[:t])
        return gated_rmsnorm_silu(o, proj, layer.norm, self.eps, z_col=c.conv_dim, num_v_heads=nv, head_v_dim=dv,
                                  out=ws.gated[:t])

    def _attention(self, j: int, layer, batch, kv_cache, ws: HybridWorkspace, qkvg: Tensor) -> Tensor:
        """Attention layer j (its ordinal among attention layers: its KV pool) from its fused projection
        [t, q|k|v|gate] to the gated attention output bf16 [t, q_size] (before o_proj). Decode batches: q/k norm,
        partial RoPE, the KV write and attention in one kernel; prefill: the norm/RoPE/KV-write kernel, then paged
        attention."""
        c, t = self.config, batch.num_tokens
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkvg3 = qkvg.view(t, 2 * hq + 2 * hkv, d)
        attn3 = ws.attn[:t].view(t, hq, d)
        if batch.max_q_len == 1:
            attention_decode_rope(qkvg3, layer.q_norm, layer.k_norm, batch.positions, self.cos_sin, hq, self.eps,
                                  kv_cache.k[j], kv_cache.v[j], batch.slot_mapping, batch.kv_lens,
                                  batch.block_tables, self.scale, batch.max_kv_len, out=attn3)
        else:
            qk_norm_rope_write_kv(qkvg3, layer.q_norm, layer.k_norm, batch.positions, self.cos_sin, hq, hkv, self.eps,
                                  kv_cache.k[j], kv_cache.v[j], batch.slot_mapping)
            attention_prefill(qkvg3, kv_cache.k[j], kv_cache.v[j], batch.cu_seqlens_q, batch.kv_lens,
                              batch.block_tables, self.scale, batch.max_q_len, out=attn3, num_q_heads=hq)
        attention_output_gate(attn3, qkvg3, hq, hkv, out=attn3)
        return ws.attn[:t]
