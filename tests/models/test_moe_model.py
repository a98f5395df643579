"""Qwen3-MoE (`Qwen3MoeForCausalLM`) on the NumPy backend: the config (parsing, round trip, every rejection, the
sparse-layer rule), the weight table and the stacked expert tensors it loads, the forward pass against an
independent float64 decoder written here (a per-token loop over the routed experts), and generation through LLM
(greedy, batched against alone up to the rounding a batch shape may move, its routing near ties pinned)."""
import json
import math

import numpy as np
import pytest

from batch_shape import NEAR_TIE, assert_follows_logits, assert_same_runs
from qwen3_reference import _once, rel_err_rows, tiny_model_dir  # noqa: F401
from xserv.engine.batch import SeqChunk, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.models.base import CausalLM
from xserv.models.checkpoint import CheckpointReader
from xserv.models.config import preset_dict
from xserv.models.qwen3 import Qwen3Config
from xserv.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
from xserv.models.random_checkpoint import make_test_model
from xserv.models.registry import config_from_dict, config_from_pretrained, load_model, model_class

BLOCK = 4


def tiny_config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.preset("moe-tiny", **overrides)


def shapes_of(config):
    return {w.name: w.shape for w in model_class(config).weight_table(config)}


# ---- the config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, layers, hidden, inter, total, active", [
    ("30b-a3b", 48, 2048, 768, 30.53e9, 3.35e9),
    ("235b-a22b", 94, 4096, 1536, 235.09e9, 22.19e9),
])
def test_real_configs(name, layers, hidden, inter, total, active):
    d = preset_dict(name)
    c = config_from_dict(d)
    assert type(c) is Qwen3MoeConfig and isinstance(c, Qwen3Config) and model_class(c) is Qwen3MoeModel
    assert preset_dict(f"qwen3-{name}") == d
    assert (c.num_hidden_layers, c.hidden_size, c.moe_intermediate_size) == (layers, hidden, inter)
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.intermediate_size) == (128, 8, True, 8 * inter)
    assert c.sparse_layers == tuple(range(layers)) and not c.has_dense_layers
    params = sum(math.prod(s) for s in shapes_of(c).values())
    expert = 3 * hidden * inter
    assert params == pytest.approx(total, rel=1e-3)
    assert params - layers * (128 - 8) * expert == pytest.approx(active, rel=1e-3)  # the "A3B" / "A22B"
    # round trip through the HF dict, and every field the shared config.json has comes back with its value
    assert Qwen3MoeConfig.from_dict(c.to_dict()) == c and config_from_dict(c.to_dict()) == c
    out = c.to_dict()
    assert {k: out[k] for k in d} == d


def test_round_trip_and_defaults():
    c = tiny_config(mlp_only_layers=[3, 1], decoder_sparse_step=1, norm_topk_prob=False)
    assert c.mlp_only_layers == (1, 3)
    d = c.to_dict()
    assert d["mlp_only_layers"] == [1, 3] and d["norm_topk_prob"] is False and d["num_experts"] == 16
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["model_type"] == "qwen3_moe"
    assert Qwen3MoeConfig.from_dict(d) == c
    # the registry finds it by model_type alone
    no_arch = {k: v for k, v in d.items() if k != "architectures"}
    assert config_from_dict(no_arch) == c
    # transformers' defaults for absent MoE fields; transformers >= 5's num_local_experts alias
    bare = {k: v for k, v in d.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    bare["num_local_experts"] = 64
    c2 = Qwen3MoeConfig.from_dict(bare)
    assert (c2.num_experts, c2.num_experts_per_tok, c2.moe_intermediate_size, c2.norm_topk_prob,
            c2.decoder_sparse_step, c2.mlp_only_layers) == (64, 8, 768, False, 1, ())
    # output_router_logits and the aux-loss coefficient are training options: ignored
    assert Qwen3MoeConfig.from_dict({**d, "output_router_logits": True, "router_aux_loss_coef": 0.5}) == c
    # a dense Qwen3 config is not read as MoE, nor the reverse
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        Qwen3Config.from_dict(d)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        Qwen3MoeConfig.from_dict(preset_dict("tiny"))


@pytest.mark.parametrize("field, value", [
    ("num_experts", 0), ("num_experts", 513), ("num_experts", 8.0),
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 17), ("num_experts_per_tok", True),
    ("moe_intermediate_size", 0), ("moe_intermediate_size", 60),
    ("decoder_sparse_step", 0), ("decoder_sparse_step", -2),
    ("mlp_only_layers", [4]), ("mlp_only_layers", [-1]), ("mlp_only_layers", "0"), ("mlp_only_layers", [0.0]),
    ("norm_topk_prob", "yes"),
    ("shared_expert_intermediate_size", 512), ("n_shared_experts", 1), ("num_shared_experts", 2),
    ("moe_router_bias", True), ("router_bias", True), ("expert_bias", True), ("e_score_correction_bias", True),
    ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("n_group", 8), ("topk_group", 4),
    ("routed_scaling_factor", 2.5), ("attention_bias", True),
])
def test_rejections_name_the_field(field, value):
    d = tiny_config().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=field):
        config_from_dict(d)


