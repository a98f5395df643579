"""moe_experts: the mixture-of-experts block (router projection, routing + sorted list, grouped gate/up and down
GEMMs, combine). Shapes: TOKENSxEXPERTSxTOPKxHIDDENxINTER, e.g. 1x128x8x2048x768 (Qwen3-30B-A3B, one token).

bytes_moved counts the experts a step is expected to touch under uniform routing, E * (1 - (1 - k/E)^T) (random
inputs route close to uniformly), plus the router and the activations; flops count the routed experts only.

moe_experts_fp8: the same block on FP8 experts (e4m3 with 128 x 128 block scales, a -FP8 checkpoint's, kept FP8 with
XSERV_FP8_EXPERTS=e4m3): the GEMMs' _fp8 entries. HIDDEN and INTER multiples of 128; the reference dequantizes."""
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


def _fp8_inputs(rng, shape):
    """_inputs with the experts quantized blockwise, expert by expert, as a -FP8 checkpoint stores them."""
    from xserv.fp8_format import quantize_blockwise

    d = _inputs(rng, shape)
    for name in ("gate_up", "down"):
        pairs = [quantize_blockwise(w.astype(np.float32)) for w in d[name]]
        d[name] = np.stack([q for q, _ in pairs])
        d[name + "_scale"] = np.stack([sc for _, sc in pairs]).astype(np.float32)
    return d


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
                       out=poisoned((t, h), d["x"].dtype), workspace=_workspaces[key],
                       gate_up_scale=d.get("gate_up_scale"), down_scale=d.get("down_scale"))


def _ref(d):
    from xserv.ops.moe import dequantize_experts, moe_experts_reference

    gate_up, down = d["gate_up"], d["down"]
    if "gate_up_scale" in d:
        gate_up, down = dequantize_experts(gate_up, d["gate_up_scale"]), dequantize_experts(down, d["down_scale"])
    out = moe_experts_reference(d["x"], d["router"], gate_up, down, d["top_k"], True)
    return out.astype("bfloat16").astype(np.float64)


def _bytes(s, weight_bytes=2):
    """weight_bytes: 2 (bf16 experts) or 1 (e4m3; their float32 scales, 1/4096 of a byte a weight, left out)."""
    t, e, k, h, inter = s
    return int(expected_touched_experts(e, k, t) * 3 * h * inter * weight_bytes + e * h * 2 + 2 * t * h * 2)


def _flops(s):
    return s[0] * (s[2] * 3 * s[3] * s[4] * 2 + s[1] * s[3] * 2)


_BENCH = [(1, 128, 8, 2048, 768), (8, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (256, 128, 8, 2048, 768),
          (2048, 128, 8, 2048, 768), (8192, 128, 8, 2048, 768)]


SPECS = [
    OpSpec(
        name="moe_experts", family="moe",
        kernels=("moe_route_p4", "moe_topk_p4", "moe_sort", "moe_gemm_gate_up_small", "moe_gemm_down_small", "moe_gemm_gate_up_large",
                 "moe_gemm_down_large", "moe_gemm_gate_up_mid", "moe_gemm_down_mid", "moe_combine_store",
                 "moe_gemm_gate_up_one", "moe_gemm_down_one_store_k128"),
        make_inputs=_inputs, run=_run, reference=_ref, tolerance=1e-2,
        check_shapes=[(1, 128, 8, 2048, 768), (5, 16, 4, 256, 128), (300, 32, 8, 512, 256), (3, 8, 2, 136, 200)],
        bench_shapes=_BENCH, bytes_moved=_bytes, flops=_flops, shape_help="TOKENSxEXPERTSxTOPKxHIDDENxINTER",
    ),
    OpSpec(
        name="moe_experts_fp8", family="moe",
        kernels=("moe_route_p4", "moe_topk_p4", "moe_sort", "moe_gemm_gate_up_small_fp8", "moe_gemm_down_small_fp8",
                 "moe_gemm_gate_up_large_fp8", "moe_gemm_down_large_fp8", "moe_gemm_gate_up_mid_fp8",
                 "moe_gemm_down_mid_fp8", "moe_combine_store", "moe_gemm_gate_up_one_fp8",
                 "moe_gemm_down_one_store_k128_fp8"),
        make_inputs=_fp8_inputs, run=_run, reference=_ref, tolerance=1e-2,
        check_shapes=[(1, 128, 8, 2048, 768), (5, 16, 4, 256, 128), (300, 32, 8, 512, 256), (3, 8, 2, 128, 256)],
        bench_shapes=_BENCH, bytes_moved=lambda s: _bytes(s, weight_bytes=1), flops=_flops,
        shape_help="TOKENSxEXPERTSxTOPKxHIDDENxINTER (multiples of 128)",
    ),
]
