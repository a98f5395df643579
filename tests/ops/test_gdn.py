"""Gated DeltaNet ops (xserv/ops/gdn.py): the NumPy references against plain float64 loops written here, the chunked
(WY) form the CUDA prefill kernel computes against the token-by-token recurrence, and every CUDA kernel against its
reference on packed batches (mixed lengths, fresh and continuing sequences, scattered slots)."""
import numpy as np
import pytest

from xserv.ops import gdn
from xserv.ops.gdn import (causal_conv1d_silu, causal_conv1d_silu_reference, gated_delta_rule,
                           gated_delta_rule_reference, gated_rmsnorm_silu, gated_rmsnorm_silu_reference)
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import poisoned, random_array, rel_error

EPS = 1e-6


def cpu(a):
    return Tensor.from_numpy(np.ascontiguousarray(a), "cpu")


def dev(a):
    return Tensor.from_numpy(np.ascontiguousarray(a), "cuda")


# ---- problems ------------------------------------------------------------------------------------------------------
class Problem:
    """A packed batch for one GDN layer: proj [T, P] = [qkv | z | b | a], u (an input for the delta rule on its own),
    the layer's weights and state pools with every slot filled (slots a step must not read hold NaN-free noise)."""

    def __init__(self, rng, q_lens, starts, slots, *, nk=2, nv=4, dk=16, dv=16, num_slots=None, taps=4):
        self.nk, self.nv, self.dk, self.dv, self.taps = nk, nv, dk, dv, taps
        self.conv_dim = 2 * nk * dk + nv * dv
        self.z_col, self.ba_col = self.conv_dim, self.conv_dim + nv * dv
        width = self.ba_col + 2 * nv
        rows = int(sum(q_lens))
        self.cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        self.kv = (np.asarray(starts) + np.asarray(q_lens)).astype(np.int32)
        self.slots = np.asarray(slots, np.int32)
        self.max_q_len = int(max(q_lens)) if len(q_lens) else 0
        num_slots = num_slots or int(self.slots.max()) + 2
        self.proj = random_array(rng, (rows, width), bfloat16, mean=0.1)
        self.weight = random_array(rng, (self.conv_dim, taps), bfloat16, mean=0.05, std=0.5)
        self.conv_state = random_array(rng, (num_slots, taps - 1, self.conv_dim), bfloat16)
        # u as the conv leaves it (silu output: mostly positive, some small negatives)
        self.u = random_array(rng, (rows, self.conv_dim), bfloat16, mean=0.2)
        # decays exp(g) between ~0.6 and ~1 per token, as trained layers have
        self.A_log = rng.uniform(-3.0, 0.5, nv).astype(np.float32)
        self.dt_bias = rng.uniform(-2.0, 1.0, nv).astype(np.float32)
        self.ssm_state = (rng.standard_normal((num_slots, nv, dk, dv)) * 0.3).astype(np.float32)
        self.norm_weight = random_array(rng, (dv,), bfloat16, mean=1.0, std=0.2)

    def meta(self, to):
        return to(self.cu), to(self.kv), to(self.slots)

    def heads(self):
        return dict(num_k_heads=self.nk, num_v_heads=self.nv, head_k_dim=self.dk, head_v_dim=self.dv)


# ---- independent float64 loops -------------------------------------------------------------------------------------
def conv64(p: Problem):
    """Per sequence, per token, per tap: the causal conv over [stored window | new inputs], then SiLU."""
    u = np.zeros((p.proj.shape[0], p.conv_dim))
    state = p.conv_state.astype(np.float64).copy()
    w = p.weight.astype(np.float64)
    for b in range(len(p.kv)):
        r0, r1 = p.cu[b], p.cu[b + 1]
        n = r1 - r0
        if n == 0:
            continue
        hist = [np.zeros(p.conv_dim) if p.kv[b] == n else state[p.slots[b], j] for j in range(p.taps - 1)]
        for t in range(r0, r1):
            hist.append(p.proj[t, :p.conv_dim].astype(np.float64))
            acc = sum(w[:, j] * hist[-p.taps + j] for j in range(p.taps))
            u[t] = acc / (1 + np.exp(-acc))
        state[p.slots[b]] = np.stack(hist[-(p.taps - 1):])
    return u, state