def test_top_k_limit_is_the_smaller_of_experts_and_32():
    assert tiny_config(num_experts=64, num_experts_per_tok=32).num_experts_per_tok == 32
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be an integer in 1\.\.32"):
        tiny_config(num_experts=64, num_experts_per_tok=33)
    with pytest.raises(ValueError, match=r"in 1\.\.4 "):
        tiny_config(num_experts=4, num_experts_per_tok=5)
    # the accepted spellings of the routing options
    assert tiny_config(scoring_func="softmax", topk_method="greedy", n_group=1, routed_scaling_factor=1.0,
                       shared_expert_intermediate_size=0) == tiny_config()


def test_sparse_layer_rule():
    """transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    c = tiny_config(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3, 4])
    assert c.sparse_layers == (1, 5, 7)
    assert [c.is_sparse_layer(i) for i in range(8)] == [False, True, False, False, False, True, False, True]
    assert tiny_config().sparse_layers == (0, 1, 2, 3)
    assert tiny_config(decoder_sparse_step=3, num_hidden_layers=7).sparse_layers == (2, 5)
    assert tiny_config(mlp_only_layers=[0, 1, 2, 3]).sparse_layers == ()
    shapes = shapes_of(c)
    assert "model.layers.1.mlp.gate.weight" in shapes and "model.layers.3.mlp.gate.weight" not in shapes
    assert "model.layers.3.mlp.gate_proj.weight" in shapes and "model.layers.1.mlp.gate_proj.weight" not in shapes


# ---- the weight table --------------------------------------------------------------------------------------------
def test_weight_table_sparse_and_dense_layers():
    c = tiny_config(mlp_only_layers=[1])
    e, h, inter, dense = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.intermediate_size
    assert (e, h, inter, dense) == (16, 128, 64, 192)  # the preset's: hidden != expert width != dense width
    table = Qwen3MoeModel.weight_table(c)
    by_name = {w.name: w for w in table}
    assert len(by_name) == len(table)
    sparse = [w for w in table if w.layer == 0]
    dense_layer = [w for w in table if w.layer == 1]
    assert len(sparse) == 6 + 1 + 3 * e + 2 and len(dense_layer) == 11
    p0, p1 = "model.layers.0.", "model.layers.1."
    router = by_name[p0 + "mlp.gate.weight"]
    assert (router.shape, router.field, router.rows) == ((e, h), "router", None)
    for x in (3, 15):
        gate, up, down = (by_name[f"{p0}mlp.experts.{x}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        assert (gate.shape, gate.field, gate.rows) == ((inter, h), "experts_gate_up", (x * 2 * inter, x * 2 * inter + inter))
        assert (up.shape, up.field, up.rows) == ((inter, h), "experts_gate_up", (x * 2 * inter + inter, (x + 1) * 2 * inter))
        assert (down.shape, down.field, down.rows) == ((h, inter), "experts_down", (x * h, (x + 1) * h))
    assert p0 + "mlp.gate_proj.weight" not in by_name and p0 + f"mlp.experts.{e}.up_proj.weight" not in by_name
    assert by_name[p0 + "self_attn.q_norm.weight"].is_norm and not router.is_norm
    assert by_name[p1 + "mlp.up_proj.weight"].shape == (dense, h) and by_name[p1 + "mlp.up_proj.weight"].rows == (dense, 2 * dense)
    assert by_name[p1 + "mlp.down_proj.weight"].shape == (h, dense)
    assert not any(".experts." in w.name or w.name.endswith("mlp.gate.weight") for w in dense_layer)
    assert {w.name.split(".", 3)[3] for w in dense_layer} == {w.name.split(".", 3)[3] for w in Qwen3MoeModel.weight_table(
        tiny_config(mlp_only_layers=[0, 1, 2, 3])) if w.layer == 0}  # a dense layer is Qwen3's
    # the stacked fields' row ranges tile them exactly once
    for field, size in (("experts_gate_up", e * 2 * inter), ("experts_down", e * h)):
        spans = sorted(w.rows for w in sparse if w.field == field)
        assert spans[0][0] == 0 and spans[-1][1] == size and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert Qwen3MoeModel.field_shapes(c)["experts_down"] == (e * h, inter)


# ---- checkpoints and the forward ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """moe-tiny, weights std 0.1 (every layer moves the logits), norms off 1: every layer sparse."""
    return _once("moe", lambda: make_test_model("moe-tiny", tmp_path_factory.mktemp("models") / "moe-tiny", seed=11,
                                                overrides={"initializer_range": 0.1}, progress=False))


@pytest.fixture(scope="module")
def moe_mixed_dir(tmp_path_factory):
    """Layer 2 a dense MLP (mlp_only_layers) between sparse ones, untied LM head."""
    return _once("moe-mixed", lambda: make_test_model(
        "moe-tiny", tmp_path_factory.mktemp("models") / "moe-mixed", seed=12, progress=False,
        overrides={"initializer_range": 0.1, "mlp_only_layers": [2], "tie_word_embeddings": False}))


def load(folder, config=None):
    return load_model(folder, "cpu", progress=False, max_positions=256, config=config)


def test_loads_stacked_experts(moe_mixed_dir):
    model = load(moe_mixed_dir)
    c = model.config
    assert type(model) is Qwen3MoeModel and isinstance(model, CausalLM) and c.sparse_layers == (0, 1, 3)
    e, h, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
    reader = CheckpointReader(moe_mixed_dir)

    def file(name):
        return np.asarray(reader.get(name), np.float32)

    for i in c.sparse_layers:
        layer, views = model.layers[i], model.experts[i]
        gate_up3, down3 = views["gate_up"], views["down"]
        assert views["gate_up_scale"] is None and views["down_scale"] is None  # bf16 experts
        assert layer.gate_up is None and layer.down is None
        assert layer.experts_gate_up.shape == (e * 2 * inter, h) and layer.experts_down.shape == (e * h, inter)
        assert gate_up3.shape == (e, 2 * inter, h) and down3.shape == (e, h, inter)
        stacked_gu = np.asarray(layer.experts_gate_up.numpy(), np.float32)
        stacked_d = np.asarray(layer.experts_down.numpy(), np.float32)
        gu3, d3 = np.asarray(gate_up3.numpy(), np.float32), np.asarray(down3.numpy(), np.float32)
        np.testing.assert_array_equal(np.asarray(layer.router.numpy(), np.float32), file(f"model.layers.{i}.mlp.gate.weight"))
        for x in range(e):
            p = f"model.layers.{i}.mlp.experts.{x}."
            gate, up, down = file(p + "gate_proj.weight"), file(p + "up_proj.weight"), file(p + "down_proj.weight")
            np.testing.assert_array_equal(stacked_gu[x * 2 * inter:x * 2 * inter + inter], gate)
            np.testing.assert_array_equal(stacked_gu[x * 2 * inter + inter:(x + 1) * 2 * inter], up)
            np.testing.assert_array_equal(stacked_d[x * h:(x + 1) * h], down)
            # the op's views: expert x = [gate rows; up rows] and its down projection
            np.testing.assert_array_equal(gu3[x], np.concatenate([gate, up]))
            np.testing.assert_array_equal(d3[x], down)
    dense = model.layers[2]
    assert model.experts[2] is None and dense.router is None and dense.experts_gate_up is None
    np.testing.assert_array_equal(np.asarray(dense.gate_up.numpy()[c.intermediate_size:], np.float32),
                                  file("model.layers.2.mlp.up_proj.weight"))
    # weight bytes: the total, and what a step touching k experts per sparse layer reads
    assert model.weight_bytes() == reader.total_bytes
    expert = 3 * h * inter * 2
    experts_total = len(c.sparse_layers) * e * expert
    assert model.expert_bytes() == expert
    assert model.step_weight_bytes(e) == model.weight_bytes()
    assert model.step_weight_bytes(0) == model.weight_bytes() - experts_total
    assert model.step_weight_bytes(2.5) == model.weight_bytes() - experts_total + 2.5 * 3 * expert
    with pytest.raises(ValueError, match="experts_per_layer"):
        model.step_weight_bytes(e + 1)
    assert model.expected_experts_per_layer(1) == pytest.approx(c.num_experts_per_tok)
    assert c.num_experts_per_tok < model.expected_experts_per_layer(3) < 3 * c.num_experts_per_tok
    assert model.expected_experts_per_layer(10_000) == pytest.approx(e)
    # a checkpoint of another expert count is refused by name
    with pytest.raises(ValueError, match=r"missing.*mlp\.experts\.16\.gate_proj\.weight"):
        load(moe_mixed_dir, config=c.replace(num_experts=17))


NEAR_TIE = 0.05  # router-logit gap within which bf16 rounding may pick either expert (flips seen up to 0.007)


def moe_reference_logits(folder, token_ids, config: dict | None = None, routing: list | None = None):
    """float64 [T, vocab] logits of Qwen3MoeForCausalLM as transformers computes them (without its dtype
    rounding), from config.json (or `config`) and the safetensors tensors, with a per-token loop over the routed
    experts.

    routing: the expert sets a bf16 run picked (per sparse layer, [T, k]). A bf16 run's router logits are ~1e-2
    away from float64's, so where two experts' logits are closer than that it may route a token to the other one,
    which moves that token (and, through attention, the later ones) far more than rounding does. Given `routing`,
    the reference follows the run's pick where it differs from its own, after checking that the pick is k distinct
    experts and a near tie (within NEAR_TIE of its own k-th best logit): any other difference is an error. Returns
    (logits, near ties followed)."""
    cfg = config or json.loads((folder / "config.json").read_text())
    reader = CheckpointReader(folder)
    eps, hq, hkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    k, n_exp = cfg["num_experts_per_tok"], cfg["num_experts"]

    def w(name):
        return np.asarray(reader.get(name), np.float64)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def swiglu(h, gate, up, down):
        g, u = h @ gate.T, h @ up.T
        return (g / (1 + np.exp(-g)) * u) @ down.T

    ids = np.asarray(token_ids)
    t = len(ids)
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]

    def rope(x):
        return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    mask = np.triu(np.full((t, t), -np.inf), 1)
    followed = 0
    sparse_index = 0
    embed = reader.get("model.embed_tokens.weight")
    x = np.asarray(embed[ids], np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = rope(rms((h @ w(p + "self_attn.q_proj.weight").T).reshape(t, hq, d), w(p + "self_attn.q_norm.weight")))
        kk = rope(rms((h @ w(p + "self_attn.k_proj.weight").T).reshape(t, hkv, d), w(p + "self_attn.k_norm.weight")))
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(t, hkv, d)
        kk, v = np.repeat(kk, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(d) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, hq * d)
        x = x + attn @ w(p + "self_attn.o_proj.weight").T
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        sparse = i not in cfg["mlp_only_layers"] and n_exp > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0
        if not sparse:
            x = x + swiglu(h, w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"))
            continue
        router = w(p + "mlp.gate.weight")
        experts = [[w(f"{p}mlp.experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")] for e in range(n_exp)]
        out = np.zeros_like(x)
        for tok in range(t):
            logits = router @ h[tok]
            prob = np.exp(logits - logits.max())
            prob /= prob.sum()
            top = np.argsort(-prob, kind="stable")[:k]
            if routing is not None:
                picked = np.asarray(routing[sparse_index][tok])
                # a pick of other than k distinct experts is no near tie: it is a wrong count, never followed
                assert len(set(picked.tolist())) == len(picked) == k, (
                    f"layer {i} token {tok}: the run routed to experts {picked.tolist()}, not {k} distinct ones")
                if set(picked.tolist()) != set(top.tolist()):
                    gap = logits[top].min() - logits[picked].min()
                    assert gap < NEAR_TIE, (f"layer {i} token {tok}: the run picked experts {sorted(picked)}, the "
                                            f"reference {sorted(top)} ({gap:.3f} apart: not a near tie)")
                    top, followed = picked, followed + 1
            weights = prob[top] / (prob[top].sum() if cfg["norm_topk_prob"] else 1.0)
            for e, wt in zip(top, weights):
                out[tok] += wt * swiglu(h[tok:tok + 1], *experts[e])[0]
        x = x + out
        sparse_index += 1
    x = rms(x, w("model.norm.weight"))
    # the LM head in float32 (its bf16 values exactly; 1e-7 off float64 in the sums), not a 150 MB float64 copy
    head = embed if cfg.get("tie_word_embeddings") else reader.get("lm_head.weight")
    return x.astype(np.float32) @ np.asarray(head, np.float32).T, followed


@pytest.fixture
def routing_spy(monkeypatch):
    """The expert sets each moe_experts call of the model picks: the top k of the router logits of the bf16 rows it
    is given (computed here in float64; they match the op's fp32 choice but for ties within ~1e-6)."""
    import xserv.models.qwen3_moe as qwen3_moe

    calls = []
    real = qwen3_moe.moe_experts

    def spy(x, router, gate_up, down, top_k, renormalize, **kwargs):
        logits = np.asarray(x.numpy(), np.float64) @ np.asarray(router.numpy(), np.float64).T
        calls.append(np.argsort(-logits, axis=1, kind="stable")[:, :top_k])
        return real(x, router, gate_up, down, top_k, renormalize, **kwargs)

    monkeypatch.setattr(qwen3_moe, "moe_experts", spy)
    return calls


@pytest.mark.parametrize("variant", ["renormalised", "not renormalised", "dense layer"])
def test_matches_float64_reference(moe_dir, moe_mixed_dir, variant, rng, routing_spy):
    folder = moe_mixed_dir if variant == "dense layer" else moe_dir
    cfg = json.loads((folder / "config.json").read_text())
    cfg["norm_topk_prob"] = variant != "not renormalised"
    config = config_from_dict(cfg)
    model = load(folder, config)
    assert model.config.norm_topk_prob == cfg["norm_topk_prob"]
    ids = rng.integers(0, config.vocab_size, 23).tolist()
    table = [5, 2, 9, 0, 7, 3]
    cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, "cpu", model.dtype)
    logits = model.forward(make_batch([SeqChunk(ids, 0, table, "all")], BLOCK, "cpu"), cache).numpy().copy()
    assert len(routing_spy) == len(config.sparse_layers)
    ref, followed = moe_reference_logits(folder, ids, cfg, routing_spy)
    err = rel_err_rows(logits, ref)
    print(f"{variant}: max error {err.max():.2e}, {followed} near ties followed")
    # bf16 activations and weights against float64 (the dense models: < 3e-2 at weights std 0.1, seen ~1e-2 here);
    # a swapped gate/up, an expert's rows off by one, the routing weights not (or wrongly) renormalised or the
    # dense layer run as sparse give > 0.1
    assert err.max() < 3e-2, err
    # decode steps after a prefix give the prefill's logits (other GEMM shapes: fp32 summation order only)
    cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, "cpu", model.dtype)
    model.forward(make_batch([SeqChunk(ids[:-3], 0, table, "none")], BLOCK, "cpu"), cache)
    steps = [model.forward(make_batch([SeqChunk(ids[j:j + 1], j, table, "last")], BLOCK, "cpu"), cache).numpy().copy()
             for j in range(len(ids) - 3, len(ids))]
    assert rel_err_rows(np.concatenate(steps), logits[-3:]).max() < 1e-2


