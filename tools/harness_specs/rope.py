"""RoPE family: rope (TOKENSxHEADSxHEAD_DIM), qk_norm_rope (TOKENSxQ_HEADSxKV_HEADSxHEAD_DIM), in place on the
packed QKV, and qk_norm_rope_write_kv (TOKENSxQ_HEADSxKV_HEADSxHEAD_DIM[xBLOCK]): qk_norm_rope and the paged
KV-cache write in one launch (checked as the packed qkv and both caches, one flat array)."""
import numpy as np

from xserv.testing import poisoned, random_array

from . import OpSpec

EPS = 1e-6
THETA = 1e6
MAX_POS = 40960


def _table(head_dim):
    from xserv.ops.rope import rope_cos_sin_table

    return rope_cos_sin_table(head_dim, MAX_POS, THETA)


def _rope_inputs(rng, shape):
    t, nh, hd = shape
    return {"x": random_array(rng, shape, "bfloat16", mean=0.2),
            "positions": rng.integers(0, MAX_POS, t).astype(np.int32), "cos_sin": _table(hd)}


def _qk_inputs(rng, shape):
    t, hq, hkv, hd = shape
    return {"qkv": random_array(rng, (t, hq + 2 * hkv, hd), "bfloat16", mean=0.3),
            "q_weight": random_array(rng, (hd,), "bfloat16", mean=1.0, std=0.3),
            "k_weight": random_array(rng, (hd,), "bfloat16", mean=1.0, std=0.3),
            "positions": rng.integers(0, MAX_POS, t).astype(np.int32), "cos_sin": _table(hd),
            # carries num_kv_heads in its shape (the kernel does not read it): run() only sees the tensors
            "kv_heads_marker": np.zeros(hkv, np.int32)}


def _run_rope(d):
    from xserv.ops.rope import rope

    return rope(d["x"], d["positions"], d["cos_sin"], out=poisoned(d["x"].shape, d["x"].dtype))


def _heads(d):
    hkv = d["kv_heads_marker"].shape[0]
    return d["qkv"].shape[1] - 2 * hkv, hkv


def _run_qk(d):
    # In place on d["qkv"]: the check must compare the first run.
    from xserv.ops.rope import qk_norm_rope

    hq, hkv = _heads(d)
    return qk_norm_rope(d["qkv"], d["q_weight"], d["k_weight"], d["positions"], d["cos_sin"], hq, hkv, EPS)


def _ref_rope(d):
    from xserv.ops.rope import rope_reference

    return rope_reference(d["x"], d["positions"], d["cos_sin"]).astype("bfloat16").astype(np.float64)


def _ref_qk(d):
    from xserv.ops.rope import qk_norm_rope_reference

    hq, hkv = _heads(d)
    return qk_norm_rope_reference(d["qkv"], d["q_weight"], d["k_weight"], d["positions"], d["cos_sin"], hq, hkv,
                                  EPS).astype(np.float64)


def _torch_rope_apply(x, positions, cos_sin):
    import torch

    half = x.shape[-1] // 2
    cs = cos_sin[positions.long()][:, None, :]
    c, s = cs[..., :half], cs[..., half:]
    xf = x.float()
    lo, hi = xf[..., :half], xf[..., half:]
    return torch.cat([lo * c - hi * s, hi * c + lo * s], -1).to(x.dtype)


def _torch_rms(x, w):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def _torch_qk(d):
    hkv = d["kv_heads_marker"].shape[0]
    qkv = d["qkv"]
    hq = qkv.shape[1] - 2 * hkv
    q = _torch_rope_apply(_torch_rms(qkv[:, :hq], d["q_weight"]), d["positions"], d["cos_sin"])
    k = _torch_rope_apply(_torch_rms(qkv[:, hq:hq + hkv], d["k_weight"]), d["positions"], d["cos_sin"])
    qkv[:, :hq] = q
    qkv[:, hq:hq + hkv] = k
    return qkv


