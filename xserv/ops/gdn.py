"""Gated DeltaNet (the linear-attention layers of Qwen3.5 / 3.6 / 3.8 and Qwen3-Next): the causal conv + SiLU on the
packed qkv projection, the gated delta rule itself, and the gated RMSNorm on its output.

The layer's fused input projection gives `proj` bf16 [T, P], columns `[qkv (conv_dim) | z (value_dim) | b (nv) |
a (nv)]`, qkv = `[q (nk*dk) | k (nk*dk) | v (nv*dv)]`; the ops read column ranges of it with row stride P. A batch is
packed: sequence b's new tokens are rows cu_seqlens[b] .. cu_seqlens[b+1]-1; its start (tokens before this step) is
kv_lens[b] - q_len; start == 0 means a fresh sequence, whose conv window and state are zero (its slot is written,
never read). Per-sequence state lives in slots (state_slots[b]): conv_state bf16 [slots, K-1, conv_dim] (the last
K-1 pre-conv inputs, oldest first) and ssm_state fp32 [slots, nv, dk, dv] (S[i_key, c_value]), updated in place.

    u = bf16(silu(sum_j w[c, j] * x_{t-K+1+j}[c]))                     fp32 accumulate, one rounding
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)         fp32 (softplus: identity above 20)
    q, k: L2-normalised over dk (x * rsqrt(sum x^2 + 1e-6)), q *= dk^-0.5; value head j reads q/k head j // (nv/nk)
    per token: S *= exp(g); delta = beta * (v - S^T k); S += k delta^T; o = S^T q   (fp32), o rounded to bf16 once
    y = bf16(bf16(bf16(o * rsqrt(mean(o^2) + eps)) * w) * silu(z))     per value head over dv (HF's rounding points:
                                                                        a bf16 weight times a bf16 value is bf16)

The references below compute exactly that in float32 NumPy (token by token) and are what the CPU backend runs.
CUDA (cuda_src/gdn.cu, docs/kernels/gdn.md): the conv is one kernel (prefill and the decode step); the delta rule runs
the recurrent kernel (one CTA per sequence and value head, the state in registers, read and written once) for
decode-sized steps and the chunked WY form (chunk 64, mma.sync) for prefill; the gated norm is one warp per head row.
"""
from __future__ import annotations

import numpy as np

from ..runtime import kernel
from ..runtime.sources import piece
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, check_eps

CONV_KERNEL = 4  # the CUDA conv is written for K = 4 (every Qwen3.5 / Qwen3-Next config); the reference takes any K
HEAD_DIM = 128  # the CUDA delta rule and gated norm are written for dk = dv = 128; the references take any
L2_EPS = 1e-6
RECURRENT_MAX_Q_LEN = 16  # steps whose longest sequence has at most this many new tokens run the recurrent kernel
CHUNK = 64
_FAMILY = piece("gdn", gdn=1)  # the family's one piece: compiled at a hybrid model's start only (cuda_src/gdn.cu)
_CONV_TOKENS = 64  # tokens per CTA of the conv kernel
_BV = 32  # value columns per CTA of the chunked kernel