def delta_rule64(p: Problem, u=None):
    """S_t = exp(g) (I - beta k k^T) S_{t-1} + beta k v^T, o_t = S_t^T q_t, per sequence, value head and token."""
    u = (p.u if u is None else u).astype(np.float64)
    nk, nv, dk, dv = p.nk, p.nv, p.dk, p.dv
    o = np.zeros((u.shape[0], nv * dv))
    state = p.ssm_state.astype(np.float64).copy()
    for b in range(len(p.kv)):
        r0, r1 = p.cu[b], p.cu[b + 1]
        if r1 == r0:
            continue
        for j in range(nv):
            kh = j * nk // nv
            s = np.zeros((dk, dv)) if p.kv[b] == r1 - r0 else state[p.slots[b], j].copy()
            for t in range(r0, r1):
                q = u[t, kh * dk:(kh + 1) * dk]
                k = u[t, nk * dk + kh * dk:nk * dk + (kh + 1) * dk]
                v = u[t, 2 * nk * dk + j * dv:2 * nk * dk + (j + 1) * dv]
                q = q / np.sqrt(q @ q + 1e-6) / np.sqrt(dk)
                k = k / np.sqrt(k @ k + 1e-6)
                bl = float(p.proj[t, p.ba_col + j])
                al = float(p.proj[t, p.ba_col + nv + j])
                beta = 1 / (1 + np.exp(-bl))
                g = -np.exp(float(p.A_log[j])) * np.log1p(np.exp(al + float(p.dt_bias[j])))
                s = np.exp(g) * (s - beta * np.outer(k, k @ s)) + beta * np.outer(k, v)
                o[t, j * dv:(j + 1) * dv] = s.T @ q
            state[p.slots[b], j] = s
    return o, state


def gated_norm64(o, z, w, eps=EPS):
    nv = o.shape[1] // w.shape[0]
    of = o.astype(np.float64).reshape(o.shape[0], nv, -1)
    zf = z.astype(np.float64).reshape(of.shape)
    n = of / np.sqrt(np.mean(of * of, axis=-1, keepdims=True) + eps) * w.astype(np.float64)
    return (n * zf / (1 + np.exp(-zf))).reshape(o.shape)


# ---- the chunked form as the CUDA kernel computes it, in float64 (and optionally with its bf16 operands) -----------
def _unit_lower_inverse_blocked(lo: np.ndarray, block: int) -> np.ndarray:
    """(I + L)^-1 the way gdn.cu's invert_unit_lower does it: diagonal blocks by forward substitution, then the
    off-diagonal blocks by distance, X_ij = -D_i^-1 sum_{m=j}^{i-1} L_im X_mj."""
    c = lo.shape[0]
    nb = c // block
    x = np.zeros_like(lo)
    blk = lambda a, i, j: a[i * block:(i + 1) * block, j * block:(j + 1) * block]  # noqa: E731
    for i in range(nb):
        d = np.eye(block)
        li = blk(lo, i, i)
        for r in range(block):
            d[r] -= li[r, :r] @ d[:r]
        blk(x, i, i)[...] = d
    for dist in range(1, nb):
        for j in range(nb - dist):
            i = j + dist
            acc = sum(blk(lo, i, m) @ blk(x, m, j) for m in range(j, i))
            blk(x, i, j)[...] = -blk(x, i, i) @ acc
    return x