ROUTE_CLEAR_GAP = 1e-3  # router logits this far apart cannot swap places in an fp32 softmax (CPU or GPU)


def check_routing(logits, ids, weights, k, renormalize):
    """The routing of one moe_experts call, from its fp32 router logits [T, E]: ids [T, k] holds k distinct experts
    a token, the k largest logits wherever the k-th and the (k+1)-th are clearly apart (closer, rounding may pick
    either, and the run's pick is not judged), and weights [T, k] the softmax probabilities at those ids,
    renormalised to sum 1 when asked. Returns the number of rows whose expert set was checked."""
    t, e = logits.shape
    assert ids.shape == (t, k) and weights.shape == (t, k), f"routed {ids.shape[1]} experts a token, not {k}"
    assert ids.min() >= 0 and ids.max() < e
    assert all(len(set(row)) == k for row in ids.tolist()), ids
    l64 = logits.astype(np.float64)
    order = np.argsort(-l64, axis=1)
    ranked = np.take_along_axis(l64, order, 1)
    clear = ranked[:, k - 1] - ranked[:, k] > ROUTE_CLEAR_GAP
    for row in np.nonzero(clear)[0]:
        assert set(ids[row].tolist()) == set(order[row, :k].tolist()), (row, ids[row], order[row, :k])
    p = np.exp(l64 - l64.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = np.take_along_axis(p, ids.astype(np.int64), 1)
    if renormalize:
        want /= want.sum(axis=1, keepdims=True)
    # fp32 softmax against float64: a few ulps; a weight of the wrong expert, or a sum over another count, is off
    # by far more
    np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-7)
    return int(clear.sum())


