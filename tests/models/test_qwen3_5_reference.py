"""The float64 Qwen3.5 / Qwen3-Next reference (tests/qwen3_5_reference.py) checked against itself and against small
cases derived by hand from ../shared/qwen3.5/ARCHITECTURE.md: the recurrent and chunked GDN forms agree, the
checkpoint layouts give the same logits, a sequence split into pieces with carried state equals one pass, and the
formulas most often got wrong (partial RoPE, the per-head query/gate interleave, zero-centred vs plain norm weights,
L2 eps, value-head sharing, softplus, top-k renormalisation) give the hand-derived numbers.

Tolerances: everything runs in float64. The recurrent and chunked forms are the same algebra summed in another order
(and through a triangular solve), so they agree to ~1e-13 relative on these sizes; 1e-10 leaves three orders of
margin and is still ~1e7 times below any semantic error (a wrong decay order, a missed state term) on O(1) values.
The layouts are the same numbers in other places, so the same arithmetic: 1e-12 only allows BLAS summation order.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import qwen3_5_reference as ref
from qwen3_5_reference import (FULL_ATTENTION, LINEAR_ATTENTION, TINY_MOE_FIELDS, TINY_TEXT_CONFIG, HybridReference,
                               TextConfig, apply_partial_rope, bf16_round, causal_conv_silu, gated_rms_norm,
                               gdn_chunked, gdn_gates, gdn_recurrent, l2_normalize, layer_schedule, write_random_folder,
                               zero_centred_rms_norm)

SAME_ALGEBRA = 1e-10   # recurrent vs chunked, pieces vs one pass (module docstring)
SAME_NUMBERS = 1e-12   # one set of weights in different layouts


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One random dense model in the three dense layouts (Qwen3-Next with num_experts 0 is dense), plus junk
    mtp/visual tensors in the multimodal one; one MoE model as Qwen3-Next (fused and per-expert) and Qwen3.5-MoE."""
    base = tmp_path_factory.mktemp("qwen3_5_ref")
    dense = dict(TINY_TEXT_CONFIG, num_experts=0)
    moe = dict(TINY_TEXT_CONFIG, **TINY_MOE_FIELDS)
    return {
        "qwen3_5": write_random_folder(base / "qwen3_5", dense, "qwen3_5", seed=11, extras=True),
        "qwen3_5_text": write_random_folder(base / "qwen3_5_text", dense, "qwen3_5_text", seed=11),
        "qwen3_next": write_random_folder(base / "qwen3_next", dense, "qwen3_next", seed=11, extras=True),
        "next_moe_fused": write_random_folder(base / "nf", moe, "qwen3_next", seed=12, experts="fused"),
        "next_moe_split": write_random_folder(base / "ns", moe, "qwen3_next", seed=12, experts="per_expert"),
        "qwen3_5_moe": write_random_folder(base / "q35moe", moe, "qwen3_5_moe", seed=12),
    }


@pytest.fixture(scope="module")
def dense_ref(folders):
    return HybridReference(folders["qwen3_5"])


def _gdn_inputs(rng, t, nk=2, nv=4, dk=16, dv=8):
    """q, k L2-normalised (q scaled), a spread of decays: some heads nearly hold (g ~ -0.01), some forget fast."""
    q = l2_normalize(rng.normal(size=(t, nk, dk))) * dk ** -0.5
    k = l2_normalize(rng.normal(size=(t, nk, dk)))
    v = rng.normal(size=(t, nv, dv))
    g = -rng.uniform(0.0, 1.0, (t, nv)) * np.array([0.02, 0.2, 1.0, 3.0])[:nv]
    beta = rng.uniform(0.05, 0.95, (t, nv))
    return q, k, v, g, beta