def chunked64(q, k, v, beta, g, s, chunk=64, rnd=lambda a: a):
    """One head: q (normalised, scaled), k [T, dk], v [T, dv], beta, g [T], initial S [dk, dv] -> (o, final S).
    `rnd` rounds the operands the kernel feeds to its bf16 tensor-core products."""
    n = len(g)
    o = np.zeros((n, v.shape[1]))
    for c0 in range(0, n, chunk):
        qc, kc, vc = np.zeros((chunk, q.shape[1])), np.zeros((chunk, k.shape[1])), np.zeros((chunk, v.shape[1]))
        bc, gc = np.zeros(chunk), np.zeros(chunk)
        m = min(chunk, n - c0)
        qc[:m], kc[:m], vc[:m], bc[:m], gc[:m] = q[c0:c0 + m], k[c0:c0 + m], v[c0:c0 + m], beta[c0:c0 + m], g[c0:c0 + m]
        qc, kc = rnd(qc), rnd(kc)
        gam = np.cumsum(gc)
        decay = np.exp(np.minimum(gam[:, None] - gam[None, :], 0))
        lower = np.tril(bc[:, None] * (kc @ kc.T) * decay, -1)
        att = rnd(np.tril((qc @ kc.T) * decay))
        t = rnd(_unit_lower_inverse_blocked(lower, chunk // 4))
        sb = rnd(s)
        r = rnd(bc[:, None] * (vc - np.exp(gam)[:, None] * (kc @ sb)))
        vp = t @ r
        o[c0:c0 + m] = (np.exp(gam)[:, None] * (qc @ sb) + att @ rnd(vp))[:m]
        s = np.exp(gam[-1]) * s + kc.T @ rnd(np.exp(gam[-1] - gam)[:, None] * vp)
    return o, s


def _head_inputs(rng, n, dk=32, dv=32):
    q = rng.standard_normal((n, dk)) + 0.2
    k = rng.standard_normal((n, dk)) + 0.2
    q = q / np.linalg.norm(q, axis=1, keepdims=True) / np.sqrt(dk)
    k = k / np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((n, dv)) + 0.1
    beta = 1 / (1 + np.exp(-rng.standard_normal(n)))
    g = -np.exp(rng.uniform(-3, 0.5)) * np.log1p(np.exp(rng.standard_normal(n) - 1))
    return q, k, v, beta, g, rng.standard_normal((dk, dv)) * 0.3


def _recurrent64(q, k, v, beta, g, s):
    o = np.zeros_like(v)
    for t in range(len(g)):
        s = np.exp(g[t]) * (s - beta[t] * np.outer(k[t], k[t] @ s)) + beta[t] * np.outer(k[t], v[t])
        o[t] = s.T @ q[t]
    return o, s


@pytest.mark.parametrize("n", [1, 17, 64, 65, 130, 200])
def test_chunked_form_equals_recurrence(rng, n):
    """The kernel's chunked algebra (WY form, blocked triangular inverse, padded last chunk, non-zero initial
    state) in float64 equals the token-by-token recurrence to rounding. Planted bug it catches: a mask of m < i where
    m <= i belongs (or the reverse), Gamma_last taken at a padded row, a wrong block in the inverse."""
    args = _head_inputs(rng, n)
    o, s = chunked64(*args)
    o_ref, s_ref = _recurrent64(*args)
    assert rel_error(o, o_ref) < 1e-10
    assert rel_error(s, s_ref) < 1e-10


def test_chunked_form_with_bf16_operands(rng):
    """The same with the kernel's bf16 operands: the error the CUDA chunked kernel may show against the fp32
    reference (its tolerance below is this measured error with a 3x margin)."""
    rnd = lambda a: a.astype(np.float32).astype(bfloat16).astype(np.float64)  # noqa: E731
    args = _head_inputs(rng, 300, 128, 128)
    o, s = chunked64(*args, rnd=rnd)
    o_ref, s_ref = _recurrent64(*args)
    assert rel_error(o, o_ref) < CHUNKED_O_TOL / 3
    assert rel_error(s, s_ref) < CHUNKED_S_TOL / 3


# ---- the references against the float64 loops ----------------------------------------------------------------------
BATCHES = {
    # name: (q_lens, starts, slots)
    "decode": ([1, 1, 1, 1, 1], [7, 1, 30, 2, 5], [4, 0, 6, 2, 9]),
    "mixed": ([1, 70, 3, 130, 2], [5, 0, 2, 0, 1], [3, 8, 1, 5, 0]),
    "fresh_short": ([2, 1, 3], [0, 0, 0], [2, 1, 0]),
    "one_long": ([200], [11], [1]),
}


@pytest.mark.parametrize("name", BATCHES)
def test_conv_reference_vs_float64(rng, name):
    """u to bf16 rounding (one rounding of each output: 2^-8 relative at most); the new windows exactly (they
    are copies of bf16 inputs); untouched slots unchanged."""
    p = Problem(rng, *BATCHES[name])
    state = p.conv_state.copy()
    u = causal_conv1d_silu_reference(p.proj, p.weight, state, p.cu, p.kv, p.slots, conv_dim=p.conv_dim)
    u64, state64 = conv64(p)
    assert rel_error(u, u64) < 4e-3
    np.testing.assert_array_equal(state.astype(np.float64), state64)


@pytest.mark.parametrize("name", BATCHES)
def test_delta_rule_reference_vs_float64(rng, name):
    """o within bf16 output rounding plus fp32 accumulation over up to 200 tokens (4e-3); the fp32 state to 1e-4."""
    p = Problem(rng, *BATCHES[name])
    state = p.ssm_state.copy()
    o = gated_delta_rule_reference(p.u, p.proj, p.A_log, p.dt_bias, state, p.cu, p.kv, p.slots, ba_col=p.ba_col,
                                   **p.heads())
    o64, state64 = delta_rule64(p)
    assert rel_error(o, o64) < 4e-3
    assert rel_error(state, state64) < 1e-4


def test_delta_rule_reference_gqa_groups(rng):
    """r = nv / nk = 3: value head j reads key head j // 3 (consecutive groups, not j % nk)."""
    p = Problem(rng, [5, 9], [0, 4], [1, 0], nk=2, nv=6, dk=8, dv=8)
    state = p.ssm_state.copy()
    o = gated_delta_rule_reference(p.u, p.proj, p.A_log, p.dt_bias, state, p.cu, p.kv, p.slots, ba_col=p.ba_col,
                                   **p.heads())
    o64, state64 = delta_rule64(p)
    assert rel_error(o, o64) < 4e-3
    assert rel_error(state, state64) < 1e-4


def test_gated_norm_reference_vs_float64(rng):
    """Three bf16 roundings (normalised value, times weight, output): within 1e-2 of the unrounded float64."""
    p = Problem(rng, [9], [0], [0], nv=4, dv=32)
    o = random_array(rng, (9, p.nv * p.dv), bfloat16, mean=0.1)
    y = gated_rmsnorm_silu_reference(o, p.proj, p.norm_weight, EPS, z_col=p.z_col, num_v_heads=p.nv, head_v_dim=p.dv)
    assert rel_error(y, gated_norm64(o, p.proj[:, p.z_col:p.z_col + p.nv * p.dv], p.norm_weight)) < 1e-2


# ---- the CPU ops ----------------------------------------------------------------------------------------------------
def test_cpu_ops_run_the_references(rng):
    p = Problem(rng, *BATCHES["mixed"])
    cs, ss = cpu(p.conv_state.copy()), cpu(p.ssm_state.copy())
    u = causal_conv1d_silu(cpu(p.proj), cpu(p.weight), cs, *p.meta(cpu), conv_dim=p.conv_dim, max_q_len=p.max_q_len)
    ref_state = p.conv_state.copy()
    ref_u = causal_conv1d_silu_reference(p.proj, p.weight, ref_state, p.cu, p.kv, p.slots, conv_dim=p.conv_dim)
    np.testing.assert_array_equal(u.array, ref_u.astype(bfloat16))
    np.testing.assert_array_equal(cs.array, ref_state)
    o = gated_delta_rule(u, cpu(p.proj), cpu(p.A_log), cpu(p.dt_bias), ss, *p.meta(cpu), ba_col=p.ba_col,
                         max_q_len=p.max_q_len, **p.heads())
    ref_ss = p.ssm_state.copy()
    ref_o = gated_delta_rule_reference(u.array, p.proj, p.A_log, p.dt_bias, ref_ss, p.cu, p.kv, p.slots,
                                       ba_col=p.ba_col, **p.heads())
    np.testing.assert_array_equal(o.array, ref_o.astype(bfloat16))
    np.testing.assert_array_equal(ss.array, ref_ss)
    y = gated_rmsnorm_silu(o, cpu(p.proj), cpu(p.norm_weight), EPS, z_col=p.z_col, num_v_heads=p.nv,
                           head_v_dim=p.dv, out=o)
    assert y is o  # in place


def test_cpu_state_carried_across_steps(rng):
    """A 150-token prompt prefilled in pieces (40, 1, 109 tokens, the state carried in its slot) gives the outputs
    and final state of one 150-token prefill. Planted bug: a continuing step that zeroes its state, or reads the
    wrong slot."""
    whole = Problem(rng, [150], [0], [3])
    cs, ss = whole.conv_state.copy(), whole.ssm_state.copy()
    u_all = causal_conv1d_silu_reference(whole.proj, whole.weight, cs, whole.cu, whole.kv, whole.slots,
                                         conv_dim=whole.conv_dim)
    o_all = gated_delta_rule_reference(u_all, whole.proj, whole.A_log, whole.dt_bias, ss, whole.cu, whole.kv,
                                       whole.slots, ba_col=whole.ba_col, **whole.heads())
    cs2, ss2 = whole.conv_state.copy(), whole.ssm_state.copy()
    outs = []
    done = 0
    for n in (40, 1, 109):
        cu = np.array([0, n], np.int32)
        kv = np.array([done + n], np.int32)
        rows = whole.proj[done:done + n]
        u = causal_conv1d_silu_reference(rows, whole.weight, cs2, cu, kv, whole.slots, conv_dim=whole.conv_dim)
        outs.append(gated_delta_rule_reference(u, rows, whole.A_log, whole.dt_bias, ss2, cu, kv, whole.slots,
                                               ba_col=whole.ba_col, **whole.heads()))
        done += n
    np.testing.assert_array_equal(cs2, cs)
    assert rel_error(np.concatenate(outs), o_all) < 1e-6
    assert rel_error(ss2, ss) < 1e-6


def test_bad_arguments_raise_value_error(rng):
    p = Problem(rng, [3, 2], [0, 4], [1, 0])
    cu, kv, sl = p.meta(cpu)
    conv = lambda **kw: causal_conv1d_silu(  # noqa: E731
        kw.get("proj", cpu(p.proj)), kw.get("weight", cpu(p.weight)), kw.get("conv_state", cpu(p.conv_state)),
        kw.get("cu", cu), kw.get("kv", kv), kw.get("slots", sl), conv_dim=kw.get("conv_dim", p.conv_dim),
        max_q_len=kw.get("max_q_len", 3), out=kw.get("out"))
    conv()
    cases = [("proj", dict(proj=cpu(p.proj.astype(np.float32)))),
             ("proj", dict(conv_dim=p.proj.shape[1] + 1)),
             ("weight", dict(weight=cpu(p.weight[:, :1]))),
             ("conv_state", dict(conv_state=cpu(p.conv_state[:, :2]))),
             ("cu_seqlens", dict(cu=cpu(np.array([0, 3, 4], np.int32)))),
             ("cu_seqlens", dict(cu=cpu(np.array([0, 3, 5], np.int64)))),
             ("kv_lens", dict(kv=cpu(np.array([3, 1], np.int32)))),
             ("state_slots", dict(slots=cpu(np.array([1, 99], np.int32)))),
             ("max_q_len", dict(max_q_len=2)),
             ("max_q_len", dict(max_q_len=True)),
             ("out", dict(out=Tensor.empty((5, p.conv_dim), float32, "cpu")))]
    for match, kw in cases:
        with pytest.raises(ValueError, match=match):
            conv(**kw)
    rule = lambda **kw: gated_delta_rule(  # noqa: E731
        kw.get("u", cpu(p.u)), cpu(p.proj), kw.get("A_log", cpu(p.A_log)), cpu(p.dt_bias),
        kw.get("ssm_state", cpu(p.ssm_state)), cu, kv, sl, ba_col=kw.get("ba_col", p.ba_col), max_q_len=3,
        **dict(p.heads(), **kw.get("heads", {})))
    rule()
    for match, kw in [("u", dict(u=cpu(p.u[:, 1:]))), ("A_log", dict(A_log=cpu(p.A_log[:2]))),
                      ("ssm_state", dict(ssm_state=cpu(p.ssm_state[:, :, :8]))),
                      ("proj", dict(ba_col=p.ba_col + 1)), ("ba_col", dict(ba_col=-1)),
                      ("num_v_heads", dict(heads=dict(num_v_heads=5, num_k_heads=2))),
                      ("head_k_dim", dict(heads=dict(head_k_dim=0)))]:
        with pytest.raises(ValueError, match=match):
            rule(**kw)
    o = cpu(random_array(rng, (5, p.nv * p.dv), bfloat16))
    for match, kw in [("eps", dict(eps=-1.0)), ("z_col", dict(z_col=-2)), ("proj", dict(z_col=p.ba_col)),
                      ("norm_weight", dict(w=cpu(p.norm_weight[:4])))]:
        with pytest.raises(ValueError, match=match):
            gated_rmsnorm_silu(o, cpu(p.proj), kw.get("w", cpu(p.norm_weight)), kw.get("eps", EPS),
                               z_col=kw.get("z_col", p.z_col), num_v_heads=p.nv, head_v_dim=p.dv)


# ---- CUDA ------------------------------------------------------------------------------------------------------------
# The recurrent kernel keeps the reference's fp32 arithmetic (another summation order): o differs by bf16 rounding
# flips only, the state by fp32 rounding over up to 200 tokens.
RECURRENT_O_TOL, RECURRENT_S_TOL = 4e-3, 1e-4
# The chunked kernel feeds bf16 operands (q, k, T, R, V', a copy of S) to the tensor cores with fp32 accumulation:
# test_chunked_form_with_bf16_operands measures that error in float64 (about 3e-3 on o); these bounds are 3x it.
CHUNKED_O_TOL, CHUNKED_S_TOL = 1.5e-2, 1.5e-2

GPU_BATCHES = {
    "decode": ([1] * 9, [7, 1, 30, 2, 5, 0, 3, 12, 1], [4, 0, 6, 2, 9, 11, 7, 3, 10]),
    "short_mixed": ([1, 16, 3, 9, 2], [5, 0, 2, 0, 1], [3, 8, 1, 5, 0]),
    "prefill_mixed": ([1, 64, 100, 130, 2, 65], [3, 0, 7, 0, 9, 40], [3, 8, 1, 5, 0, 6]),
    "one_long": ([300], [11], [1]),
}


def _gpu_problem(rng, name, nk=2, nv=6):
    return Problem(rng, *GPU_BATCHES[name], nk=nk, nv=nv, dk=128, dv=128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BATCHES)
def test_cuda_conv(rng, name):
    """u within bf16 rounding flips (fp32 sums in another order); windows bit-exact; other slots untouched."""
    p = _gpu_problem(rng, name)
    cs = dev(p.conv_state)
    out = poisoned((p.proj.shape[0], p.conv_dim), bfloat16)
    causal_conv1d_silu(dev(p.proj), dev(p.weight), cs, *p.meta(dev), conv_dim=p.conv_dim, max_q_len=p.max_q_len,
                       out=out)
    ref_state = p.conv_state.copy()
    ref = causal_conv1d_silu_reference(p.proj, p.weight, ref_state, p.cu, p.kv, p.slots, conv_dim=p.conv_dim)
    assert rel_error(out.numpy(), ref) < 3e-3
    np.testing.assert_array_equal(cs.numpy().view(np.uint16), ref_state.view(np.uint16))


def _run_rule_cuda(p: Problem, u, state, chunked: bool | None = None):
    out = poisoned((u.shape[0], p.nv * p.dv), bfloat16)
    st = dev(state)
    # max_q_len picks the kernel: 1 forces the recurrent one (it walks any length), the longest length the default
    max_q_len = {None: p.max_q_len, False: 1, True: max(p.max_q_len, gdn.RECURRENT_MAX_Q_LEN + 1)}[chunked]
    gated_delta_rule(dev(u), dev(p.proj), dev(p.A_log), dev(p.dt_bias), st, *p.meta(dev), ba_col=p.ba_col,
                     max_q_len=min(max_q_len, u.shape[0]), out=out, **p.heads())
    return out.numpy(), st.numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BATCHES)
@pytest.mark.parametrize("heads", [(2, 6), (4, 4)])
def test_cuda_delta_rule(rng, name, heads):
    p = _gpu_problem(rng, name, *heads)
    o, state = _run_rule_cuda(p, p.u, p.ssm_state)
    ref_state = p.ssm_state.copy()
    ref = gated_delta_rule_reference(p.u, p.proj, p.A_log, p.dt_bias, ref_state, p.cu, p.kv, p.slots,
                                     ba_col=p.ba_col, **p.heads())
    chunked = p.max_q_len > gdn.RECURRENT_MAX_Q_LEN
    o_tol, s_tol = (CHUNKED_O_TOL, CHUNKED_S_TOL) if chunked else (RECURRENT_O_TOL, RECURRENT_S_TOL)
    assert rel_error(o, ref) < o_tol
    assert rel_error(state, ref_state) < s_tol


@pytest.mark.gpu
@pytest.mark.parametrize("n", [17, 63, 64, 65, 128, 200, 333])
@pytest.mark.parametrize("fresh", [True, False])
def test_cuda_chunked_vs_recurrent(rng, n, fresh):
    """The two kernels agree on every length (a multiple of 64 or not), from zeros or a stored state."""
    p = Problem(rng, [n], [0 if fresh else 5], [2], nk=2, nv=4, dk=128, dv=128)
    o_c, s_c = _run_rule_cuda(p, p.u, p.ssm_state, chunked=True)
    o_r, s_r = _run_rule_cuda(p, p.u, p.ssm_state, chunked=False)
    assert rel_error(o_c, o_r) < CHUNKED_O_TOL
    assert rel_error(s_c, s_r) < CHUNKED_S_TOL


@pytest.mark.gpu
def test_cuda_state_carried_across_prefill_steps(rng):
    """A 333-token prompt prefilled in steps of 100, 37 (chunked), 1 (recurrent), 195 (chunked), the state carried
    in its slot, equals one 333-token prefill."""
    whole = Problem(rng, [333], [0], [5], nk=2, nv=4, dk=128, dv=128)
    o_all, s_all = _run_rule_cuda(whole, whole.u, whole.ssm_state)
    state = whole.ssm_state
    outs, done = [], 0
    for n in (100, 37, 1, 195):
        part = Problem(rng, [n], [done], [5], nk=2, nv=4, dk=128, dv=128)
        part.proj, part.A_log, part.dt_bias = whole.proj[done:done + n], whole.A_log, whole.dt_bias
        o, state = _run_rule_cuda(part, whole.u[done:done + n], state)
        outs.append(o)
        done += n
    assert rel_error(np.concatenate(outs), o_all) < CHUNKED_O_TOL
    assert rel_error(state, s_all) < CHUNKED_S_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_cuda_gated_norm(rng, rows):
    p = Problem(rng, [rows], [0], [0], nv=6, dv=128)
    o = random_array(rng, (rows, p.nv * p.dv), bfloat16, mean=0.1)
    ref = gated_rmsnorm_silu_reference(o, p.proj, p.norm_weight, EPS, z_col=p.z_col, num_v_heads=p.nv,
                                       head_v_dim=p.dv)
    out = poisoned(o.shape, bfloat16)
    gated_rmsnorm_silu(dev(o), dev(p.proj), dev(p.norm_weight), EPS, z_col=p.z_col, num_v_heads=p.nv,
                       head_v_dim=p.dv, out=out)
    assert rel_error(out.numpy(), ref) < 3e-3  # bf16 rounding flips only (rsqrt vs division, exp forms)
    od = dev(o)
    gated_rmsnorm_silu(od, dev(p.proj), dev(p.norm_weight), EPS, z_col=p.z_col, num_v_heads=p.nv, head_v_dim=p.dv,
                       out=od)
    assert rel_error(od.numpy(), ref) < 3e-3


@pytest.mark.gpu
def test_cuda_graph_padding_rows_do_not_fault(rng):
    """A graph-replayed decode batch pads with rows that share one scratch slot: outputs of the real rows are still
    right (the scratch slot's contents are whatever the padding rows leave)."""
    p = Problem(rng, [1, 1, 1, 1], [4, 2, 1, 1], [0, 3, 7, 7], nk=2, nv=4, dk=128, dv=128, num_slots=8)
    o, state = _run_rule_cuda(p, p.u, p.ssm_state)
    ref_state = p.ssm_state.copy()
    ref = gated_delta_rule_reference(p.u[:2], p.proj[:2], p.A_log, p.dt_bias, ref_state, p.cu[:3], p.kv[:2],
                                     p.slots[:2], ba_col=p.ba_col, **p.heads())
    assert rel_error(o[:2], ref) < RECURRENT_O_TOL
    assert rel_error(state[[0, 3]], ref_state[[0, 3]]) < RECURRENT_S_TOL
