"""Skinny GEMMs (xserv/ops/gemv.py): gemv (x @ W^T), rmsnorm_linear (RMSNorm of the fp32 residual, then W),
rmsnorm_linear_silu_mul (one row: RMSNorm, the fused gate/up weight W [N = 2I, K], then silu_and_mul -> [1, I]),
silu_mul_linear_add (residual += bf16(silu_and_mul(gate_up) @ W^T)). Shapes: MxNxK (rows, out and in features).

The harness times eager calls, which at these microsecond sizes is mostly host time: the bandwidth table comes
from tools/bench_gemv.py (CUDA-graph replays, cold weights, cuBLASLt and torch peers; docs/kernels/gemv.md)."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec

EPS = 1e-6
CHECK = [(1, 1000, 1024), (1, 37, 520), (1, 1000, 8192), (3, 3001, 2048), (8, 300, 64), (16, 2112, 1024), (16, 1000, 4104)]
BENCH = [(1, 6144, 4096), (1, 24576, 4096), (1, 4096, 12288), (1, 151936, 1024), (8, 24576, 4096)]


def _weights(rng, shape):
    m, n, k = shape
    return {"x": random_array(rng, (m, k), "bfloat16", mean=0.0),
            "weight": random_array(rng, (n, k), "bfloat16", mean=0.0, std=0.05)}


def _norm_inputs(rng, shape):
    m, n, k = shape
    d = _weights(rng, shape)
    d["x"] = random_array(rng, (m, k), "float32", mean=0.0, std=3.0)  # the fp32 residual stream
    d["norm_weight"] = random_array(rng, (k,), "bfloat16", mean=1.0, std=0.1)
    return d


def _silu_inputs(rng, shape):
    m, n, k = shape
    d = _weights(rng, shape)
    d["x"] = random_array(rng, (m, 2 * k), "bfloat16", mean=0.0, std=2.0)  # [gate | up]
    d["residual"] = random_array(rng, (m, n), "float32", mean=0.0, std=0.1)
    return d


def _out(d, cols, dtype):
    return poisoned((d["x"].shape[0], cols), dtype, d["x"].device)


def _run_gemv(d):
    from xserv.ops.gemv import linear_gemv

    return linear_gemv(d["x"], d["weight"], out=_out(d, d["weight"].shape[0], "bfloat16"))


def _run_norm(d):
    from xserv.ops.gemv import rmsnorm_linear

    return rmsnorm_linear(d["x"], d["norm_weight"], EPS, d["weight"], out=_out(d, d["weight"].shape[0], "bfloat16"))


def _run_norm_silu(d):
    from xserv.ops.gemv import rmsnorm_linear_silu_mul

    return rmsnorm_linear_silu_mul(d["x"], d["norm_weight"], EPS, d["weight"],
                                   out=_out(d, d["weight"].shape[0] // 2, "bfloat16"))


def _run_silu(d):
    # Adds into a copy of the residual: the check compares one call, and the bench's repeats may keep adding.
    from xserv.ops.gemv import silu_mul_linear_add

    residual = poisoned(d["residual"].shape, "float32", d["x"].device).copy_(d["residual"])
    return silu_mul_linear_add(d["x"], d["weight"], residual)


def _ref_gemv(d):
    from xserv.ops.linear import linear_reference

    return linear_reference(d["x"], d["weight"]).astype("bfloat16").astype(np.float64)


def _ref_norm(d):
    from xserv.ops.gemv import rmsnorm_linear_reference

    return rmsnorm_linear_reference(d["x"], d["norm_weight"], EPS, d["weight"]).astype("bfloat16").astype(np.float64)


def _ref_norm_silu(d):
    from xserv.ops.gemv import rmsnorm_linear_silu_mul_reference

    return rmsnorm_linear_silu_mul_reference(d["x"], d["norm_weight"], EPS, d["weight"]).astype(np.float64)


def _ref_silu(d):
    from xserv.ops.gemv import add_rounded, silu_mul_linear_reference

    return add_rounded(d["residual"], silu_mul_linear_reference(d["x"], d["weight"])).astype(np.float64)


def _torch_norm(d):
    import torch

    r = d["x"]
    normed = (d["norm_weight"].float() * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS))).bfloat16()
    return normed @ d["weight"].t()


def _torch_norm_silu(d):
    import torch.nn.functional as F

    gate_up = _torch_norm(d)
    i = gate_up.shape[1] // 2
    return (F.silu(gate_up[:, :i]) * gate_up[:, i:]).bfloat16()


def _torch_silu(d):
    import torch.nn.functional as F

    k = d["weight"].shape[1]
    act = (F.silu(d["x"][:, :k]) * d["x"][:, k:]).bfloat16()
    return d["residual"] + (act @ d["weight"].t()).float()


def _bytes(x_bytes_per_row, out_bytes):
    return lambda s: s[1] * s[2] * 2 + s[0] * x_bytes_per_row(s) + s[0] * s[1] * out_bytes


_MMA = ("gemv_mma_m8", "gemv_mma_m16", "gemv_mma_m8_sliced", "gemv_mma_m16_sliced")
SPECS = [
    OpSpec(name="gemv", family="gemv", kernels=("gemv_row_bf16_bf16", "gemv_row_bf16_bf16_1step") + _MMA,
           make_inputs=_weights, run=_run_gemv, reference=_ref_gemv, tolerance=1e-2, check_shapes=CHECK,
           bench_shapes=BENCH, bytes_moved=_bytes(lambda s: s[2] * 2, 2),
           torch_peer=lambda d: d["x"] @ d["weight"].t(), shape_help="MxNxK"),
    OpSpec(name="rmsnorm_linear", family="gemv", kernels=("gemv_row_rmsnorm_bf16", "gemv_row_rmsnorm_bf16_1step") + _MMA,
           make_inputs=_norm_inputs, run=_run_norm, reference=_ref_norm, tolerance=1e-2, check_shapes=CHECK,
           bench_shapes=BENCH, bytes_moved=_bytes(lambda s: s[2] * 4, 2), torch_peer=_torch_norm,
           shape_help="MxNxK"),
    OpSpec(name="rmsnorm_linear_silu_mul", family="gemv", kernels=("gemv_row_rmsnorm_silu_mul", "gemv_row_rmsnorm_silu_mul_1step"),
           make_inputs=_norm_inputs,
           run=_run_norm_silu, reference=_ref_norm_silu, tolerance=1e-2,
           check_shapes=[(1, 2000, 1024), (1, 74, 520), (1, 6144, 1024), (1, 2000, 4096)],
           bench_shapes=[(1, 6144, 1024), (1, 24576, 4096)], bytes_moved=lambda s: s[1] * s[2] * 2 + s[2] * 4 + s[1],
           torch_peer=_torch_norm_silu, shape_help="1xNxK (N = 2I: gate rows, then up rows)"),
    OpSpec(name="silu_mul_linear_add", family="gemv", kernels=("gemv_row_silu_mul_add", "gemv_row_silu_mul_add_1step") + _MMA,
           make_inputs=_silu_inputs, run=_run_silu, reference=_ref_silu, tolerance=1e-2, check_shapes=CHECK,
           bench_shapes=BENCH, bytes_moved=_bytes(lambda s: s[2] * 4, 8), torch_peer=_torch_silu,
           shape_help="MxNxK"),
]
