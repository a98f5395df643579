"""The dense decoder's forward pass: the activation workspace and `DenseForward`, the forward half of `DenseModel`
(xserv/models/dense.py), written once against xserv.ops.

A layer is pre-norm attention (fused QKV GEMM, optional q/k head RMSNorm, RoPE, paged attention, o_proj) and a
pre-norm SwiGLU MLP (fused gate/up GEMM, down). A mixture-of-experts model (qwen3_moe.py) reuses it through the hooks
`_mlp` / `_post_attention_fused` (its sparse MLP block).

The forward takes a Batch (packed tokens of several sequences, positions, block tables, slot mapping, which rows
need logits) and the paged KV cache, so prefill, chunked prefill, decode and mixed batches share one code path.
CUDA tensors run the kernels (bf16 storage, fp32 accumulation); CPU tensors run the NumPy references (float32 math
on the same bf16 tensors, rounding where the kernels round).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..fp8_format import Fp8Weight
from ..ops.activation import silu_and_mul
from ..ops.attention import attention_decode, attention_decode_rope, attention_prefill
from ..ops.embedding import embedding
from ..ops.fp8_linear import Fp8Scratch, linear_fp8
from ..ops.gemv import (fp8_row_supported, gemv_supported, linear_add, linear_gemv, prefer_gemv, rmsnorm_linear,
                        rmsnorm_linear_silu_mul)
from ..ops.linear import linear
from ..ops.rmsnorm import fused_add_rmsnorm
from ..ops.rope import qk_norm_rope_write_kv
from ..tensor import Tensor, float32

if TYPE_CHECKING:
    from .dense_weights import DenseLayer

# The residual stream between layers stays in float32: rounding it to bf16 twice per layer (as transformers does
# in bf16) put the 8B-shaped model's logits 6e-2 (relative L2) away from transformers' float32 logits.
RESIDUAL_DTYPE = float32


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


class DenseForward:
    """The forward methods of DenseModel; they read the attributes its __init__ sets (config, weights, eps, scale,
    cos_sin, comm, the fused-path flags and the FP8 scratch)."""

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
