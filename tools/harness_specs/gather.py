"""gather of int32 values with a keep marker (the engine's device-side token feedback). Shapes: SRCxN. Exact."""
import numpy as np

from . import OpSpec


def _inputs(rng, shape):
    m, n = shape
    return {"src": rng.integers(0, 150_000, m).astype(np.int32), "index": rng.integers(-1, m, n).astype(np.int32),
            "out": rng.integers(-5, 0, n).astype(np.int32)}


def _run(d):
    from xserv.ops.gather import gather

    return gather(d["src"], d["index"], d["out"])


def _ref(d):
    from xserv.ops.gather import gather_reference

    return gather_reference(d["src"], d["index"], d["out"]).astype(np.float64)


def _mismatches(out, ref, inputs):
    """Fraction of entries that differ (must be 0)."""
    return float(np.mean(np.asarray(out).astype(np.int64) != np.asarray(ref).astype(np.int64)))


SPECS = [OpSpec(
    name="gather_i32", family="gather", kernels=("gather_i32",), make_inputs=_inputs, run=_run, reference=_ref,
    tolerance=0.0, compare=_mismatches, check_shapes=[(1, 1), (256, 256), (300, 1000)], bench_shapes=[(256, 256)],
    bytes_moved=lambda s: 3 * 4 * s[1], shape_help="SRCxN",
)]
