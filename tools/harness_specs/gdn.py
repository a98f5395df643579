"""Gated DeltaNet family (xserv/ops/gdn.py).

gdn_prefill   BATCHxQ_LENxNVxNK: B fresh sequences of Q_LEN tokens each, dk = dv = 128 (27B: NV 48, NK 16); the chunked
              kernel from Q_LEN 17 on. Peer: fla's chunk_gated_delta_rule (gates, L2 norm and sigmoid in its kernels,
              final state written), where `fla` imports.
gdn_decode    BATCHxNVxNK: one token for each of B continuing sequences (the recurrent kernel). bytes_moved counts the
              state read and written once. Peer: fla's fused_recurrent_gated_delta_rule (final state out of place).
conv1d_silu   TOKENSxSEQSxCONV_DIM: SEQS continuing sequences of TOKENS / SEQS tokens each.
gated_norm    TOKENSxNV: dv = 128. Peer: the same formula in PyTorch.
proj holds only the columns an op reads (b | a for the delta rule, z for the norm): the ops take any row length.
"""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec

D = 128
EPS = 1e-6


def _meta(q_lens, starts):
    q_lens = np.asarray(q_lens)
    return {"cu_seqlens": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            "kv_lens": (np.asarray(starts) + q_lens).astype(np.int32),
            "state_slots": np.random.default_rng(len(q_lens)).permutation(len(q_lens)).astype(np.int32)}


def _rule_inputs(rng, batch, q_len, nv, nk, start):
    rows = batch * q_len
    d = _meta([q_len] * batch, [start] * batch)
    d["u"] = random_array(rng, (rows, (2 * nk + nv) * D), "bfloat16", mean=0.2)
    d["proj"] = random_array(rng, (rows, 2 * nv), "bfloat16", mean=0.1)
    d["A_log"] = rng.uniform(-3.0, 0.5, nv).astype(np.float32)
    d["dt_bias"] = rng.uniform(-2.0, 1.0, nv).astype(np.float32)
    d["ssm_state"] = (rng.standard_normal((batch, nv, D, D)) * 0.3).astype(np.float32)
    d["heads"] = (nk, nv)
    return d


def _prefill_inputs(rng, shape):
    batch, q_len, nv, nk = shape
    return _rule_inputs(rng, batch, q_len, nv, nk, 0)


def _decode_inputs(rng, shape):
    batch, nv, nk = shape
    return _rule_inputs(rng, batch, 1, nv, nk, 9)


def _run_rule(d):
    from xserv.ops.gdn import gated_delta_rule

    nk, nv = d["heads"]
    rows = d["u"].shape[0]
    q_len = rows // d["kv_lens"].shape[0]
    # the harness's check compares this first run's output; the bench's repeats keep advancing the state
    return gated_delta_rule(d["u"], d["proj"], d["A_log"], d["dt_bias"], d["ssm_state"], d["cu_seqlens"], d["kv_lens"],
                            d["state_slots"], num_k_heads=nk, num_v_heads=nv, head_k_dim=D, head_v_dim=D, ba_col=0,
                            max_q_len=q_len, out=poisoned((rows, nv * D), "bfloat16"))


def _ref_rule(d):
    from xserv.ops.gdn import gated_delta_rule_reference

    nk, nv = d["heads"]
    return gated_delta_rule_reference(d["u"], d["proj"], d["A_log"], d["dt_bias"], d["ssm_state"].copy(),
                                      d["cu_seqlens"], d["kv_lens"], d["state_slots"], num_k_heads=nk, num_v_heads=nv,
                                      head_k_dim=D, head_v_dim=D, ba_col=0).astype(np.float64)


def _fla_split(d):
    """fla's inputs from ours: q, k [1, T, nk, D], v [1, T, nv, D] (contiguous copies made before timing)."""
    nk, nv = d["heads"]
    u = d["u"]
    rows = u.shape[0]
    if "_q" not in d:
        d["_q"] = u[:, :nk * D].reshape(1, rows, nk, D).contiguous()
        d["_k"] = u[:, nk * D:2 * nk * D].reshape(1, rows, nk, D).contiguous()
        d["_v"] = u[:, 2 * nk * D:].reshape(1, rows, nv, D).contiguous()
        d["_b"] = d["proj"][:, :nv].reshape(1, rows, nv).contiguous()
        d["_a"] = d["proj"][:, nv:].reshape(1, rows, nv).float().contiguous()
        d["_cu"] = d["cu_seqlens"].long()
    return d["_q"], d["_k"], d["_v"], d["_b"], d["_a"], d["_cu"]