# ---- references (NumPy, float32 math; outputs as float32 holding the values the ops round to bf16) ----------------
def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(bfloat16).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (np.float32(1) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """PyTorch's softplus (beta 1, threshold 20): x itself above 20."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20))))).astype(np.float32)


def _spans(cu_seqlens, kv_lens, state_slots):
    """(first row, q_len, start, slot) of each sequence."""
    for b in range(len(kv_lens)):
        r0, r1 = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        yield r0, r1 - r0, int(kv_lens[b]) - (r1 - r0), int(state_slots[b])


def causal_conv1d_silu_reference(proj, weight, conv_state, cu_seqlens, kv_lens, state_slots, *, conv_dim):
    """-> u float32 [T, conv_dim] (bf16 values); conv_state (NumPy, bf16) updated in place."""
    taps = weight.shape[1]
    w = weight.astype(np.float32)
    u = np.zeros((proj.shape[0], conv_dim), np.float32)
    for r0, n, start, slot in _spans(cu_seqlens, kv_lens, state_slots):
        if n == 0:
            continue
        window = (np.zeros((taps - 1, conv_dim), np.float32) if start == 0
                  else conv_state[slot].astype(np.float32))
        x = np.concatenate([window, proj[r0:r0 + n, :conv_dim].astype(np.float32)])
        acc = np.zeros((n, conv_dim), np.float32)
        for j in range(taps):  # tap K-1 multiplies the current token
            acc += w[:, j] * x[j:j + n]
        u[r0:r0 + n] = _bf16(_silu(acc))
        conv_state[slot] = x[n:].astype(conv_state.dtype)
    return u


def gdn_gates_reference(b, a, A_log, dt_bias):
    """(beta, g) float32 [T, nv] from the bf16 b, a columns."""
    beta = np.float32(1) / (np.float32(1) + np.exp(-b.astype(np.float32)))
    g = -np.exp(A_log.astype(np.float32)) * _softplus(a.astype(np.float32) + dt_bias.astype(np.float32))
    return beta.astype(np.float32), g.astype(np.float32)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(L2_EPS))


def gated_delta_rule_reference(u, proj, A_log, dt_bias, ssm_state, cu_seqlens, kv_lens, state_slots, *,
                               num_k_heads, num_v_heads, head_k_dim, head_v_dim, ba_col):
    """-> o float32 [T, nv*dv] (bf16 values); ssm_state (NumPy, fp32) updated in place. Token by token (3.2)."""
    nk, nv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    key_dim = nk * dk
    rows = u.shape[0]
    uf = u.astype(np.float32)
    heads = np.arange(nv) // (nv // nk)
    q = _l2norm(uf[:, :key_dim].reshape(rows, nk, dk))[:, heads] * np.float32(dk ** -0.5)
    k = _l2norm(uf[:, key_dim:2 * key_dim].reshape(rows, nk, dk))[:, heads]
    v = uf[:, 2 * key_dim:2 * key_dim + nv * dv].reshape(rows, nv, dv)
    beta, g = gdn_gates_reference(proj[:, ba_col:ba_col + nv], proj[:, ba_col + nv:ba_col + 2 * nv], A_log, dt_bias)
    decay = np.exp(g)
    o = np.zeros((rows, nv, dv), np.float32)
    for r0, n, start, slot in _spans(cu_seqlens, kv_lens, state_slots):
        if n == 0:
            continue
        s = np.zeros((nv, dk, dv), np.float32) if start == 0 else ssm_state[slot].astype(np.float32)
        for t in range(r0, r0 + n):
            s *= decay[t][:, None, None]
            m = np.einsum("hic,hi->hc", s, k[t])
            delta = beta[t][:, None] * (v[t] - m)
            s += k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hic,hi->hc", s, q[t])
        ssm_state[slot] = s
    return _bf16(o.reshape(rows, nv * dv))


def gated_rmsnorm_silu_reference(o, proj, norm_weight, eps, *, z_col, num_v_heads, head_v_dim):
    """-> y float32 [T, nv*dv] (bf16 values)."""
    rows, width = o.shape[0], num_v_heads * head_v_dim
    of = o.astype(np.float32).reshape(rows, num_v_heads, head_v_dim)
    z = proj[:, z_col:z_col + width].astype(np.float32).reshape(rows, num_v_heads, head_v_dim)
    inv = np.float32(1) / np.sqrt(np.mean(of * of, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    n = _bf16(_bf16(of * inv) * norm_weight.astype(np.float32))
    return _bf16(n * _silu(z)).reshape(rows, width)


# ---- argument checks ---------------------------------------------------------------------------------------------
def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return int(value)


def _check_batch(cu_seqlens: Tensor, kv_lens: Tensor, state_slots: Tensor, rows: int, num_slots: int,
                 max_q_len) -> tuple[int, int]:
    """-> (batch size, max_q_len). Shapes and dtypes always; the values on the CPU only (a CUDA launch never reads
    device memory on the host)."""
    check_tensor("cu_seqlens", cu_seqlens, dtype=int32, ndim=1)
    batch = cu_seqlens.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens: expected [B + 1] entries, got none")
    check_tensor("kv_lens", kv_lens, dtype=int32, shape=(batch,))
    check_tensor("state_slots", state_slots, dtype=int32, shape=(batch,))
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, (int, np.integer)) or not 0 <= max_q_len <= rows:
        raise ValueError(f"max_q_len: expected an integer in 0..{rows} (the packed rows), got {max_q_len!r}")
    if cu_seqlens.device == "cpu":
        cu, kv, slots = cu_seqlens.array, kv_lens.array, state_slots.array
        q_lens = np.diff(cu)
        if cu[0] != 0 or cu[-1] != rows or np.any(q_lens < 0):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to {rows}, got {cu.tolist()}")
        if batch and q_lens.max() > max_q_len:
            raise ValueError(f"max_q_len: {max_q_len} is below the longest sequence's {int(q_lens.max())} tokens")
        if np.any(kv < q_lens):
            raise ValueError("kv_lens: a sequence's length is below its new tokens")
        if np.any((slots < 0) | (slots >= num_slots)):
            raise ValueError(f"state_slots: expected slots in 0..{num_slots - 1}, got {slots.tolist()}")
    return batch, int(max_q_len)


def _check_proj(proj: Tensor, rows: int | None, columns: int, what: str) -> int:
    check_tensor("proj", proj, dtype=bfloat16, ndim=2)
    if rows is not None and proj.shape[0] != rows:
        raise ValueError(f"proj: {proj.shape[0]} rows, expected {rows}")
    if proj.shape[1] < columns:
        raise ValueError(f"proj: {proj.shape[1]} columns, too few for {what} (needs {columns})")
    return proj.shape[0]


def _check_heads(num_k_heads, num_v_heads, head_k_dim, head_v_dim) -> tuple[int, int, int, int]:
    nk, nv = _positive("num_k_heads", num_k_heads), _positive("num_v_heads", num_v_heads)
    dk, dv = _positive("head_k_dim", head_k_dim), _positive("head_v_dim", head_v_dim)
    if nv % nk:
        raise ValueError(f"num_v_heads ({nv}) must be a multiple of num_k_heads ({nk})")
    return nk, nv, dk, dv


# ---- ops ---------------------------------------------------------------------------------------------------------
def causal_conv1d_silu(proj: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, kv_lens: Tensor,
                       state_slots: Tensor, *, conv_dim: int, max_q_len: int, out: Tensor | None = None) -> Tensor:
    """proj bf16 [T, P] (the conv reads columns 0..conv_dim-1), weight bf16 [conv_dim, K], conv_state bf16
    [slots, K-1, conv_dim] (updated in place) -> u bf16 [T, conv_dim]."""
    conv_dim = _positive("conv_dim", conv_dim)
    rows = _check_proj(proj, None, conv_dim, "conv_dim")
    check_tensor("weight", weight, dtype=bfloat16, ndim=2)
    if weight.shape[0] != conv_dim or weight.shape[1] < 2:
        raise ValueError(f"weight: shape {list(weight.shape)}, expected [{conv_dim}, K] with K >= 2")
    taps = weight.shape[1]
    check_tensor("conv_state", conv_state, dtype=bfloat16, ndim=3)
    if conv_state.shape[1:] != (taps - 1, conv_dim):
        raise ValueError(f"conv_state: shape {list(conv_state.shape)}, expected [slots, {taps - 1}, {conv_dim}]")
    batch, max_q_len = _check_batch(cu_seqlens, kv_lens, state_slots, rows, conv_state.shape[0], max_q_len)
    device = same_device(proj=proj, weight=weight, conv_state=conv_state, cu_seqlens=cu_seqlens, kv_lens=kv_lens,
                         state_slots=state_slots, out=out)
    out = output("out", out, (rows, conv_dim), bfloat16, device)
    for name, t in (("proj", proj), ("conv_state", conv_state)):
        check_alias("out", out, name, t, allow_identical=False)
    if device == "cpu":
        out.array[...] = causal_conv1d_silu_reference(proj.array, weight.array, conv_state.array, cu_seqlens.array,
                                                      kv_lens.array, state_slots.array, conv_dim=conv_dim)
        return out
    if taps != CONV_KERNEL:
        raise ValueError(f"weight: the CUDA conv has K = {CONV_KERNEL} taps, got {taps}")
    if conv_dim % 2 or proj.shape[1] % 2 or not aligned(proj, conv_state, out, nbytes=4):
        raise ValueError(f"conv_dim ({conv_dim}) and proj's row length ({proj.shape[1]}) must be even and proj, "
                         f"conv_state, out 4-byte aligned (bf16 pairs)")
    if batch and max_q_len:
        grid = (cdiv(conv_dim // 2, 128), batch, cdiv(max_q_len, _CONV_TOKENS))
        kernel(_FAMILY, "causal_conv1d_silu_k4")(grid, 128, proj, weight, conv_state, cu_seqlens, kv_lens, state_slots,
                                               out, np.int32(conv_dim), np.int32(proj.shape[1]))
    return out


def gated_delta_rule(u: Tensor, proj: Tensor, A_log: Tensor, dt_bias: Tensor, ssm_state: Tensor, cu_seqlens: Tensor,
                     kv_lens: Tensor, state_slots: Tensor, *, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                     head_v_dim: int, ba_col: int, max_q_len: int, out: Tensor | None = None) -> Tensor:
    """u bf16 [T, conv_dim] (the conv's output: q | k | v), proj bf16 [T, P] (b, a at columns ba_col, ba_col + nv),
    A_log, dt_bias fp32 [nv], ssm_state fp32 [slots, nv, dk, dv] (updated in place) -> o bf16 [T, nv*dv]."""
    nk, nv, dk, dv = _check_heads(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    conv_dim = 2 * nk * dk + nv * dv
    check_tensor("u", u, dtype=bfloat16, shape=(None, conv_dim))
    rows = u.shape[0]
    if isinstance(ba_col, bool) or not isinstance(ba_col, (int, np.integer)) or ba_col < 0:
        raise ValueError(f"ba_col: expected an integer >= 0, got {ba_col!r}")
    _check_proj(proj, rows, int(ba_col) + 2 * nv, f"b and a at ba_col {ba_col}")
    check_tensor("A_log", A_log, dtype=float32, shape=(nv,))
    check_tensor("dt_bias", dt_bias, dtype=float32, shape=(nv,))
    check_tensor("ssm_state", ssm_state, dtype=float32, ndim=4)
    if ssm_state.shape[1:] != (nv, dk, dv):
        raise ValueError(f"ssm_state: shape {list(ssm_state.shape)}, expected [slots, {nv}, {dk}, {dv}]")
    batch, max_q_len = _check_batch(cu_seqlens, kv_lens, state_slots, rows, ssm_state.shape[0], max_q_len)
    device = same_device(u=u, proj=proj, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state, cu_seqlens=cu_seqlens,
                         kv_lens=kv_lens, state_slots=state_slots, out=out)
    out = output("out", out, (rows, nv * dv), bfloat16, device)
    for name, t in (("u", u), ("proj", proj), ("ssm_state", ssm_state)):
        check_alias("out", out, name, t, allow_identical=False)
    if device == "cpu":
        out.array[...] = gated_delta_rule_reference(
            u.array, proj.array, A_log.array, dt_bias.array, ssm_state.array, cu_seqlens.array, kv_lens.array,
            state_slots.array, num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, ba_col=int(ba_col))
        return out
    if dk != HEAD_DIM or dv != HEAD_DIM:
        raise ValueError(f"head_k_dim / head_v_dim: the CUDA delta rule is for {HEAD_DIM}, got {dk} / {dv}")
    if not aligned(u, out, nbytes=16) or not aligned(ssm_state, nbytes=16):
        raise ValueError("u, out and ssm_state must be 16-byte aligned (vector accesses)")
    if not batch or not max_q_len:
        return out
    args = (u, proj, A_log, dt_bias, ssm_state, cu_seqlens, kv_lens, state_slots, out, np.int32(nk), np.int32(nv),
            np.int32(proj.shape[1]), np.int32(ba_col))
    if max_q_len <= RECURRENT_MAX_Q_LEN:
        kernel(_FAMILY, "gdn_recurrent_d128")((nv, batch), 256, *args)
    else:
        kernel(_FAMILY, "gdn_chunked_d128")((HEAD_DIM // _BV, nv, batch), 128, *args, smem=_chunked_smem())
    return out


def _chunked_smem() -> int:
    """Dynamic shared memory of gdn_chunked_d128: its ChunkSmem (gdn.cu), member by member (the kernel traps if
    launched with less)."""
    sk, sc, sv = HEAD_DIM + 8, CHUNK + 8, _BV + 8  # padded row strides, elements
    bf16_elems = 2 * CHUNK * sk + 2 * CHUNK * sc + 3 * CHUNK * sv + HEAD_DIM * sv  # q, k | a, t | vr, vp, vd | s
    return 2 * bf16_elems + 4 * (CHUNK * (CHUNK + 1) + 4 * CHUNK)  # + fp32 L and four per-row vectors


def gated_rmsnorm_silu(o: Tensor, proj: Tensor, norm_weight: Tensor, eps: float, *, z_col: int, num_v_heads: int,
                       head_v_dim: int, out: Tensor | None = None) -> Tensor:
    """o bf16 [T, nv*dv], z = proj[:, z_col : z_col + nv*dv], norm_weight bf16 [dv] -> y bf16 [T, nv*dv]. `out` may
    be `o` (in place)."""
    nv, dv = _positive("num_v_heads", num_v_heads), _positive("head_v_dim", head_v_dim)
    eps32 = check_eps(eps)
    check_tensor("o", o, dtype=bfloat16, shape=(None, nv * dv))
    rows = o.shape[0]
    if isinstance(z_col, bool) or not isinstance(z_col, (int, np.integer)) or z_col < 0:
        raise ValueError(f"z_col: expected an integer >= 0, got {z_col!r}")
    _check_proj(proj, rows, int(z_col) + nv * dv, f"z at z_col {z_col}")
    check_tensor("norm_weight", norm_weight, dtype=bfloat16, shape=(dv,))
    device = same_device(o=o, proj=proj, norm_weight=norm_weight, out=out)
    out = output("out", out, o.shape, bfloat16, device)
    check_alias("out", out, "o", o, allow_identical=True)
    check_alias("out", out, "proj", proj, allow_identical=False)
    if device == "cpu":
        out.array[...] = gated_rmsnorm_silu_reference(o.array, proj.array, norm_weight.array, eps32, z_col=int(z_col),
                                                      num_v_heads=nv, head_v_dim=dv)
        return out
    if dv != HEAD_DIM:
        raise ValueError(f"head_v_dim: the CUDA gated norm is for {HEAD_DIM}, got {dv}")
    if z_col % 4 or proj.shape[1] % 4 or not aligned(o, proj, norm_weight, out, nbytes=8):
        raise ValueError(f"z_col ({z_col}) and proj's row length ({proj.shape[1]}) must be multiples of 4 and o, proj, "
                         f"norm_weight, out 8-byte aligned (8-byte accesses)")
    heads = rows * nv
    if heads:
        kernel(_FAMILY, "gated_rmsnorm_silu_d128")(cdiv(heads, 8), 256, o, proj, norm_weight, out, np.int32(nv),
                                                 np.int32(proj.shape[1]), np.int32(z_col), np.int64(heads), eps32)
    return out
