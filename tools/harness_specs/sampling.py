"""Batched sampling (xserv.ops.sampling). Shapes: BATCHxVOCAB. Three workloads: greedy rows (vs argmax's cost),
temperature 0.6 / top-k 20 / top-p 0.95 (Qwen3's recommendation, the workload to beat), and temperature 1.0 alone
(the kernel's second, global-memory draw pass); and the Qwen3 workload with every row masked by a token bitmask
keeping ~1% of the vocabulary (structured output: the mask's cost next to the unmasked one). Compared token by token with the NumPy reference; a mismatch
rate up to 1% is allowed for float near-ties of the Gumbel-perturbed maxima (seen: 0 on separated logits)."""
import numpy as np

from xserv.testing import poisoned

from . import OpSpec

OPTIONS = {
    "greedy": dict(temperature=0.0),
    "topk_topp": dict(temperature=0.6, top_k=20, top_p=0.95),
    "temperature": dict(temperature=1.0),
    "topk_topp_masked": dict(temperature=0.6, top_k=20, top_p=0.95),
}
MASKED = {"topk_topp_masked"}


def _inputs(options, masked=False):
    def make(rng, shape):
        from xserv.ops.sampling import RowParams, pack_sampling_params

        b, v = shape
        logits = (rng.standard_normal((b, v)) * 2.0 + 0.3).astype(np.float32)
        rows = [RowParams(seed=int(s), step=7, mask_row=i if masked else -1, **options)
                for i, s in enumerate(rng.integers(0, 2**63, b))]
        fparams, iparams = pack_sampling_params(rows)
        d = {"logits": logits, "fparams": fparams, "iparams": iparams}
        if masked:
            keep = np.zeros((b, ((v + 31) // 32) * 32), bool)
            keep[:, :v] = rng.random((b, v)) < 0.01
            d["token_mask"] = np.packbits(keep, axis=1, bitorder="little").view(np.int32).copy()
        return d
    return make


def _run(d):
    from xserv.ops.sampling import sample

    kw = {"token_mask": d["token_mask"]} if "token_mask" in d else {}
    return sample(d["logits"], d["fparams"], d["iparams"], out=poisoned((d["logits"].shape[0],), np.int32), **kw)


def _ref(d):
    from xserv.ops.sampling import sample_reference

    return sample_reference(d["logits"], d["fparams"], d["iparams"],
                            token_mask=d.get("token_mask"))[0].astype(np.float64)


def _mismatches(out, ref, inputs):
    return float(np.mean(np.asarray(out).astype(np.int64) != np.asarray(ref).astype(np.int64)))


def _torch_peer(options):
    """PyTorch doing the same job the usual way: argmax; or top-k, then top-p by sorting the k survivors, then
    multinomial over the softmax; or multinomial over the softmax of the whole vocabulary."""
    def peer(d):
        import torch

        x = d["logits"]
        t, k, p = options["temperature"], options.get("top_k", 0), options.get("top_p", 1.0)
        if t == 0:
            return x.argmax(dim=-1)
        if k:
            vals, ids = torch.topk(x / t, k, dim=-1)  # sorted descending
            probs = torch.softmax(vals, dim=-1)
            drop = probs.cumsum(-1) - probs >= p
            probs = probs.masked_fill(drop, 0.0)
            return ids.gather(-1, torch.multinomial(probs, 1))
        return torch.multinomial(torch.softmax(x / t, dim=-1), 1)
    return peer


SPECS = [
    OpSpec(
        name=f"sampling_{name}", family="sampling", kernels=("sample_f32_vec", "sample_f32"),
        make_inputs=_inputs(options, name in MASKED), run=_run, reference=_ref, tolerance=0.01, compare=_mismatches,
        check_shapes=[(256, 151936), (7, 151937), (33, 1000)],
        bench_shapes=[(1, 151936), (64, 151936), (256, 151936)],
        bytes_moved=lambda s: s[0] * s[1] * 4 + s[0] * 68,
        torch_peer=_torch_peer(options), shape_help="BATCHxVOCAB",
    )
    for name, options in OPTIONS.items()
]