def run_steps(model, device, ids, table):
    """A prefill of all but the last 6 tokens, a 5-token chunk, then a one-token step: each routing path of the op
    on CUDA (a top-k grid then a sorting CTA above 16 tokens, one routing CTA up to 16, the routing inside the
    one-token gate/up GEMM)."""
    cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, device, model.dtype)
    for start, end in ((0, len(ids) - 6), (len(ids) - 6, len(ids) - 1), (len(ids) - 1, len(ids))):
        model.forward(make_batch([SeqChunk(ids[start:end], start, table, "last")], BLOCK, device), cache)


@pytest.mark.parametrize("renormalize", [True, False])
def test_each_token_is_routed_to_exactly_k_experts(moe_dir, rng, monkeypatch, renormalize):
    """The model's sparse layers route every token to exactly num_experts_per_tok distinct experts, the top ones by
    router logit, with the softmax weights: the routing the CPU op computes is checked against NumPy on the very
    logits it was given: the count pinned directly, not through logits. Red with k - 1 experts (the model passing
    num_experts_per_tok - 1, moe_experts or moe_route_reference taking one fewer)."""
    import xserv.ops.moe as moe_ops

    cfg = json.loads((moe_dir / "config.json").read_text())
    cfg["norm_topk_prob"] = renormalize
    config = config_from_dict(cfg)
    model = load(moe_dir, config)
    calls = []
    real = moe_ops.moe_route_reference

    def spy(logits, top_k, renormalize):
        ids, weights = real(logits, top_k, renormalize)
        calls.append((logits.copy(), ids, weights))
        return ids, weights

    monkeypatch.setattr(moe_ops, "moe_route_reference", spy)
    ids = rng.integers(0, config.vocab_size, 30).tolist()
    run_steps(model, "cpu", ids, [5, 2, 9, 0, 7, 3, 11, 13])
    assert len(calls) == 3 * len(config.sparse_layers)
    checked = sum(check_routing(*call, config.num_experts_per_tok, renormalize) for call in calls)
    assert checked >= 0.9 * 30 * len(config.sparse_layers)  # near ties are rare: the expert sets were checked


