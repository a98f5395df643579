"""add: out = a + b (bf16 and fp32). Shapes: ROWSxCOLS."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec


def _inputs(dtype):
    def make(rng, shape):
        return {"a": random_array(rng, shape, dtype, mean=0.5), "b": random_array(rng, shape, dtype, mean=-0.2)}
    return make


def _run(d):
    from xserv.ops.elementwise import add

    return add(d["a"], d["b"], out=poisoned(d["a"].shape, d["a"].dtype))


def _ref(d):
    return (d["a"].astype(np.float32) + d["b"].astype(np.float32)).astype(d["a"].dtype).astype(np.float64)


SPECS = [
    OpSpec(
        name=f"add_{suffix}", family="elementwise", kernels=(f"add_{suffix}_vec", f"add_{suffix}_scalar"),
        make_inputs=_inputs(dtype), run=_run, reference=_ref, tolerance=tol,
        check_shapes=[(1, 7), (7, 1023), (1023, 4096), (3, 5)],
        bench_shapes=[(8192, 4096), (1, 4096)],
        bytes_moved=lambda s, n=size: 3 * s[0] * s[1] * n,
        torch_peer=lambda d: d["a"] + d["b"], shape_help="ROWSxCOLS",
    )
    for suffix, dtype, size, tol in (("bf16", "bfloat16", 2, 1e-6), ("f32", "float32", 4, 1e-7))
]
