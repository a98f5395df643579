"""RMSNorm family: rmsnorm, fused_add_rmsnorm (TOKENSxHIDDEN), head_rmsnorm (TOKENSxHEADSxHEAD_DIM)."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec

EPS = 1e-6


def _rows(rng, shape):
    t, h = shape
    return {"x": random_array(rng, (t, h), "bfloat16", mean=0.3),
            "weight": random_array(rng, (h,), "bfloat16", mean=1.0, std=0.3)}


def _fused_inputs(rng, shape):
    d = _rows(rng, shape)
    d["residual"] = random_array(rng, shape, "bfloat16", mean=-0.2)
    return d


def _heads(rng, shape):
    t, nh, hd = shape
    return {"x": random_array(rng, (t, nh, hd), "bfloat16", mean=0.3),
            "weight": random_array(rng, (hd,), "bfloat16", mean=1.0, std=0.3)}


def _run_rmsnorm(d):
    from xserv.ops.rmsnorm import rmsnorm

    return rmsnorm(d["x"], d["weight"], EPS, out=poisoned(d["x"].shape, d["x"].dtype))


def _run_fused(d):
    # Updates d["residual"] in place: the check must compare the first run (the bench's repeats keep adding x).
    from xserv.ops.rmsnorm import fused_add_rmsnorm

    return fused_add_rmsnorm(d["x"], d["residual"], d["weight"], EPS, out=poisoned(d["x"].shape, d["x"].dtype))


def _run_heads(d):
    from xserv.ops.rmsnorm import head_rmsnorm

    return head_rmsnorm(d["x"], d["weight"], EPS, out=poisoned(d["x"].shape, d["x"].dtype))


def _ref_rows(d):
    from xserv.ops.rmsnorm import rmsnorm_reference

    return rmsnorm_reference(d["x"], d["weight"], EPS).astype("bfloat16").astype(np.float64)


def _ref_fused(d):
    from xserv.ops.rmsnorm import fused_add_rmsnorm_reference

    return fused_add_rmsnorm_reference(d["x"], d["residual"], d["weight"], EPS)[1].astype("bfloat16").astype(np.float64)


def _torch_rms(x, w):
    import torch

    if hasattr(torch.nn.functional, "rms_norm"):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def _torch_fused(d):
    import torch

    r = d["x"] + d["residual"]
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16) * d["weight"]


ROW_CHECKS = [(1, 1024), (7, 4096), (1023, 5120), (5, 1000), (3, 128), (2, 20480)]
ROW_BENCH = [(8192, 4096), (8192, 5120), (1, 4096), (256, 4096)]

SPECS = [
    OpSpec(
        name="rmsnorm", family="rmsnorm",
        kernels=("rmsnorm_bf16_vpt1", "rmsnorm_bf16_vpt2", "rmsnorm_bf16_vpt4", "rmsnorm_bf16_vpt8", "rmsnorm_bf16_scalar"),
        make_inputs=_rows, run=_run_rmsnorm, reference=_ref_rows, tolerance=1e-2,
        check_shapes=ROW_CHECKS, bench_shapes=ROW_BENCH,
        bytes_moved=lambda s: 2 * s[0] * s[1] * 2 + s[1] * 2,
        torch_peer=lambda d: _torch_rms(d["x"], d["weight"]), shape_help="TOKENSxHIDDEN",
    ),
    OpSpec(
        name="fused_add_rmsnorm", family="rmsnorm",
        kernels=("fused_add_rmsnorm_bf16_vpt1", "fused_add_rmsnorm_bf16_vpt2", "fused_add_rmsnorm_bf16_vpt4",
                 "fused_add_rmsnorm_bf16_vpt8", "fused_add_rmsnorm_bf16_scalar"),
        make_inputs=_fused_inputs, run=_run_fused, reference=_ref_fused, tolerance=1e-2,
        check_shapes=ROW_CHECKS, bench_shapes=ROW_BENCH,
        # x and residual read, residual and out written, weight read
        bytes_moved=lambda s: 4 * s[0] * s[1] * 2 + s[1] * 2,
        torch_peer=_torch_fused, shape_help="TOKENSxHIDDEN",
    ),
    OpSpec(
        name="head_rmsnorm", family="rmsnorm",
        kernels=("head_rmsnorm_d64_bf16", "head_rmsnorm_d128_bf16", "head_rmsnorm_d128_bf16_scalar"),
        make_inputs=_heads, run=_run_heads, reference=_ref_rows, tolerance=1e-2,
        check_shapes=[(1, 8, 128), (7, 40, 128), (1023, 5, 64), (3, 1, 64)],
        bench_shapes=[(8192, 32, 128), (8192, 8, 128), (64, 32, 128)],
        bytes_moved=lambda s: 2 * s[0] * s[1] * s[2] * 2 + s[2] * 2,
        torch_peer=lambda d: _torch_rms(d["x"], d["weight"]), shape_help="TOKENSxHEADSxHEAD_DIM",
    ),
]