def test_renormalisation_and_dense_layers_matter(moe_dir, rng):
    """The reference check above can fail on the options: the same weights with the other norm_topk_prob, or with
    a layer read as dense... (its weights are missing then) give logits far apart."""
    cfg = json.loads((moe_dir / "config.json").read_text())
    ids = rng.integers(0, cfg["vocab_size"], 8).tolist()
    on, _ = moe_reference_logits(moe_dir, ids, {**cfg, "norm_topk_prob": True})
    off, _ = moe_reference_logits(moe_dir, ids, {**cfg, "norm_topk_prob": False})
    assert rel_err_rows(off, on).max() > 0.1
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.gate_proj\.weight"):
        load(moe_dir, config_from_dict({**cfg, "mlp_only_layers": [1]}))


def test_config_from_pretrained(moe_mixed_dir):
    c = config_from_pretrained(moe_mixed_dir)
    assert type(c) is Qwen3MoeConfig and c.mlp_only_layers == (2,) and not c.tie_word_embeddings
    assert c == tiny_config(initializer_range=0.1, mlp_only_layers=[2], tie_word_embeddings=False)


def test_workspace_has_dense_buffers_only_with_dense_layers(moe_dir, moe_mixed_dir):
    all_sparse = load(moe_dir).make_workspace(8, 2)
    assert all_sparse.gate_up is None and all_sparse.act is None and all_sparse.moe.max_tokens == 8
    mixed = load(moe_mixed_dir).make_workspace(8, 2)
    assert mixed.gate_up.shape == (8, 2 * 192) and mixed.act.shape == (8, 192)