@pytest.mark.parametrize("from_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_recurrent_and_chunked_gdn_agree(length, from_state, rng):
    """Planted bugs: decay applied after the update, output read before it, a chunk boundary off by one, the
    incoming state left out of the chunk's output or carried without its decay."""
    q, k, v, g, beta = _gdn_inputs(rng, length)
    s0 = rng.normal(size=(4, 16, 8)) if from_state else None
    o_rec, s_rec = gdn_recurrent(q, k, v, g, beta, s0)
    o_chk, s_chk = gdn_chunked(q, k, v, g, beta, s0)
    assert o_rec.shape == (length, 4, 8) and s_rec.shape == (4, 16, 8)
    assert rel(o_chk, o_rec) < SAME_ALGEBRA
    assert rel(s_chk, s_rec) < SAME_ALGEBRA


def test_gdn_one_step_by_hand():
    """ARCHITECTURE 3.2 step 8 on one head, dk = dv = 2: S0 [[1, 2], [3, 4]], g = ln 0.5, beta 0.5, k (1, 0),
    v (2, 3), q (0.6, 0.8). Decay: [[0.5, 1], [1.5, 2]]; prediction S^T k = (0.5, 1); delta = 0.5 (v - m) =
    (0.75, 1); S += k delta^T: [[1.25, 2], [1.5, 2]]; o = S^T q = (1.95, 2.8), read after the update."""
    args = (np.array([[[0.6, 0.8]]]), np.array([[[1.0, 0.0]]]), np.array([[[2.0, 3.0]]]),
            np.array([[math.log(0.5)]]), np.array([[0.5]]))
    s0 = np.array([[[1.0, 2.0], [3.0, 4.0]]])
    for form in (gdn_recurrent, gdn_chunked):
        o, s = form(*args, s0)
        np.testing.assert_allclose(o[0, 0], [1.95, 2.8], rtol=1e-12)
        np.testing.assert_allclose(s[0], [[1.25, 2.0], [1.5, 2.0]], rtol=1e-12)


def test_value_heads_share_consecutive_key_heads(rng):
    """nk 2 serving nv 4: value heads 0, 1 read key head 0 and heads 2, 3 key head 1 (repeat_interleave), not
    j % nk. Planted bug: np.tile in place of np.repeat."""
    q, k, v, g, beta = _gdn_inputs(rng, 9)
    o, s = gdn_recurrent(q, k, v, g, beta)
    for j in range(4):
        oj, sj = gdn_recurrent(q[:, j // 2:j // 2 + 1], k[:, j // 2:j // 2 + 1], v[:, j:j + 1], g[:, j:j + 1],
                               beta[:, j:j + 1])
        np.testing.assert_allclose(o[:, j], oj[:, 0], rtol=1e-13)
        np.testing.assert_allclose(s[j], sj[0], rtol=1e-13)


def test_causal_conv_taps_and_window():
    """Tap K-1 multiplies the current token, tap 0 the token K-1 = 3 steps back (from the window before the
    sequence); the new window is the last 3 inputs, oldest first, even when fewer than 3 tokens came."""
    x = np.array([[1.0], [2.0]])                       # two tokens, one channel
    window = np.array([[-3.0, -2.0, -1.0]])            # tokens -3, -2, -1
    silu = lambda y: y / (1 + np.exp(-y))  # noqa: E731
    current, _ = causal_conv_silu(x, np.array([[0.0, 0.0, 0.0, 1.0]]), window)
    np.testing.assert_allclose(current[:, 0], silu(np.array([1.0, 2.0])), rtol=1e-15)
    oldest, new_window = causal_conv_silu(x, np.array([[1.0, 0.0, 0.0, 0.0]]), window)
    np.testing.assert_allclose(oldest[:, 0], silu(np.array([-3.0, -2.0])), rtol=1e-15)
    np.testing.assert_array_equal(new_window, [[-1.0, 1.0, 2.0]])


def test_zero_centred_norm_is_gain_one_at_zero_weight():
    """(1 + w) weight: w = 0 gives x / rms(x); x = (3, 4) has rms sqrt(12.5). w = (1, -1) doubles the first
    entry and zeroes the second."""
    x = np.array([3.0, 4.0])
    unit = x / math.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(zero_centred_rms_norm(x, np.zeros(2), 1e-6), unit, rtol=1e-15)
    np.testing.assert_allclose(zero_centred_rms_norm(x, np.array([1.0, -1.0]), 1e-6), [2 * unit[0], 0.0], rtol=1e-15)


def test_gated_norm_has_a_plain_weight_and_gates_after_the_norm():
    """Gated RMSNorm: weight used as is (0 gives 0, not gain 1), normalised first, then * silu(z): o = (3, 4),
    w = 1, z = (0, 30) gives (0, 4 / sqrt(12.5) * silu(30))."""
    o, eps = np.array([3.0, 4.0]), 1e-6
    assert np.all(gated_rms_norm(o, np.array([1.0, 1.0]), np.zeros(2), eps) == 0)
    y = gated_rms_norm(o, np.array([0.0, 30.0]), np.ones(2), eps)
    np.testing.assert_allclose(y, [0.0, 4 / math.sqrt(12.5 + eps) * 30 / (1 + math.exp(-30))], rtol=1e-15)


def test_l2_norm_adds_eps_to_the_sum():
    np.testing.assert_allclose(l2_normalize(np.array([3.0, 4.0])), np.array([3.0, 4.0]) / math.sqrt(25 + 1e-6),
                               rtol=1e-15)


def test_gates_by_hand():
    """g = -exp(A_log) * softplus(a + dt_bias): A = 2, a + dt = 0 gives -2 ln 2; above 20 softplus is the
    identity (a + dt = 30: -60). beta = sigmoid(b)."""
    g, beta = gdn_gates(np.array([0.5, 30.0]), np.array([0.0, 2.0]), np.log(np.array([2.0, 2.0])),
                        np.array([-0.5, 0.0]))
    np.testing.assert_allclose(g, [-2 * math.log(2), -60.0], rtol=1e-15)
    np.testing.assert_allclose(beta, [0.5, 1 / (1 + math.exp(-2))], rtol=1e-15)


def test_partial_rope_by_hand():
    """hd 8, rotary 4, theta 100: pairs (0, 2) at angle p and (1, 3) at p * 100^(-1/2) = p / 10, rotate-half style;
    dims 4..7 untouched; position 0 is the identity."""
    x = np.arange(1.0, 9.0)[None, None, :]
    p = 3.0
    y = apply_partial_rope(x, [p], 4, 100.0)[0, 0]
    c0, s0, c1, s1 = math.cos(p), math.sin(p), math.cos(p / 10), math.sin(p / 10)
    expect = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1, 5, 6, 7, 8]
    np.testing.assert_allclose(y, expect, rtol=1e-14)
    np.testing.assert_array_equal(apply_partial_rope(x, [0.0], 4, 100.0), x)


def test_attention_gate_is_the_second_half_of_each_head(dense_ref, rng):
    """One token from an empty cache: softmax over one key is 1, so head h's output is v of kv head h // 2 times
    sigmoid(gate_h), gate_h from q_proj rows [2 hd h + hd, 2 hd (h + 1)) (per-head interleave, ARCHITECTURE 4.1),
    v not normed; then o_proj. Planted bugs: gates from the second half of all rows, v through k_norm."""
    c = dense_ref.cfg
    layer = dense_ref.layers[c.layer_types.index(FULL_ATTENTION)]
    x = rng.normal(size=(1, c.hidden))
    state = {"k": np.zeros((0, c.nkv, c.hd)), "v": np.zeros((0, c.nkv, c.hd))}
    out, new = dense_ref.attention(x, layer, state, positions=[0])
    v = (x @ layer["v"].T).reshape(c.nkv, c.hd)
    heads = []
    for h in range(c.nh):
        gate = x[0] @ layer["q"][2 * c.hd * h + c.hd:2 * c.hd * (h + 1)].T
        heads.append(v[h // (c.nh // c.nkv)] / (1 + np.exp(-gate)))
    np.testing.assert_allclose(out[0], np.concatenate(heads) @ layer["o"].T, rtol=1e-12)
    assert new["k"].shape == (1, c.nkv, c.hd)


def test_moe_weights_by_hand(tmp_path):
    """Router logits (ln 4, ln 3, ln 2, ln 1): softmax over all four (0.4, 0.3, 0.2, 0.1), top-2 = experts 0, 1;
    renormalised 4/7, 3/7 (Qwen3-Next norm_topk_prob true, Qwen3.5-MoE always), raw 0.4, 0.3 (false); plus
    sigmoid(x . w_sg) times the shared expert. Planted bugs: softmax after top-k, no renormalisation."""
    cfg = {**TINY_TEXT_CONFIG, **TINY_MOE_FIELDS, "num_experts": 4}
    for norm in (True, False):
        folder = write_random_folder(tmp_path / f"n{norm}", dict(cfg, norm_topk_prob=norm), "qwen3_next", seed=3)
        model = HybridReference(folder)
        w = model.layers[0]["moe"]
        x = np.zeros((1, model.cfg.hidden))
        x[0, 0] = 1.0
        w["router"] = np.zeros_like(w["router"])
        w["router"][:, 0] = np.log([4.0, 3.0, 2.0, 1.0])
        outs = [model.mlp(x, *e)[0] for e in w["experts"]]
        shared = model.mlp(x, *w["shared"])[0] / (1 + np.exp(-(x[0] @ w["shared_gate"][0])))
        weights = (4 / 7, 3 / 7) if norm else (0.4, 0.3)
        np.testing.assert_allclose(model.moe(x, w)[0], weights[0] * outs[0] + weights[1] * outs[1] + shared,
                                   rtol=1e-12)


def test_qwen3_next_sparse_layers_follow_step_and_mlp_only_layers():
    """Qwen3-Next: MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers; none without
    experts; Qwen3.5-MoE: every layer; dense Qwen3.5: none."""
    text = {**TINY_TEXT_CONFIG, **TINY_MOE_FIELDS, "num_hidden_layers": 6, "decoder_sparse_step": 2,
            "mlp_only_layers": [3]}
    nxt = {**text, "architectures": ["Qwen3NextForCausalLM"]}
    assert TextConfig(nxt).moe_layers == {1, 5}
    assert TextConfig({**nxt, "num_experts": 0}).moe_layers == set()
    assert TextConfig({"architectures": ["Qwen3_5MoeForCausalLM"], **text}).moe_layers == set(range(6))
    assert TextConfig({"architectures": ["Qwen3_5ForCausalLM"], **text}).moe_layers == set()


def test_layer_schedule():
    """layer_types wins; without it layer i is full attention iff (i + 1) % full_attention_interval == 0
    (default 4)."""
    L, F = LINEAR_ATTENTION, FULL_ATTENTION
    assert layer_schedule({"num_hidden_layers": 8}) == [L, L, L, F, L, L, L, F]
    assert layer_schedule({"num_hidden_layers": 5, "full_attention_interval": 2}) == [L, F, L, F, L]
    assert layer_schedule({"num_hidden_layers": 3, "full_attention_interval": 2, "layer_types": [F, L, L]}) == [F, L, L]
    with pytest.raises(ValueError, match="entries"):
        layer_schedule({"num_hidden_layers": 3, "layer_types": [L, F]})
    with pytest.raises(ValueError, match="unknown"):
        layer_schedule({"num_hidden_layers": 2, "layer_types": [L, "sliding_attention"]})
    with pytest.raises(ValueError, match="positive"):
        layer_schedule({"num_hidden_layers": 2, "full_attention_interval": 0})


def test_explicit_layer_types_equal_the_interval_they_spell(tmp_path, rng):
    """The same folder read with full_attention_interval 2 and with the layer_types list it spells gives the same
    logits; read with interval 4 it wants a GDN layer 1 that the folder does not hold, so the schedule is read."""
    L, F = LINEAR_ATTENTION, FULL_ATTENTION
    ids = rng.integers(0, 256, 20)
    folder = write_random_folder(tmp_path / "a", dict(TINY_TEXT_CONFIG, full_attention_interval=2), "qwen3_5_text",
                                 seed=4)
    by_interval = HybridReference(folder).forward(ids)[0]
    _with_config(folder, lambda c: c.update(layer_types=[L, F, L, F]))
    np.testing.assert_array_equal(HybridReference(folder).forward(ids)[0], by_interval)
    _with_config(folder, lambda c: (c.pop("layer_types"), c.update(full_attention_interval=4)))
    with pytest.raises(ValueError, match="layers.1.linear_attn"):
        HybridReference(folder)


def _with_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_dense_layouts_give_identical_logits(folders, rng):
    """Qwen3_5ForConditionalGeneration (with junk mtp.* / model.visual.* tensors), Qwen3_5ForCausalLM and
    Qwen3NextForCausalLM (grouped in_proj_qkvz / in_proj_ba) from the same weights."""
    ids = rng.integers(0, 256, 40)
    logits = {k: HybridReference(folders[k]).forward(ids)[0] for k in ("qwen3_5", "qwen3_5_text", "qwen3_next")}
    assert rel(logits["qwen3_5_text"], logits["qwen3_5"]) < SAME_NUMBERS
    assert rel(logits["qwen3_next"], logits["qwen3_5"]) < SAME_NUMBERS


def test_moe_layouts_give_identical_logits(folders, rng):
    """Qwen3-Next with fused 3-D experts, with per-expert tensors, and Qwen3.5-MoE (fused, every layer sparse)."""
    ids = rng.integers(0, 256, 24)
    base = HybridReference(folders["next_moe_fused"]).forward(ids)[0]
    for key in ("next_moe_split", "qwen3_5_moe"):
        assert rel(HybridReference(folders[key]).forward(ids)[0], base) < SAME_NUMBERS, key


def test_qwen3_next_ungrouping_follows_the_spec(folders):
    """ARCHITECTURE 3.1: in_proj_qkvz is nk groups [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)], in_proj_ba nk
    groups [b_g (r) | a_g (r)]; value head g r + j comes from group g. Rebuilt here row by row from the raw tensors
    and compared with what the reference un-grouped, and with the split Qwen3.5 tensors of the same weights."""
    nxt, q35 = HybridReference(folders["qwen3_next"]), HybridReference(folders["qwen3_5"])
    c = nxt.cfg
    i = c.layer_types.index(LINEAR_ATTENTION)
    raw = ref.SafetensorsFolder(folders["qwen3_next"])
    qkvz = raw.get(f"model.layers.{i}.linear_attn.in_proj_qkvz.weight")
    ba = raw.get(f"model.layers.{i}.linear_attn.in_proj_ba.weight")
    r, width = c.nv // c.nk, 2 * c.dk + 2 * (c.nv // c.nk) * c.dv
    q = [qkvz[g * width + d] for g in range(c.nk) for d in range(c.dk)]
    k = [qkvz[g * width + c.dk + d] for g in range(c.nk) for d in range(c.dk)]
    v = [qkvz[(h // r) * width + 2 * c.dk + (h % r) * c.dv + d] for h in range(c.nv) for d in range(c.dv)]
    z = [qkvz[(h // r) * width + 2 * c.dk + r * c.dv + (h % r) * c.dv + d] for h in range(c.nv) for d in range(c.dv)]
    b = [ba[(h // r) * 2 * r + h % r] for h in range(c.nv)]
    a = [ba[(h // r) * 2 * r + r + h % r] for h in range(c.nv)]
    got = nxt.layers[i]
    np.testing.assert_array_equal(got["qkv"], np.array(q + k + v))
    for name, rows in (("z", z), ("b", b), ("a", a)):
        np.testing.assert_array_equal(got[name], np.array(rows))
        np.testing.assert_array_equal(got[name], q35.layers[i][name])
    np.testing.assert_array_equal(got["qkv"], q35.layers[i]["qkv"])


def test_head_is_tied_by_the_outer_config(folders, tmp_path, rng):
    """The multimodal layout ties lm_head to embed_tokens by the OUTER tie_word_embeddings, whatever text_config
    says; a tied folder needs no lm_head.weight."""
    ids = rng.integers(0, 256, 6)
    untied = HybridReference(folders["qwen3_5"])
    outer_tied = write_random_folder(tmp_path / "t", dict(TINY_TEXT_CONFIG, num_experts=0), "qwen3_5", seed=11)
    _with_config(outer_tied, lambda c: (c.update(tie_word_embeddings=True),
                                        c["text_config"].update(tie_word_embeddings=False)))
    tied = HybridReference(outer_tied)
    assert tied.head is tied.embed
    assert rel(tied.forward(ids)[0], untied.forward(ids)[0]) > 0.1
    inner_only = HybridReference(_with_config(tmp_path / "t", lambda c: (
        c.update(tie_word_embeddings=False), c["text_config"].update(tie_word_embeddings=True))))
    np.testing.assert_array_equal(inner_only.head, untied.head)  # same seed and config as folders["qwen3_5"]
    np.testing.assert_array_equal(inner_only.forward(ids)[0], untied.forward(ids)[0])
    bare = write_random_folder(tmp_path / "bare", dict(TINY_TEXT_CONFIG, num_experts=0, tie_word_embeddings=True),
                               "qwen3_5", seed=11)
    assert "lm_head.weight" not in ref.SafetensorsFolder(bare)
    np.testing.assert_array_equal(HybridReference(bare).forward(ids)[0], tied.forward(ids)[0])


@pytest.mark.parametrize("pieces", [[1] * 6 + [94], [63, 1, 1, 35], [37, 63]], ids=["decode-then-prefill",
                                                                                    "prefill-then-decode", "two"])
def test_pieces_with_carried_state_equal_one_pass(dense_ref, pieces, rng):
    """Conv window, SSM state and KV cache carried between calls (and RoPE positions continuing from the cache);
    the states passed in are not modified."""
    ids = rng.integers(0, 256, sum(pieces))
    whole, final = dense_ref.forward(ids)
    parts, states, at = [], None, 0
    for n in pieces:
        before = None if states is None else [{k: v.copy() for k, v in s.items()} for s in states]
        out, new = dense_ref.forward(ids[at:at + n], states)
        if states is not None:
            for s, b in zip(states, before):
                for key in s:
                    np.testing.assert_array_equal(s[key], b[key])
        parts.append(out)
        states, at = new, at + n
    assert rel(np.concatenate(parts), whole) < SAME_ALGEBRA
    for s, f in zip(states, final):
        for key in f:
            assert rel(s[key], f[key]) < SAME_ALGEBRA, key


def test_model_with_chunked_gdn_equals_recurrent(dense_ref, rng):
    """The whole model with the chunked GDN form (130 tokens: three chunks, the last partial), from a fresh and from
    a carried state."""
    ids = rng.integers(0, 256, 200)
    rec, states = dense_ref.forward(ids[:130])
    chk, chk_states = dense_ref.forward(ids[:130], gdn_form="chunked")
    assert rel(chk, rec) < SAME_ALGEBRA
    cont_rec, _ = dense_ref.forward(ids[130:], states)
    cont_chk, _ = dense_ref.forward(ids[130:], chk_states, gdn_form="chunked")
    assert rel(cont_chk, cont_rec) < SAME_ALGEBRA


def test_states_have_the_documented_shapes(dense_ref, rng):
    c = dense_ref.cfg
    _, states = dense_ref.forward(rng.integers(0, 256, 5))
    for kind, s in zip(c.layer_types, states):
        if kind == LINEAR_ATTENTION:
            assert s["conv"].shape == (c.conv_dim, c.conv_k - 1) and s["ssm"].shape == (c.nv, c.dk, c.dv)
        else:
            assert s["k"].shape == s["v"].shape == (5, c.nkv, c.hd)


def test_bf16_round_is_round_to_nearest_even():
    """1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1); 1 + 3 * 2^-8 halfway between
    1 + 2^-7 and 1 + 2^-6 goes to 1 + 2^-6; just above a tie rounds up."""
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8), 3.0])
    np.testing.assert_array_equal(bf16_round(x), [1.0, 1 + 2 ** -6, 1 + 2 ** -7, -1.0, 3.0])


def test_bf16_points_round_but_stay_close(folders, rng):
    """bf16_points=True: weights are bf16 values, and the logits move off float64 by bf16 roundings (each relative
    2^-9 at most), on average as much as transformers' own bf16 run moves on such random folders (mean relative
    error per position 2.1e-2 to 4e-2, measured with transformers 5.17 on the CPU: tests/models/
    test_qwen3_5_parity_gpu.py), so between 1e-3 (it rounds) and 0.1 (no gross error). This cannot tell one
    misplaced rounding from another (rounding g or the SSM state too moves the mean here by under 10%): the GPU
    test holds the model to transformers' bf16 run for that."""
    ids = rng.integers(0, 256, 40)
    exact = HybridReference(folders["qwen3_5"]).forward(ids)[0]
    rounded_model = HybridReference(folders["qwen3_5"], bf16_points=True)
    w = rounded_model.layers[0]["qkv"]
    np.testing.assert_array_equal(w, bf16_round(w))
    err = np.linalg.norm(rounded_model.forward(ids)[0] - exact, axis=-1) / np.linalg.norm(exact, axis=-1)
    assert 1e-3 < err.mean() < 0.1, err.mean()


def test_bf16_tensors_are_read(tmp_path):
    """A BF16 tensor in a hand-made safetensors file: the top 16 bits of the float32 pattern."""
    values = np.array([1.0, -2.5, 3.140625], np.float32)  # exact in bf16
    payload = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, len(payload)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + payload)
    np.testing.assert_array_equal(ref.SafetensorsFolder(tmp_path).get("w"), values)


def test_bad_input_names_the_problem(folders, tmp_path):
    with pytest.raises(ValueError, match="architectures"):
        TextConfig({"architectures": ["LlamaForCausalLM"], **TINY_TEXT_CONFIG})
    with pytest.raises(ValueError, match="token ids"):
        HybridReference(folders["qwen3_5_text"]).forward([0, 256])
    with pytest.raises(ValueError, match="no tensor"):
        ref.SafetensorsFolder(folders["qwen3_5_text"]).get("model.layers.0.mlp.nothing.weight")
    with pytest.raises(ValueError, match="layout"):
        write_random_folder(tmp_path / "x", None, "llama")


def test_hidden_states_are_the_residual_stream(dense_ref, rng):
    """hidden receives each layer's output, then the final norm's, whose product with the head is the logits."""
    hidden = []
    logits, _ = dense_ref.forward(rng.integers(0, 256, 7), hidden=hidden)
    assert len(hidden) == dense_ref.cfg.n_layers + 1 and hidden[0].shape == (7, dense_ref.cfg.hidden)
    np.testing.assert_allclose(hidden[-1] @ dense_ref.head.T, logits, rtol=1e-12)


SHARED_CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "qwen3.5" / "configs"


@pytest.mark.skipif(not SHARED_CONFIGS.is_dir(), reason="no ../shared/qwen3.5/configs beside the checkout")
@pytest.mark.parametrize("name", sorted(p.name for p in SHARED_CONFIGS.glob("*.json")) if SHARED_CONFIGS.is_dir()
                         else [])
def test_reads_the_released_configs(name):
    """Every config of ../shared/qwen3.5/configs: full attention on layers 3, 7, 11, ... (listed or by interval),
    RoPE on 64 of 256 dims, each key head serving whole value heads, MoE on every layer of the MoE models and on
    none of the dense ones, the head tied by the outer flag."""
    outer = json.loads((SHARED_CONFIGS / name).read_text())
    c = TextConfig(outer)
    assert [i for i, t in enumerate(c.layer_types) if t == FULL_ATTENTION] == list(range(3, c.n_layers, 4))
    assert (c.hd, c.rotary_dim) == (256, 64)
    assert c.nv % c.nk == 0 and c.conv_dim == 2 * c.nk * c.dk + c.nv * c.dv
    moe = "num_experts" in outer.get("text_config", outer)
    assert c.moe_layers == (set(range(c.n_layers)) if moe else set())
    assert c.tie == outer.get("tie_word_embeddings", False)
