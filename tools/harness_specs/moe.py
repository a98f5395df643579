"""moe_experts: the mixture-of-experts block (router projection, routing + sorted list, grouped gate/up and down
GEMMs, combine). Shapes: TOKENSxEXPERTSxTOPKxHIDDENxINTER, e.g. 1x128x8x2048x768 (Qwen3-30B-A3B, one token).

bytes_moved counts the experts a step is expected to touch under uniform routing, E * (1 - (1 - k/E)^T) (random
inputs route close to uniformly), plus the router and the activations; flops count the routed experts only."""
import numpy as np

from xserv.ops.moe import expected_touched_experts
from xserv.testing import poisoned, random_array

from . import OpSpec

_workspaces: dict = {}


def _inputs(rng, shape):
    t, e, k, h, inter = shape
    return {"x": random_array(rng, (t, h), "bfloat16", mean=0.0),
            "router": random_array(rng, (e, h), "bfloat16", mean=0.0, std=0.5 / np.sqrt(h)),
            "gate_up": random_array(rng, (e, 2 * inter, h), "bfloat16", mean=0.0, std=0.05),
            "down": random_array(rng, (e, h, inter), "bfloat16", mean=0.0, std=0.05),
            "top_k": k}


def _run(d):
    from xserv.ops.moe import MoeShape, MoeWorkspace, moe_experts

    t, h = d["x"].shape
    e, two_i, _ = d["gate_up"].shape
    shape = MoeShape(e, d["top_k"], h, two_i // 2)
    key = (shape, t)
    if key not in _workspaces:
        _workspaces.clear()
        _workspaces[key] = MoeWorkspace(shape, t, "cuda")
    return moe_experts(d["x"], d["router"], d["gate_up"], d["down"], d["top_k"], True,
                       out=poisoned((t, h), d["x"].dtype), workspace=_workspaces[key])


def _ref(d):
    from xserv.ops.moe import moe_experts_reference

    out = moe_experts_reference(d["x"], d["router"], d["gate_up"], d["down"], d["top_k"], True)
    return out.astype("bfloat16").astype(np.float64)


def _bytes(s):
    t, e, k, h, inter = s
    return int(expected_touched_experts(e, k, t) * 3 * h * inter * 2 + e * h * 2 + 2 * t * h * 2)


SPECS = [
    OpSpec(
        name="moe_experts", family="moe",
        kernels=("moe_route_p4", "moe_topk_p4", "moe_sort", "moe_gemm_gate_up_small", "moe_gemm_down_small", "moe_gemm_gate_up_large",
                 "moe_gemm_down_large", "moe_gemm_gate_up_mid", "moe_gemm_down_mid", "moe_combine_store",
                 "moe_gemm_gate_up_one", "moe_gemm_down_one_store"),
        make_inputs=_inputs, run=_run, reference=_ref, tolerance=1e-2,
        check_shapes=[(1, 128, 8, 2048, 768), (5, 16, 4, 256, 128), (300, 32, 8, 512, 256), (3, 8, 2, 136, 200)],
        bench_shapes=[(1, 128, 8, 2048, 768), (8, 128, 8, 2048, 768), (64, 128, 8, 2048, 768),
                      (256, 128, 8, 2048, 768), (2048, 128, 8, 2048, 768), (8192, 128, 8, 2048, 768)],
        bytes_moved=_bytes, flops=lambda s: s[0] * (s[2] * 3 * s[3] * s[4] * 2 + s[1] * s[3] * 2),
        shape_help="TOKENSxEXPERTSxTOPKxHIDDENxINTER",
    ),
]