# ---- through the engine ------------------------------------------------------------------------------------------
class _RoutingNearTiesPinned:
    """Wraps the CPU router (xserv.ops.moe.moe_route_reference): while `recording`, keeps each row's router logits
    and experts; after, a row whose k-th and (k+1)-th router logits are within NEAR_TIE takes the experts of the
    recorded row nearest to it (within NEAR_TIE in every logit), its weights from its own logits.

    A router logit moves with the batch shape like any logit (tests/batch_shape.py), so where two experts are that
    close a run in another batch shape may route the token to the other one: its hidden state then moves by far
    more than a rounding, and so do the logits after it (0.05 seen). In this model one routing in seven is that
    close, in nearly every prompt. Pinned to the runs alone, the batched run is compared for its batching."""

    def __init__(self, monkeypatch):
        import xserv.ops.moe as moe

        self.real = moe.moe_route_reference
        self.recording = True
        self.logits, self.ids = [], []
        monkeypatch.setattr(moe, "moe_route_reference", self.route)

    def route(self, logits, top_k, renormalize):
        ids, weights = self.real(logits, top_k, renormalize)
        if self.recording:
            self.logits.append(np.array(logits, np.float32))
            self.ids.append(ids)
            return ids, weights
        best = -np.sort(-np.asarray(logits, np.float32), axis=1)
        near = np.flatnonzero(best[:, top_k - 1] - best[:, top_k] <= NEAR_TIE)
        if near.size == 0:
            return ids, weights
        seen, seen_ids = np.concatenate(self.logits), np.concatenate(self.ids)
        for row in near:
            distance = np.abs(seen - logits[row]).max(axis=1)
            if distance.min() <= NEAR_TIE:
                ids[row] = seen_ids[np.argmin(distance)]
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        weights = np.take_along_axis(z / z.sum(axis=1, keepdims=True), ids, axis=1).astype(np.float32)
        if renormalize:
            weights = weights / weights.sum(axis=1, keepdims=True)
        return ids, weights


