"""embedding: out[t] = table[ids[t]]. Shapes: TOKENSxVOCABxHIDDEN."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec


def _inputs(rng, shape):
    t, v, h = shape
    return {"ids": rng.integers(0, v, t).astype(np.int32), "table": random_array(rng, (v, h), "bfloat16")}


def _run(d):
    from xserv.ops.embedding import embedding

    out = poisoned((d["ids"].shape[0], d["table"].shape[1]), d["table"].dtype)
    return embedding(d["ids"], d["table"], out=out)


def _torch(d):
    import torch.nn.functional as F

    return F.embedding(d["ids"], d["table"])


SPECS = [
    OpSpec(
        name="embedding", family="embedding", kernels=("embedding_bf16_vec", "embedding_bf16_scalar"),
        make_inputs=_inputs, run=_run,
        reference=lambda d: d["table"].astype(np.float64)[d["ids"]],
        tolerance=0.0,
        check_shapes=[(1, 1000, 128), (7, 5000, 1024), (1023, 151936, 4096), (5, 300, 1000)],
        bench_shapes=[(8192, 151936, 4096), (256, 151936, 4096)],
        bytes_moved=lambda s: s[0] * 4 + 2 * s[0] * s[2] * 2,  # ids + the rows read + the rows written
        torch_peer=_torch, shape_help="TOKENSxVOCABxHIDDEN",
    ),
]
