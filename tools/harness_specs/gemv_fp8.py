"""FP8 weight-only skinny GEMM (cuda_src/gemv_fp8.cu, xserv/ops/gemv_fp8.py; linear_fp8's M <= 8 path):
gemv_fp8 = x bf16 [M, K] @ dequant(W e4m3 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)])^T -> bf16 [M, N].
Shapes MxNxK, K % 16 == 0. `--variant soft` runs the bit-manipulation e4m3 conversion on every arch (the _soft
entries), the default the hardware one on sm_89+.

bytes_moved: the FP8 weight (N * K bytes), its scales, x and out: `bench gemv_fp8` prints % of copy bandwidth on
those bytes (the issue-31 goal: >= 85%; v1 on an H100: 56-89% at one row, 26-36% at eight). Eager timing is mostly
host time at these sizes: use --graph."""
import numpy as np

from xserv.models.fp8 import quantize_blockwise, scale_shape
from xserv.testing import poisoned, random_array

from . import OpSpec

CHECK = [(1, 5120, 2048), (1, 37, 48), (3, 1000, 1040), (8, 301, 4112), (1, 130, 12304)]
# Qwen3-8B's projections at one and eight rows: qkv, o, gate_up, down
BENCH = [(1, 6144, 4096), (1, 4096, 4096), (1, 24576, 4096), (1, 4096, 12288), (8, 24576, 4096), (8, 4096, 12288)]


def _inputs(rng, shape):
    m, n, k = shape
    q, s = quantize_blockwise(random_array(rng, (n, k), np.float32, mean=0.0, std=0.05))
    return {"x": random_array(rng, (m, k), "bfloat16", mean=0.1), "weight": q, "scale_inv": s}


def _run(d):
    from xserv.ops.gemv_fp8 import linear_fp8_gemv

    conversion = "soft" if d.get("variant") == "soft" else "auto"
    out = poisoned((d["x"].shape[0], d["weight"].shape[0]), "bfloat16", d["x"].device)
    return linear_fp8_gemv(d["x"], d["weight"], d["scale_inv"], out=out, conversion=conversion)


def _ref(d):
    from xserv.ops.gemv_fp8 import linear_fp8_reference

    return linear_fp8_reference(d["x"], d["weight"], d["scale_inv"]).astype("bfloat16").astype(np.float64)


def _bytes(s):
    m, n, k = s
    nb, kb = scale_shape((n, k))
    return n * k + nb * kb * 4 + m * k * 2 + m * n * 2  # fp8 weight + scales + x + out (bf16)


SPECS = [
    OpSpec(name="gemv_fp8", family="gemv_fp8",
           kernels=tuple(f"gemv_fp8_m{r}{v}" for r in (1, 2, 4, 8) for v in ("", "_soft")),
           make_inputs=_inputs, run=_run, reference=_ref, tolerance=1e-2, check_shapes=CHECK, bench_shapes=BENCH,
           bytes_moved=_bytes, shape_help="MxNxK (K % 16 == 0)"),
]
