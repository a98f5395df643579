"""silu_and_mul: out = silu(x[:, :I]) * x[:, I:]. Shapes: TOKENSxINTER (x is TOKENS x 2*INTER)."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec


def _inputs(rng, shape):
    t, i = shape
    return {"x": random_array(rng, (t, 2 * i), "bfloat16", mean=0.3, std=2.0)}


def _run(d):
    from xserv.ops.activation import silu_and_mul

    t, w = d["x"].shape
    return silu_and_mul(d["x"], out=poisoned((t, w // 2), d["x"].dtype))


def _ref(d):
    from xserv.ops.activation import silu_and_mul_reference

    return silu_and_mul_reference(d["x"]).astype("bfloat16").astype(np.float64)


def _torch(d):
    import torch.nn.functional as F

    i = d["x"].shape[1] // 2
    return F.silu(d["x"][:, :i]) * d["x"][:, i:]


SPECS = [
    OpSpec(
        name="silu_and_mul", family="activation", kernels=("silu_and_mul_bf16_vec", "silu_and_mul_bf16_scalar"),
        make_inputs=_inputs, run=_run, reference=_ref, tolerance=1e-2,
        check_shapes=[(1, 3072), (7, 12288), (1023, 768), (5, 100)],
        bench_shapes=[(8192, 12288), (8192, 3072), (1, 12288), (256, 12288)],
        bytes_moved=lambda s: s[0] * 2 * s[1] * 2 + s[0] * s[1] * 2,
        torch_peer=_torch, shape_help="TOKENSxINTER",
    ),
]