def _fla_prefill(d):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, b, a, cu = _fla_split(d)
    return chunk_gated_delta_rule(q, k, v, a, b, scale=D ** -0.5, initial_state=None, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                  use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dt_bias"], cu_seqlens=cu)[0]


def _fla_decode(d):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, b, a, cu = _fla_split(d)
    return fused_recurrent_gated_delta_rule(q, k, v, g=a, beta=b, scale=D ** -0.5, initial_state=d["ssm_state"],
                                            output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dt_bias"],
                                            use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)[0]


def _conv_inputs(rng, shape):
    tokens, seqs, conv_dim = shape
    d = _meta([tokens // seqs] * seqs, [5] * seqs)
    d["proj"] = random_array(rng, (tokens, conv_dim), "bfloat16")
    d["weight"] = random_array(rng, (conv_dim, 4), "bfloat16", mean=0.05, std=0.5)
    d["conv_state"] = random_array(rng, (seqs, 3, conv_dim), "bfloat16")
    return d


def _run_conv(d):
    from xserv.ops.gdn import causal_conv1d_silu

    tokens, conv_dim = d["proj"].shape
    return causal_conv1d_silu(d["proj"], d["weight"], d["conv_state"], d["cu_seqlens"], d["kv_lens"],
                              d["state_slots"], conv_dim=conv_dim, max_q_len=tokens // d["kv_lens"].shape[0],
                              out=poisoned((tokens, conv_dim), "bfloat16"))


def _ref_conv(d):
    from xserv.ops.gdn import causal_conv1d_silu_reference

    return causal_conv1d_silu_reference(d["proj"], d["weight"], d["conv_state"].copy(), d["cu_seqlens"], d["kv_lens"],
                                        d["state_slots"], conv_dim=d["proj"].shape[1]).astype(np.float64)


def _norm_inputs(rng, shape):
    tokens, nv = shape
    return {"o": random_array(rng, (tokens, nv * D), "bfloat16"),
            "proj": random_array(rng, (tokens, nv * D), "bfloat16"),
            "norm_weight": random_array(rng, (D,), "bfloat16", mean=1.0, std=0.2)}


def _run_norm(d):
    from xserv.ops.gdn import gated_rmsnorm_silu

    nv = d["o"].shape[1] // D
    return gated_rmsnorm_silu(d["o"], d["proj"], d["norm_weight"], EPS, z_col=0, num_v_heads=nv, head_v_dim=D,
                              out=poisoned(d["o"].shape, "bfloat16"))


def _ref_norm(d):
    from xserv.ops.gdn import gated_rmsnorm_silu_reference

    nv = d["o"].shape[1] // D
    return gated_rmsnorm_silu_reference(d["o"], d["proj"], d["norm_weight"], EPS, z_col=0, num_v_heads=nv,
                                        head_v_dim=D).astype(np.float64)


def _torch_norm(d):
    import torch

    t = d["o"].shape[0]
    o = d["o"].view(t, -1, D).float()
    n = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16) * d["norm_weight"]
    return (n * torch.nn.functional.silu(d["proj"].view(t, -1, D).float())).to(torch.bfloat16)


def _rule_bytes(batch, tokens, nv, nk, state_rw=True):
    return (batch * nv * D * D * 4 * 2 * state_rw + tokens * ((2 * nk + nv) * D * 2 + 2 * nv * 2 + nv * D * 2))


SPECS = [
    OpSpec(
        name="gdn_prefill", family="gdn", kernels=("gdn_chunked_d128", "gdn_recurrent_d128"),
        make_inputs=_prefill_inputs, run=_run_rule, reference=_ref_rule, tolerance=1.5e-2,
        check_shapes=[(2, 100, 4, 2), (1, 200, 6, 2), (3, 17, 4, 4)],
        bench_shapes=[(1, 2048, 48, 16), (1, 8192, 48, 16), (1, 32768, 48, 16), (8, 2048, 48, 16), (16, 16, 48, 16),
                      (16, 17, 48, 16)],
        bytes_moved=lambda s: _rule_bytes(s[0], s[0] * s[1], s[2], s[3]),
        # per token and head, the WY form's products: K K^T, Q K^T, T R, A V' (64 x 128 each), K S, Q S, K^T V'
        # (128 x 128)
        flops=lambda s: 2 * s[0] * s[1] * s[2] * (2 * 64 * D + 2 * D * D + 2 * 64 * D + D * D),
        torch_peer=_fla_prefill, shape_help="BATCHxQ_LENxNVxNK",
    ),
    OpSpec(
        name="gdn_decode", family="gdn", kernels=("gdn_recurrent_d128",),
        make_inputs=_decode_inputs, run=_run_rule, reference=_ref_rule, tolerance=4e-3,
        check_shapes=[(5, 4, 2), (64, 48, 16)],
        bench_shapes=[(64, 48, 16), (1, 48, 16), (256, 48, 16)],
        bytes_moved=lambda s: _rule_bytes(s[0], s[0], s[1], s[2]),
        torch_peer=_fla_decode, shape_help="BATCHxNVxNK",
    ),
    OpSpec(
        name="conv1d_silu", family="gdn", kernels=("causal_conv1d_silu_k4",),
        make_inputs=_conv_inputs, run=_run_conv, reference=_ref_conv, tolerance=4e-3,
        check_shapes=[(64, 64, 10240), (300, 3, 512)],
        bench_shapes=[(64, 64, 10240), (8192, 1, 10240)],
        bytes_moved=lambda s: 2 * s[0] * s[2] * 2 + s[1] * 3 * s[2] * 2 * 2, shape_help="TOKENSxSEQSxCONV_DIM",
    ),
    OpSpec(
        name="gated_norm", family="gdn", kernels=("gated_rmsnorm_silu_d128",),
        make_inputs=_norm_inputs, run=_run_norm, reference=_ref_norm, tolerance=4e-3,
        check_shapes=[(1, 48), (333, 6)], bench_shapes=[(64, 48), (8192, 48)],
        bytes_moved=lambda s: 3 * s[0] * s[1] * D * 2, torch_peer=_torch_norm, shape_help="TOKENSxNV",
    ),
]
