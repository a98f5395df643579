"""cast between bf16 / fp16 / fp32. Shapes: ROWSxCOLS. Bit-exact (round-to-nearest-even)."""
import numpy as np

from xserv.tensor import as_dtype
from xserv.testing import poisoned, random_array

from . import OpSpec

PAIRS = [("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16"), ("float32", "float16")]
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _inputs(src):
    def make(rng, shape):
        return {"x": random_array(rng, shape, src, mean=0.3, std=3.0)}
    return make


def _run(dst):
    def run(d):
        from xserv.ops.cast import cast

        return cast(d["x"], dst, out=poisoned(d["x"].shape, as_dtype(dst)))
    return run


def _ref(dst):
    return lambda d: d["x"].astype(np.float32).astype(as_dtype(dst)).astype(np.float64)


def _torch(dst):
    def peer(d):
        import torch

        return d["x"].to(getattr(torch, dst))
    return peer


SPECS = [
    OpSpec(
        name=f"cast_{SHORT[src]}_to_{SHORT[dst]}", family="cast", kernels=(f"cast_{SHORT[src]}_to_{SHORT[dst]}",),
        make_inputs=_inputs(src), run=_run(dst), reference=_ref(dst), tolerance=0.0,
        check_shapes=[(1, 7), (1023, 5), (4096, 4096)],
        bench_shapes=[(8192, 4096), (151936, 4096)],
        bytes_moved=lambda s, a=src, b=dst: s[0] * s[1] * (as_dtype(a).itemsize + as_dtype(b).itemsize),
        torch_peer=_torch(dst), shape_help="ROWSxCOLS",
    )
    for src, dst in PAIRS
]
