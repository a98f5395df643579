"""argmax over rows (greedy sampling). Shapes: BATCHxVOCAB. Exact: compared index by index."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec


def _inputs(dtype):
    def make(rng, shape):
        b, v = shape
        x = random_array(rng, shape, dtype, mean=0.5, std=2.0).astype(np.float32)
        x[np.arange(b), rng.integers(0, v, b)] = x.max(axis=1) + 4.0  # one clear maximum per row
        return {"x": x.astype(dtype)}
    return make


def _run(d):
    from xserv.ops.argmax import argmax

    return argmax(d["x"], out=poisoned((d["x"].shape[0],), np.int32))


def _ref(d):
    from xserv.ops.argmax import argmax_reference

    return argmax_reference(d["x"]).astype(np.float64)


def _mismatches(out, ref, inputs):
    """Fraction of rows whose index differs (must be 0)."""
    return float(np.mean(np.asarray(out).astype(np.int64) != np.asarray(ref).astype(np.int64)))


SPECS = [
    OpSpec(
        name=f"argmax_{suffix}", family="argmax", kernels=(f"argmax_{suffix}_vec", f"argmax_{suffix}"),
        make_inputs=_inputs(dtype), run=_run, reference=_ref, tolerance=0.0, compare=_mismatches,
        check_shapes=[(1, 151936), (7, 151936), (5, 7), (64, 1023), (3, 1)],
        bench_shapes=[(1, 151936), (64, 151936), (256, 151936)],
        bytes_moved=lambda s, n=size: s[0] * s[1] * n + s[0] * 4,
        torch_peer=lambda d: d["x"].argmax(dim=-1), shape_help="BATCHxVOCAB",
    )
    for suffix, dtype, size in (("bf16", "bfloat16", 2), ("f32", "float32", 4))
]