def _fused_inputs(rng, shape):
    t, hq, hkv, hd, *rest = shape
    block = rest[0] if rest else 16
    num_blocks = -(-t // block) + 2
    slots = rng.permutation(num_blocks * block)[:t].astype(np.int32)
    slots[::7] = -1  # padding tokens
    d = _qk_inputs(rng, (t, hq, hkv, hd))
    # K and V caches as the two halves of one array (random: slots nobody writes must keep their values)
    d.update(slot_mapping=slots, kv_cache=random_array(rng, (2, num_blocks, block, hkv, hd), "bfloat16", mean=0.0))
    return d


class _Flat:
    """The op's three outputs (qkv, k_cache, v_cache) as one flat array for the harness's comparison."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def numpy(self):
        return np.concatenate([t.numpy().astype(np.float64).ravel() for t in self.tensors])


def _run_fused(d):
    # In place on d["qkv"] and d["kv_cache"]: the check must compare the first run.
    from xserv.ops.rope import qk_norm_rope_write_kv

    hq, hkv = _heads(d)
    kv = d["kv_cache"]
    qk_norm_rope_write_kv(d["qkv"], d["q_weight"], d["k_weight"], d["positions"], d["cos_sin"], hq, hkv, EPS, kv[0],
                          kv[1], d["slot_mapping"])
    return _Flat(d["qkv"], kv)


def _ref_fused(d):
    from xserv.ops.rope import qk_norm_rope_write_kv_reference

    hq, hkv = _heads(d)
    kv = d["kv_cache"].copy()
    qkv = qk_norm_rope_write_kv_reference(d["qkv"], d["q_weight"], d["k_weight"], d["positions"], d["cos_sin"], hq,
                                          hkv, EPS, kv[0], kv[1], d["slot_mapping"])
    return np.concatenate([qkv.astype(np.float64).ravel(), kv.astype(np.float64).ravel()])


def _fused_bytes(s):
    t, hq, hkv, hd = s[:4]
    # q, k read and written; v read; k and v written to the cache; two weights; positions and slots; table rows
    return 2 * t * hd * (2 * (hq + hkv) + hkv + 2 * hkv) + 2 * hd * 2 + 8 * t + t * hd * 4


def _torch_fused(d):
    hkv = d["kv_heads_marker"].shape[0]
    qkv = _torch_qk(d)
    hq = qkv.shape[1] - 2 * hkv
    kv = d["kv_cache"]
    if "_slots" not in d:
        keep = d["slot_mapping"] >= 0
        d["_slots"] = (keep, d["slot_mapping"][keep].long())
    keep, slots = d["_slots"]
    kv[0].view(-1, hkv, qkv.shape[2])[slots] = qkv[keep, hq:hq + hkv]
    kv[1].view(-1, hkv, qkv.shape[2])[slots] = qkv[keep, hq + hkv:]
    return kv


SPECS = [
    OpSpec(
        name="rope", family="rope", kernels=("rope_d64_bf16", "rope_d128_bf16", "rope_d128_bf16_scalar"),
        make_inputs=_rope_inputs, run=_run_rope, reference=_ref_rope, tolerance=1e-2,
        check_shapes=[(1, 32, 128), (7, 8, 128), (1023, 5, 64), (3, 1, 64)],
        bench_shapes=[(8192, 48, 128), (8192, 40, 128), (64, 40, 128)],
        # x read, out written, positions read, one table row per token
        bytes_moved=lambda s: 2 * s[0] * s[1] * s[2] * 2 + s[0] * 4 + s[0] * s[2] * 4,
        torch_peer=lambda d: _torch_rope_apply(d["x"], d["positions"], d["cos_sin"]),
        shape_help="TOKENSxHEADSxHEAD_DIM",
    ),
    OpSpec(
        name="qk_norm_rope", family="rope",
        kernels=("qk_norm_rope_d64_bf16", "qk_norm_rope_d128_bf16", "qk_norm_rope_d128_bf16_scalar"),
        make_inputs=_qk_inputs, run=_run_qk, reference=_ref_qk, tolerance=1e-2,
        check_shapes=[(1, 32, 8, 128), (7, 16, 8, 128), (1023, 14, 2, 64), (5, 1, 1, 128)],
        bench_shapes=[(8192, 32, 8, 128), (8192, 64, 8, 128), (64, 32, 8, 128)],
        # q and k heads read and written (v untouched), two weights, positions, one table row per token
        bytes_moved=lambda s: 2 * s[0] * (s[1] + s[2]) * s[3] * 2 + 2 * s[3] * 2 + s[0] * 4 + s[0] * s[3] * 4,
        torch_peer=_torch_qk, shape_help="TOKENSxQ_HEADSxKV_HEADSxHEAD_DIM",
    ),
    OpSpec(
        name="qk_norm_rope_write_kv", family="rope",
        kernels=("qk_norm_rope_write_kv_d64_s1", "qk_norm_rope_write_kv_d128_s1", "qk_rope_write_kv_d64_s1",
                 "qk_rope_write_kv_d128_s1"),
        make_inputs=_fused_inputs, run=_run_fused, reference=_ref_fused, tolerance=1e-2,
        check_shapes=[(1, 32, 8, 128), (7, 16, 8, 128), (1023, 14, 2, 64, 32), (5, 1, 1, 128, 1)],
        bench_shapes=[(8192, 32, 8, 128), (8192, 16, 8, 128), (64, 32, 8, 128), (1, 16, 8, 128)],
        bytes_moved=_fused_bytes, torch_peer=_torch_fused, shape_help="TOKENSxQ_HEADSxKV_HEADSxHEAD_DIM[xBLOCK]",
    ),
]