def test_llm_generates_and_batches_like_alone(moe_mixed_dir, monkeypatch):
    """Four prompts batched and each alone: greedy tokens and logprobs equal up to the rounding a batch shape may
    move (tests/batch_shape.py), with the routing near ties pinned to the runs alone (`_RoutingNearTiesPinned`);
    each token the argmax of the logits of its context, computed afresh."""
    from xserv import LLM, SamplingParams

    llm = LLM(str(moe_mixed_dir), device="cpu", max_model_len=128, progress=False)
    try:
        assert type(llm.model).__name__ == "Qwen3MoeModel"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
        prompts = [[791, 6722, 315, 9625, 374], [9707], list(range(1000, 1021)), [151644, 872, 198, 13048]]
        routing = _RoutingNearTiesPinned(monkeypatch)
        alone = [llm.generate([p], params)[0] for p in prompts]
        routing.recording = False
        batched = llm.generate(prompts, params)
        assert_same_runs(batched, alone, params, llm)  # a batch shape apart: equal up to rounding
        assert all(len(o.token_ids) == 8 for o in batched)
        assert len({tuple(o.token_ids) for o in batched}) > 1  # the prompts matter
        # greedy tokens are the argmax of the model's logits (a prefill of the whole text: up to a near tie)
        for out in batched:
            assert_follows_logits(out, params, llm)
        assert llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4))[0].text
    finally:
        llm.close()


def test_llm_reports_a_checkpoint_that_does_not_match(tiny_model_dir, tmp_path):
    """A dense Qwen3 checkpoint under a Qwen3-MoE config.json: LLM() raises the checkpoint's ValueError naming the
    missing router (it raised an AttributeError from its clean-up before)."""
    import shutil

    from xserv import LLM

    folder = tmp_path / "relabelled"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=64)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.0\.mlp\.gate\.weight(.|\n)*unexpected .*mlp\.gate_proj"):
        LLM(str(folder), device="cpu", progress=False)


