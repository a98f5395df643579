"""FP8 weight-only skinny GEMM (cuda_src/gemv_fp8.cu, xserv/ops/gemv_fp8.py; linear_fp8's M <= 8 path):
gemv_fp8 = x bf16 [M, K] @ dequant(W e4m3 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)])^T -> bf16 [M, N].
Shapes MxNxK, K % 16 == 0. `--variant soft` runs the bit-manipulation e4m3 conversion on every arch (the _soft
entries), the default the hardware one on sm_89+.

bytes_moved: the FP8 weight (N * K bytes), its scales, x and out: `bench gemv_fp8` prints % of copy bandwidth on
those bytes (the goal: >= 85%; docs/kernels/gemv.md, "FP8 weight-only", has the H100 figures). Eager timing is mostly
host time at these sizes: use --graph.

The fused one-token entries (gemv_fp8.cu's gemv_fp8_row_*: ops/gemv.py's ops on an Fp8Weight) are ops of their own,
which `bench gemv_fp8` / `check gemv_fp8` run after it (without --shapes / --variant; OpSpec.with_ops), at the
Qwen3-8B projections the model runs them on: gemv_fp8_rmsnorm (qkv: RMSNorm of the fp32 residual, then the
projection), gemv_fp8_add (o, down: residual += bf16(x @ W^T)), gemv_fp8_rmsnorm_silu_mul (gate/up, N = 2I, with
SiLU-and-mul: out [1, I]). Compare their us with the plain rows above at the same shapes."""
import numpy as np

from xserv.fp8_format import quantize_blockwise, scale_shape
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


def _weight_bytes(n, k):
    nb, kb = scale_shape((n, k))
    return n * k + nb * kb * 4  # e4m3 weight + its float32 scales


def _bytes(s):
    m, n, k = s
    return _weight_bytes(n, k) + m * k * 2 + m * n * 2  # fp8 weight + scales + x + out (bf16)


# ---- the fused one-row entries ------------------------------------------------------------------------------------
EPS = 1e-6


def _fused_inputs(kind):
    def make(rng, shape):
        m, n, k = shape
        d = _inputs(rng, shape)
        if kind == "add":
            d["residual"] = random_array(rng, (m, n), "float32", mean=0.0, std=0.1)
        else:  # the fp32 residual stream and the norm weight
            d["x"] = random_array(rng, (m, k), "float32", mean=0.2, std=3.0)
            d["norm_weight"] = random_array(rng, (k,), "bfloat16", mean=1.0, std=0.1)
        return d
    return make


def _fp8(d):
    from xserv.fp8_format import Fp8Weight

    return Fp8Weight(d["weight"], d["scale_inv"])


def _run_rmsnorm(d):
    from xserv.ops.gemv import rmsnorm_linear

    out = poisoned((1, d["weight"].shape[0]), "bfloat16", d["x"].device)
    return rmsnorm_linear(d["x"], d["norm_weight"], EPS, _fp8(d), out=out)


def _run_silu(d):
    from xserv.ops.gemv import rmsnorm_linear_silu_mul

    out = poisoned((1, d["weight"].shape[0] // 2), "bfloat16", d["x"].device)
    return rmsnorm_linear_silu_mul(d["x"], d["norm_weight"], EPS, _fp8(d), out=out)


def _run_add(d):
    # adds into a copy of the residual: the check compares one call, and the bench's repeats may keep adding
    from xserv.ops.gemv import linear_add

    residual = poisoned(d["residual"].shape, "float32", d["x"].device).copy_(d["residual"])
    return linear_add(d["x"], _fp8(d), residual)


def _ref_rmsnorm(d):
    from xserv.ops.gemv import rmsnorm_linear_reference

    pair = (d["weight"], d["scale_inv"])
    return rmsnorm_linear_reference(d["x"], d["norm_weight"], EPS, pair).astype("bfloat16").astype(np.float64)


def _ref_silu(d):
    from xserv.ops.gemv import rmsnorm_linear_silu_mul_reference

    pair = (d["weight"], d["scale_inv"])
    return rmsnorm_linear_silu_mul_reference(d["x"], d["norm_weight"], EPS, pair).astype(np.float64)


def _ref_add(d):
    from xserv.ops.gemv import add_rounded
    from xserv.ops.gemv_fp8 import linear_fp8_reference

    return add_rounded(d["residual"], linear_fp8_reference(d["x"], d["weight"], d["scale_inv"])).astype(np.float64)


def _fused_spec(name, entry, kind, run, ref, check, bench, x_bytes, out_bytes, help_text):
    return OpSpec(name=name, family="gemv_fp8", kernels=(f"gemv_fp8_row_{entry}", f"gemv_fp8_row_{entry}_1step"),
                  make_inputs=_fused_inputs(kind), run=run, reference=ref, tolerance=1e-2, check_shapes=check,
                  bench_shapes=bench,
                  bytes_moved=lambda s: _weight_bytes(s[1], s[2]) + s[2] * x_bytes + s[1] * out_bytes,
                  shape_help=help_text)


FUSED = ("gemv_fp8_rmsnorm", "gemv_fp8_add", "gemv_fp8_rmsnorm_silu_mul")
SPECS = [
    OpSpec(name="gemv_fp8", family="gemv_fp8",
           kernels=tuple(f"gemv_fp8_m{r}{v}" for r in (1, 2, 4, 8) for v in ("", "_soft")),
           make_inputs=_inputs, run=_run, reference=_ref, tolerance=1e-2, check_shapes=CHECK, bench_shapes=BENCH,
           bytes_moved=_bytes, shape_help="MxNxK (K % 16 == 0)", with_ops=FUSED),
    # bytes: the residual row read (fp32) / x read (bf16), the out row written (bf16; the residual read and written)
    _fused_spec("gemv_fp8_rmsnorm", "rmsnorm_bf16", "norm", _run_rmsnorm, _ref_rmsnorm,
                [(1, 1000, 1040), (1, 37, 48), (1, 4099, 8208)], [(1, 6144, 4096)], 4, 2, "1xNxK (K % 16 == 0)"),
    _fused_spec("gemv_fp8_add", "bf16_add", "add", _run_add, _ref_add,
                [(1, 1000, 1040), (1, 37, 48), (1, 130, 12304)], [(1, 4096, 4096), (1, 4096, 12288)], 2, 8,
                "1xNxK (K % 16 == 0)"),
    _fused_spec("gemv_fp8_rmsnorm_silu_mul", "rmsnorm_silu_mul", "norm", _run_silu, _ref_silu,
                [(1, 2000, 1040), (1, 24, 48), (1, 6144, 8208)], [(1, 24576, 4096)], 4, 1,
                "1xNxK (N = 2I gate then up rows, I % 4 == 0; K % 16 == 0)"),
]