# ---- CUDA -----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_routes_each_token_to_exactly_k_experts(moe_dir, rng, monkeypatch):
    """On CUDA, through each routing kernel (prefill, a short chunk, the one-token step): the expert ids and weights
    the op leaves in its workspace hold k distinct experts a token, the top ones of the router logits it computed.
    Red with k - 1 experts, in the model or in the launcher's arguments to the routing kernels (the comparison
    with the NumPy model would follow the same count, or call the difference a routing near tie)."""
    import xserv.models.qwen3_moe as qwen3_moe

    model = load_model(moe_dir, "cuda", progress=False, max_positions=256)
    config = model.config
    k = config.num_experts_per_tok
    assert model.fused_forward_ok(1, 1)  # the one-token step takes the fused path (routing inside gate/up)
    calls = []
    real = qwen3_moe.moe_experts

    def spy(x, router, gate_up, down, top_k, renormalize, workspace=None, **kwargs):
        out = real(x, router, gate_up, down, top_k, renormalize, workspace=workspace, **kwargs)
        t = x.shape[0]
        calls.append((workspace.logits.numpy()[:t].copy(), workspace.ids.numpy()[:t * k].reshape(t, k),
                      workspace.weights.numpy()[:t * k].reshape(t, k)))
        return out

    monkeypatch.setattr(qwen3_moe, "moe_experts", spy)
    ids = rng.integers(0, config.vocab_size, 30).tolist()
    run_steps(model, "cuda", ids, [5, 2, 9, 0, 7, 3, 11, 13])
    assert len(calls) == 3 * len(config.sparse_layers)
    checked = sum(check_routing(*call, k, config.norm_topk_prob) for call in calls)
    assert checked >= 0.9 * 30 * len(config.sparse_layers)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sparse", "dense layer"])
def test_cuda_matches_numpy_fused_and_unfused(moe_dir, moe_mixed_dir, variant, rng):
    """A prefill, then one-token decode steps, on CUDA against the NumPy model: the fused one-token path (GEMV
    projections, the routing inside the one-token gate/up GEMM, the combine adding into the residual) and, with
    fused_gemv off, the unfused ops. At weights std 0.1 a few router logits fall within rounding of each
    other, so a routing near-tie may move a row (as between transformers' own bf16 and float32 runs); every other
    row agrees to summation order. A kernel that routes, normalises or adds wrongly moves every row."""
    folder = moe_mixed_dir if variant == "dense layer" else moe_dir
    cpu = load(folder)
    gpu = load_model(folder, "cuda", progress=False, max_positions=256)
    ids = rng.integers(0, cpu.config.vocab_size, 40).tolist()
    table = [5, 2, 9, 0, 7, 3, 11, 13, 1, 4, 6, 8]

    def run(model, device):
        cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, device, model.dtype)
        rows = [model.forward(make_batch([SeqChunk(ids[:-4], 0, table, "all")], BLOCK, device), cache).numpy().copy()]
        rows += [model.forward(make_batch([SeqChunk(ids[j:j + 1], j, table, "last")], BLOCK, device), cache)
                 .numpy().copy() for j in range(len(ids) - 4, len(ids))]
        return np.concatenate(rows)

    want = run(cpu, "cpu")
    assert gpu.fused_forward_ok(1, 1)
    fused = run(gpu, "cuda")
    gpu.fused_gemv = False
    unfused = run(gpu, "cuda")
    for name, got in (("fused", fused), ("unfused", unfused)):
        err = rel_err_rows(got, want)
        print(f"{variant}, {name}: CUDA vs NumPy median {np.median(err):.2e}, max {err.max():.2e}, "
              f"{(err >= 3e-2).sum()} of {len(err)} rows >= 3e-2")
        assert np.all(np.isfinite(got))
        # H100: median 7-8e-3; 1 (dense layer) and 5 (all sparse) of 40 rows past 3e-2 at routing near-ties
        assert np.median(err) < 1e-2 and (err < 3e-2).mean() >= 0.8
    decode = rel_err_rows(fused[-4:], unfused[-4:])
    assert (decode < 1e-2).sum() >= 3, decode  # the same steps, two kernel paths
