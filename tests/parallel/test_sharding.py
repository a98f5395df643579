"""Tensor-parallel sharding arithmetic (xserv/parallel/sharding.py), on the CPU: which rows/columns of every checkpoint
tensor each rank owns, for the presets (Qwen3 0.6B/8B/14B/32B, Llama 3 8B, Qwen3-MoE tiny and 30B-A3B) at tp 1, 2, 4,
8 and for odd head counts; that the ranks' shards cover every tensor exactly once (replicated ones on every rank);
that per-rank fields reassemble into the checkpoint; and that the column-/row-parallel shards computed per rank and
summed (the all-reduce, simulated in NumPy) give the unsharded result, through a whole tiny model.

The big presets' plans are built with 2 layers (their layers are alike; a 48-layer 30B-A3B plan is 19k shards per
rank). The checkers are functions of the plans, and `test_checkers_catch_planted_bugs` feeds them corrupted plans:
each must fail."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from xserv.models.config import preset_dict
from xserv.fp8_format import dequantize_blockwise, quantize_blockwise
from xserv.models.llama import LlamaConfig, LlamaModel
from xserv.models.qwen3 import Qwen3Config, Qwen3Model
from xserv.models.qwen3_moe import Qwen3MoeConfig
from xserv.models.registry import config_from_dict, model_class
from xserv.parallel import (COLUMN, REPLICATED, ROW, VOCAB, check_tp, rank_config, shard_plan, valid_tp_sizes,
                            vocab_part_size)

TPS = (1, 2, 4, 8)


@functools.lru_cache(maxsize=None)
def preset(name: str, layers: int | None = None, **overrides):
    d = preset_dict(name)
    if layers is not None:
        d["num_hidden_layers"] = layers
    d.update({k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()})
    return config_from_dict(d)


# preset -> tp -> (q heads, kv heads, kv replicas, intermediate, moe_intermediate) per rank; None: tp not valid
EXPECTED = {
    "0.6b": {1: (16, 8, 1, 3072, None), 2: (8, 4, 1, 1536, None), 4: (4, 2, 1, 768, None), 8: (2, 1, 1, 384, None)},
    "8b": {1: (32, 8, 1, 12288, None), 2: (16, 4, 1, 6144, None), 4: (8, 2, 1, 3072, None), 8: (4, 1, 1, 1536, None)},
    "14b": {1: (40, 8, 1, 17408, None), 2: (20, 4, 1, 8704, None), 4: (10, 2, 1, 4352, None),
            8: (5, 1, 1, 2176, None)},
    "32b": {1: (64, 8, 1, 25600, None), 2: (32, 4, 1, 12800, None), 4: (16, 2, 1, 6400, None),
            8: (8, 1, 1, 3200, None)},
    "llama3-8b": {1: (32, 8, 1, 14336, None), 2: (16, 4, 1, 7168, None), 4: (8, 2, 1, 3584, None),
                  8: (4, 1, 1, 1792, None)},
    "moe-tiny": {1: (4, 2, 1, None, 64), 2: (2, 1, 1, None, 32), 4: (1, 1, 2, None, 16), 8: None},
    "30b-a3b": {1: (32, 4, 1, None, 768), 2: (16, 2, 1, None, 384), 4: (8, 1, 1, None, 192), 8: (4, 1, 2, None, 96)},
    "235b-a22b": {1: (64, 4, 1, None, 1536), 2: (32, 2, 1, None, 768), 4: (16, 1, 1, None, 384),
                  8: (8, 1, 2, None, 192)},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rank_config_of_presets(name):
    config = preset(name)
    for tp, want in EXPECTED[name].items():
        if want is None:
            with pytest.raises(ValueError, match="num_attention_heads"):
                rank_config(config, tp, 0)
            continue
        nq, nkv, replicas, inter, moe = want
        for rank in range(tp):
            rc = rank_config(config, tp, rank)
            assert (rc.num_attention_heads, rc.num_key_value_heads, rc.kv_replicas) == (nq, nkv, replicas)
            assert (rc.intermediate_size, rc.moe_intermediate_size) == (inter, moe)
            assert rc.q_heads == (rank * nq, (rank + 1) * nq)
            local = rc.config
            assert (local.num_attention_heads, local.num_key_value_heads) == (nq, nkv)
            assert local.vocab_size == config.vocab_size  # the gathered logits' width
            if inter is not None:
                assert local.intermediate_size == inter
            if moe is not None:
                assert local.moe_intermediate_size == moe
            # Qwen3's and Llama 3's vocabularies split without padding up to tp 8
            assert rc.vocab_part * tp == rc.padded_vocab_size == config.vocab_size == 151936
            assert rc.vocab == (rank * rc.vocab_part, (rank + 1) * rc.vocab_part)
    assert [t for t in TPS if EXPECTED[name][t] is not None] == [t for t in valid_tp_sizes(config) if t in TPS]


def test_odd_head_counts_literally():
    # 40 q / 8 kv heads at tp 8 (Qwen3-14B): 5 q heads and 1 kv head per rank
    p = shard_plan(preset("14b", 2), None, 8, 3)
    assert p["model.layers.0.self_attn.q_proj.weight"].rows == (15 * 128, 20 * 128)
    assert p["model.layers.0.self_attn.k_proj.weight"].rows == (3 * 128, 4 * 128)
    assert p["model.layers.1.self_attn.v_proj.weight"].dest_rows == (6 * 128, 7 * 128)
    assert p["model.layers.0.self_attn.o_proj.weight"].cols == (1920, 2560)
    assert p["model.layers.0.mlp.down_proj.weight"].cols == (3 * 2176, 4 * 2176)
    # 16 q / 2 kv at tp 4: kv replicated, ranks 0, 1 hold kv head 0 and ranks 2, 3 kv head 1
    config = tiny_qwen3(heads=16, kv_heads=2)
    kv = [rank_config(config, 4, r).kv_heads for r in range(4)]
    assert kv == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [shard_plan(config, None, 4, r)["model.layers.0.self_attn.k_proj.weight"].rows for r in range(4)] == [
        (0, 8), (0, 8), (8, 16), (8, 16)]
    # 30B-A3B at tp 8: 32 q / 4 kv heads, each kv head on two ranks
    assert [rank_config(preset("30b-a3b", 2), 8, r).kv_heads[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # 6 q / 3 kv at tp 3 (an odd tp) and tp 6 (kv replicated twice); tp 2 divides neither way
    llama = tiny_llama()
    assert [rank_config(llama, 3, r).kv_heads for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [rank_config(llama, 6, r).kv_heads[0] for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert valid_tp_sizes(llama) == [1, 3, 6]


# ---- small configs for the element-level and numerical tests -----------------------------------------------------
def tiny_qwen3(heads=16, kv_heads=2, vocab=1000, tie=False, **kw):
    return Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, tie_word_embeddings=tie,
                       **kw)


def tiny_llama():  # tied embeddings, an odd vocabulary, 6 q / 3 kv heads
    return LlamaConfig(vocab_size=1001, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=3, head_dim=8, tie_word_embeddings=True)


def tiny_moe(norm_topk_prob=True):  # layer 0 a dense MLP, layer 1 sparse (decoder_sparse_step 2)
    return Qwen3MoeConfig(vocab_size=997, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                          norm_topk_prob=norm_topk_prob)


SMALL = {"qwen3 16q/2kv": (tiny_qwen3(), (1, 2, 4, 8, 16)), "llama 6q/3kv tied": (tiny_llama(), (1, 3, 6)),
         "moe dense+sparse": (tiny_moe(), (1, 2, 4))}
BIG = [(name, tp) for name in ("0.6b", "8b", "14b", "32b", "llama3-8b", "moe-tiny", "30b-a3b") for tp in TPS
       if EXPECTED[name][tp] is not None]


def all_ranks(config, tp):
    return [shard_plan(config, None, tp, r) for r in range(tp)]


@functools.lru_cache(maxsize=None)
def big_plans(name, tp):
    return all_ranks(preset(name, 2), tp)


# ---- every projection against its formula -------------------------------------------------------------------------
def expected_shard(config, rc, name, h):
    """(split, rows, cols, dest_rows) of checkpoint tensor `name` on rank rc, from the rules written out."""
    r, tp, d = rc.rank, rc.tp_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    nq = hq // tp
    if hkv >= tp:
        nkv, kv0 = hkv // tp, r * (hkv // tp)
    else:
        nkv, kv0 = 1, (r * nq) // (hq // hkv)
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        part = vocab_part_size(config.vocab_size, tp)
        v0, v1 = r * part, min((r + 1) * part, config.vocab_size)
        return VOCAB, (v0, v1), None, (0, v1 - v0)
    if suffix == "self_attn.q_proj.weight":
        return COLUMN, (r * nq * d, (r + 1) * nq * d), None, (0, nq * d)
    if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        at = nq * d if "k_proj" in suffix else (nq + nkv) * d
        return COLUMN, (kv0 * d, (kv0 + nkv) * d), None, (at, at + nkv * d)
    if suffix == "self_attn.o_proj.weight":
        return ROW, (0, h), (r * nq * d, (r + 1) * nq * d), (0, h)
    if suffix.startswith("mlp.experts."):
        e = int(suffix.split(".")[2])
        m = config.moe_intermediate_size // tp
        if suffix.endswith("down_proj.weight"):
            return ROW, (0, h), (r * m, (r + 1) * m), (e * h, (e + 1) * h)
        at = e * 2 * m + (m if suffix.endswith("up_proj.weight") else 0)
        return COLUMN, (r * m, (r + 1) * m), None, (at, at + m)
    if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        m = config.intermediate_size // tp
        at = m if "up_proj" in suffix else 0
        return COLUMN, (r * m, (r + 1) * m), None, (at, at + m)
    if suffix == "mlp.down_proj.weight":
        m = config.intermediate_size // tp
        return ROW, (0, h), (r * m, (r + 1) * m), (0, h)
    if suffix == "mlp.gate.weight":  # the MoE router
        return REPLICATED, (0, config.num_experts), None, (0, config.num_experts)
    assert suffix.endswith("norm.weight"), name
    n = d if suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") else h
    return REPLICATED, (0, n), None, (0, n)


def check_projections(config, plans):
    names = [w.name for w in model_class(config).weight_table(config)]
    for p in plans:
        assert [s.name for s in p.shards] == names  # every tensor, in file order
        for s in p.shards:
            split, rows, cols, dest = expected_shard(config, p.rank_config, s.name, config.hidden_size)
            assert (s.split, s.rows, s.cols, s.dest_rows) == (split, rows, cols, dest), s.name


@pytest.mark.parametrize("name,tp", BIG)
def test_every_projection_of_presets(name, tp):
    check_projections(preset(name, 2), big_plans(name, tp))


@pytest.mark.parametrize("label", sorted(SMALL))
def test_every_projection_of_small_configs(label):
    config, tps = SMALL[label]
    for tp in tps:
        check_projections(config, all_ranks(config, tp))


def test_mixed_moe_preset_and_trimming_changes_nothing():
    # 30B-A3B with a dense first layer: its dense MLP splits intermediate_size, the experts moe_intermediate_size
    config = preset("30b-a3b", 2, mlp_only_layers=(0,))
    plans = all_ranks(config, 8)
    check_projections(config, plans)
    assert plans[5]["model.layers.0.mlp.gate_proj.weight"].rows == (5 * 768, 6 * 768)
    assert plans[5]["model.layers.1.mlp.experts.127.up_proj.weight"].dest_rows == (127 * 192 + 96, 128 * 192)
    # the full 48-layer plan: the same shards per layer as the trimmed one
    full = shard_plan(preset("30b-a3b"), None, 8, 3)
    assert len(full.shards) == 48 * (6 + 1 + 3 * 128 + 2) + 3
    trimmed = {s.name: s for s in big_plans("30b-a3b", 8)[3].shards}
    for s in full.shards:
        if s.layer in (None, 0, 1):
            assert s == trimmed[s.name]
        else:
            base = trimmed[s.name.replace(f"layers.{s.layer}.", "layers.1.", 1)]
            assert dataclasses.replace(s, name=base.name, layer=1) == base


# ---- (a) the union of the ranks' shards covers every tensor exactly once -----------------------------------------
def assert_exact_cover(config, plans):
    """Per checkpoint tensor: the distinct rectangles of the ranks' shards tile it exactly (in bounds, pairwise
    disjoint, areas summing to its size), and each appears on as many ranks as its split says: 1, tp for a
    replicated tensor, tp / num_key_value_heads for a replicated kv head."""
    tp = len(plans)
    rc0 = plans[0].rank_config
    table = {w.name: w.shape for w in model_class(config).weight_table(config)}
    rects: dict[str, dict[tuple, int]] = {name: {} for name in table}
    splits: dict[str, str] = {}
    for p in plans:
        for s in p.shards:
            cols = s.col_range or (0, 1)
            key = (s.rows, cols)
            rects[s.name][key] = rects[s.name].get(key, 0) + 1
            splits[s.name] = s.split
    for name, shape in table.items():
        size = shape[0] * (shape[1] if len(shape) > 1 else 1)
        width = shape[1] if len(shape) > 1 else 1
        got = rects[name]
        assert got, f"{name}: no rank holds it"
        kv = name.endswith(("k_proj.weight", "v_proj.weight"))
        want = tp if splits[name] == REPLICATED else rc0.kv_replicas if kv else 1
        assert set(got.values()) == {want}, f"{name}: held {sorted(got.values())} times, expected {want}"
        boxes = sorted(got)
        for (r0, r1), (c0, c1) in boxes:
            assert 0 <= r0 < r1 <= shape[0] and 0 <= c0 < c1 <= width, f"{name}: {(r0, r1, c0, c1)} out of {shape}"
        for i, ((a0, a1), (b0, b1)) in enumerate(boxes):
            for (c0, c1), (d0, d1) in boxes[i + 1:]:
                assert a1 <= c0 or c1 <= a0 or b1 <= d0 or d1 <= b0, f"{name}: shards overlap"
        assert sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in boxes) == size, f"{name}: not covered"


def assert_dest_tiles(config, plan):
    """Per rank field: the shards' destination rows tile the field exactly, the vocab padding excepted, and every
    shard fills whole destination rows."""
    fields: dict[tuple, list] = {}
    for s in plan.shards:
        shape = plan.field_shapes[s.field]
        assert s.shape[1:] == tuple(shape[1:]), f"{s.name}: {s.shape} into {shape}"
        assert s.dest_rows[1] - s.dest_rows[0] == s.shape[0], s.name
        fields.setdefault((s.layer, s.field), []).append(s.dest_rows)
    for (layer, field), spans in fields.items():
        spans = sorted(spans)
        stop = plan.field_shapes[field][0]
        if field in ("embed", "lm_head") and plan.vocab_padding is not None:
            assert plan.vocab_padding[1] == stop
            stop = plan.vocab_padding[0]
        at = 0
        for s0, s1 in spans:
            assert s0 == at, f"layer {layer} {field}: rows {at}..{s0} unfilled or overlapping"
            at = s1
        assert at == stop, f"layer {layer} {field}: filled up to {at} of {stop}"


@pytest.mark.parametrize("name,tp", BIG)
def test_shards_cover_presets_exactly_once(name, tp):
    config = preset(name, 2)
    plans = big_plans(name, tp)
    assert_exact_cover(config, plans)
    for p in plans:
        assert_dest_tiles(config, p)


@pytest.mark.parametrize("label", sorted(SMALL))
def test_shards_cover_small_configs_exactly_once(label):
    config, tps = SMALL[label]
    for tp in tps:
        plans = all_ranks(config, tp)
        assert_exact_cover(config, plans)
        for p in plans:
            assert_dest_tiles(config, p)


def test_tp1_is_the_single_gpu_layout():
    for config in (preset("8b", 2), preset("30b-a3b", 2), tiny_llama(), tiny_moe()):
        cls = model_class(config)
        plan = shard_plan(config, cls, 1, 0)
        assert plan.vocab_padding is None and plan.field_shapes == cls.field_shapes(config)
        for w, s in zip(cls.weight_table(config), plan.shards, strict=True):
            assert s.index == tuple(slice(0, n) for n in w.shape)
            assert s.dest_rows == (w.rows or (0, w.shape[0]))


def test_vocab_padding():
    # 1000 ids at tp 4: 250 per rank, rounded up to 256; the last rank holds 232 ids and 24 padding rows
    plans = all_ranks(tiny_qwen3(), 4)
    assert [p["lm_head.weight"].rows for p in plans] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert [p.vocab_padding for p in plans] == [None, None, None, (232, 256)]
    assert plans[3].field_shapes["lm_head"] == (256, 64) and plans[3].rank_config.padded_vocab_size == 1024
    # 1001 ids at tp 3: 334 -> 336 per rank
    assert [p.rank_config.vocab for p in all_ranks(tiny_llama(), 3)] == [(0, 336), (336, 672), (672, 1001)]
    # a vocabulary smaller than tp * vocab_part: the last rank holds only padding, and no embed shard
    last = shard_plan(tiny_qwen3(vocab=17), None, 16, 15)
    assert vocab_part_size(17, 16) == 8 and last.rank_config.vocab == (17, 17) and last.vocab_padding == (0, 8)
    assert "lm_head.weight" not in last.by_name and "model.embed_tokens.weight" not in last.by_name


# ---- (b) per-rank fields reassemble into the checkpoint -----------------------------------------------------------
def random_checkpoint(config, seed=0):
    rng = np.random.default_rng(seed)
    return {w.name: rng.standard_normal(w.shape) * 0.3 + 0.05
            for w in model_class(config).weight_table(config)}


def load_ranks(plans, ckpt):
    """What a loader would build on each rank: the rank's fields, NaN-poisoned, filled shard by shard from views of
    the file tensors, the vocab padding zeroed. {(layer, field): array} per rank."""
    ranks = []
    for p in plans:
        fields = {}
        for s in p.shards:
            key = (s.layer, s.field)
            if key not in fields:
                fields[key] = np.full(p.field_shapes[s.field], np.nan)
            view = s.take(ckpt[s.name])
            assert np.shares_memory(view, ckpt[s.name])  # a view of the file tensor, not a copy
            fields[key][s.dest_rows[0]:s.dest_rows[1]] = view
        if p.vocab_padding is not None:
            for f in ("embed", "lm_head"):
                if (None, f) in fields:
                    fields[(None, f)][p.vocab_padding[0]:] = 0
        for key, a in fields.items():
            assert not np.isnan(a).any(), f"rank {p.rank} {key}: rows left unfilled"
        ranks.append(fields)
    return ranks


def reassemble(config, plans, ranks):
    """The checkpoint rebuilt from the ranks' fields by the layout rules alone (no shard metadata): q heads, gate
    and up rows, o and down columns, experts and vocabulary concatenated across ranks; one rank per kv head group."""
    rcs = [p.rank_config for p in plans]
    nq, nkv, d = rcs[0].num_attention_heads, rcs[0].num_key_value_heads, config.head_dim
    h = config.hidden_size
    kv_ranks = range(0, len(plans), rcs[0].kv_replicas)
    out = {}

    def cat(key, pick, axis=0, which=range(len(plans))):
        return np.concatenate([pick(ranks[r][key]) for r in which], axis=axis)

    v = config.vocab_size
    out["model.embed_tokens.weight"] = cat((None, "embed"), lambda a: a)[:v]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = cat((None, "lm_head"), lambda a: a)[:v]
    out["model.norm.weight"] = ranks[0][(None, "final_norm")]
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        out[pre + "self_attn.q_proj.weight"] = cat((i, "qkv"), lambda a: a[:nq * d])
        out[pre + "self_attn.k_proj.weight"] = cat((i, "qkv"), lambda a: a[nq * d:(nq + nkv) * d], which=kv_ranks)
        out[pre + "self_attn.v_proj.weight"] = cat((i, "qkv"), lambda a: a[(nq + nkv) * d:], which=kv_ranks)
        out[pre + "self_attn.o_proj.weight"] = cat((i, "o_proj"), lambda a: a, axis=1)
        for f, hf in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                      ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")):
            if (i, f) in ranks[0]:
                out[pre + hf + ".weight"] = ranks[0][(i, f)]
        if (i, "gate_up") in ranks[0]:
            m = rcs[0].intermediate_size
            out[pre + "mlp.gate_proj.weight"] = cat((i, "gate_up"), lambda a: a[:m])
            out[pre + "mlp.up_proj.weight"] = cat((i, "gate_up"), lambda a: a[m:])
            out[pre + "mlp.down_proj.weight"] = cat((i, "down"), lambda a: a, axis=1)
        if (i, "router") in ranks[0]:
            m, e_count = rcs[0].moe_intermediate_size, config.num_experts
            out[pre + "mlp.gate.weight"] = ranks[0][(i, "router")]
            for e in range(e_count):
                gu = lambda a, e=e: a.reshape(e_count, 2 * m, h)[e]  # noqa: E731
                out[pre + f"mlp.experts.{e}.gate_proj.weight"] = cat((i, "experts_gate_up"), lambda a: gu(a)[:m])
                out[pre + f"mlp.experts.{e}.up_proj.weight"] = cat((i, "experts_gate_up"), lambda a: gu(a)[m:])
                out[pre + f"mlp.experts.{e}.down_proj.weight"] = cat(
                    (i, "experts_down"), lambda a, e=e: a.reshape(e_count, h, m)[e], axis=1)
    return out


def assert_reassembles(config, plans, ckpt):
    ranks = load_ranks(plans, ckpt)
    rebuilt = reassemble(config, plans, ranks)
    assert set(rebuilt) == set(ckpt)
    for name, a in ckpt.items():
        assert np.array_equal(rebuilt[name], a), name
    for fields in ranks:  # replicated tensors: identical on every rank (norms, router, a replicated kv head's rows)
        for key in fields:
            if key[1] in ("input_norm", "post_norm", "q_norm", "k_norm", "final_norm", "router"):
                assert np.array_equal(fields[key], ranks[0][key]), key
    rc0 = plans[0].rank_config
    for r, fields in enumerate(ranks):
        twin = ranks[r - r % rc0.kv_replicas]
        kv = slice(rc0.num_attention_heads * config.head_dim, None)
        for i in range(config.num_hidden_layers):
            assert np.array_equal(fields[(i, "qkv")][kv], twin[(i, "qkv")][kv])
    for p, fields in zip(plans, ranks):
        if p.vocab_padding is not None:
            assert not fields[(None, "embed")][p.vocab_padding[0]:].any()


@pytest.mark.parametrize("label", sorted(SMALL))
def test_rank_fields_reassemble_the_checkpoint(label):
    config, tps = SMALL[label]
    ckpt = random_checkpoint(config)
    for tp in tps:
        assert_reassembles(config, all_ranks(config, tp), ckpt)


# ---- (c) sharded compute + simulated all-reduce == the unsharded compute -----------------------------------------
def silu(x):
    return x / (1.0 + np.exp(-x))


def rmsnorm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def mlp(x, gate_up, down):
    """The model's SwiGLU on its fused layout: gate rows then up rows of gate_up."""
    m = gate_up.shape[0] // 2
    gu = x @ gate_up.T
    return (silu(gu[:, :m]) * gu[:, m:]) @ down.T


def attention(x, qkv, o_proj, hq, hkv, d, q_norm=None, k_norm=None):
    """Causal GQA attention on the model's fused qkv layout [q heads; k heads; v heads], q head j reading kv head
    j // (hq / hkv) (no RoPE: it acts per head and position, the same on every rank). Returns x_attn @ o_proj^T."""
    t = x.shape[0]
    y = x @ qkv.T
    q = y[:, :hq * d].reshape(t, hq, d)
    k = y[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    v = y[:, (hq + hkv) * d:].reshape(t, hkv, d)
    if q_norm is not None:
        q, k = rmsnorm(q, q_norm), rmsnorm(k, k_norm)
    group = hq // hkv
    mask = np.triu(np.full((t, t), -np.inf), 1)
    out = np.empty((t, hq, d))
    for j in range(hq):
        s = q[:, j] @ k[:, j // group].T / np.sqrt(d) + mask
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, j] = (p / p.sum(axis=1, keepdims=True)) @ v[:, j // group]
    return out.reshape(t, hq * d) @ o_proj.T


def route(x, router, k, norm_topk_prob):
    logits = x @ router.T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, axis=1)
    if norm_topk_prob:
        w /= w.sum(axis=1, keepdims=True)
    return top, w


def moe_block(x, router, expert, config):
    """Routed mixture: sum over each token's top-k experts of weight x expert(token); expert(e) -> (gate_up, down)."""
    top, w = route(x, router, config.num_experts_per_tok, config.norm_topk_prob)
    y = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        for e, we in zip(top[t], w[t]):
            y[t] += we * mlp(x[t:t + 1], *expert(e))[0]
    return y


def reference_forward(config, ckpt, ids):
    """The unsharded model, straight from the checkpoint's unfused tensors."""
    c, g = config, lambda n: ckpt[n]
    res = g("model.embed_tokens.weight")[ids]
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in ckpt
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        x = rmsnorm(res, g(pre + "input_layernorm.weight"))
        qkv = np.concatenate([g(pre + f"self_attn.{p}_proj.weight") for p in "qkv"])
        norms = (g(pre + "self_attn.q_norm.weight"), g(pre + "self_attn.k_norm.weight")) if qk_norm else ()
        res = res + attention(x, qkv, g(pre + "self_attn.o_proj.weight"), c.num_attention_heads,
                              c.num_key_value_heads, c.head_dim, *norms)
        x = rmsnorm(res, g(pre + "post_attention_layernorm.weight"))
        if pre + "mlp.gate.weight" in ckpt:
            def expert(e, pre=pre):
                ep = pre + f"mlp.experts.{e}."
                return (np.concatenate([g(ep + "gate_proj.weight"), g(ep + "up_proj.weight")]),
                        g(ep + "down_proj.weight"))
            res = res + moe_block(x, g(pre + "mlp.gate.weight"), expert, c)
        else:
            gate_up = np.concatenate([g(pre + "mlp.gate_proj.weight"), g(pre + "mlp.up_proj.weight")])
            res = res + mlp(x, gate_up, g(pre + "mlp.down_proj.weight"))
    lm = g("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
    return rmsnorm(res, g("model.norm.weight")) @ lm.T


def tp_forward(config, plans, ranks, ids):
    """The same model run by the ranks on their fields with the rank-local sizes (rank_config.config), the
    collectives simulated: vocab-parallel embedding + all-reduce, an all-reduce (sum) after each row-parallel
    projection, the logits all-gathered and cut to the vocabulary. Replicated steps (norms, routing) run on every
    rank; since their inputs are the all-reduced values they agree, and rank 0's are used."""
    rcs = [p.rank_config for p in plans]

    def embed_rows(r):
        lo, hi = rcs[r].vocab
        own = (ids >= lo) & (ids < hi)
        rows = np.zeros((len(ids), config.hidden_size))
        rows[own] = ranks[r][(None, "embed")][ids[own] - lo]
        return rows

    res = sum(embed_rows(r) for r in range(len(plans)))
    for i in range(config.num_hidden_layers):
        x = rmsnorm(res, ranks[0][(i, "input_norm")])
        parts = []
        for rc, f in zip(rcs, ranks):
            lc = rc.config
            norms = (f[(i, "q_norm")], f[(i, "k_norm")]) if (i, "q_norm") in f else ()
            parts.append(attention(x, f[(i, "qkv")], f[(i, "o_proj")], lc.num_attention_heads,
                                   lc.num_key_value_heads, config.head_dim, *norms))
        res = res + sum(parts)  # all-reduce
        x = rmsnorm(res, ranks[0][(i, "post_norm")])
        parts = []
        for rc, f in zip(rcs, ranks):
            if (i, "router") in f:
                e_count, m, h = config.num_experts, rc.moe_intermediate_size, config.hidden_size
                gu, dn = f[(i, "experts_gate_up")].reshape(e_count, 2 * m, h), f[(i, "experts_down")].reshape(
                    e_count, h, m)
                parts.append(moe_block(x, f[(i, "router")], lambda e, gu=gu, dn=dn: (gu[e], dn[e]), config))
            else:
                parts.append(mlp(x, f[(i, "gate_up")], f[(i, "down")]))
        res = res + sum(parts)  # all-reduce
    x = rmsnorm(res, ranks[0][(None, "final_norm")])
    head = "embed" if config.tie_word_embeddings else "lm_head"
    gathered = np.concatenate([x @ f[(None, head)].T for f in ranks], axis=1)  # all-gather on rank 0
    assert gathered.shape[1] == rcs[0].padded_vocab_size
    return gathered[:, :config.vocab_size]


@pytest.mark.parametrize("label", sorted(SMALL))
def test_tp_forward_equals_unsharded(label):
    config, tps = SMALL[label]
    ckpt = random_checkpoint(config, seed=1)
    rng = np.random.default_rng(2)
    ids = np.concatenate([[0, config.vocab_size - 1], rng.integers(0, config.vocab_size, 7)])
    want = reference_forward(config, ckpt, ids)
    for tp in tps:
        plans = all_ranks(config, tp)
        got = tp_forward(config, plans, load_ranks(plans, ckpt), ids)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"tp {tp}")


@pytest.mark.parametrize("tp", (2, 4, 8, 16))
def test_attention_and_mlp_shards_sum_to_the_unsharded_projection(tp):
    """One layer's attention (GQA: kv heads split at tp 2, replicated from tp 4) and dense SwiGLU MLP: the ranks'
    partial outputs summed equal the unsharded ones; each rank's column-parallel activation is its slice of the
    unsharded activation."""
    config = tiny_qwen3()
    ckpt = random_checkpoint(config, seed=3)
    x = np.random.default_rng(4).standard_normal((6, config.hidden_size))
    pre = "model.layers.1."
    g = lambda n: ckpt[pre + n]  # noqa: E731
    qkv = np.concatenate([g(f"self_attn.{p}_proj.weight") for p in "qkv"])
    norms = (g("self_attn.q_norm.weight"), g("self_attn.k_norm.weight"))
    want_attn = attention(x, qkv, g("self_attn.o_proj.weight"), 16, 2, 8, *norms)
    gate_up = np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")])
    want_mlp = mlp(x, gate_up, g("mlp.down_proj.weight"))
    want_act = silu(x @ g("mlp.gate_proj.weight").T) * (x @ g("mlp.up_proj.weight").T)
    plans = all_ranks(config, tp)
    ranks = load_ranks(plans, ckpt)
    attn_parts, mlp_parts = [], []
    for p, f in zip(plans, ranks):
        lc = p.rank_config.config
        attn_parts.append(attention(x, f[(1, "qkv")], f[(1, "o_proj")], lc.num_attention_heads,
                                    lc.num_key_value_heads, 8, f[(1, "q_norm")], f[(1, "k_norm")]))
        mlp_parts.append(mlp(x, f[(1, "gate_up")], f[(1, "down")]))
        m = lc.intermediate_size
        gu = x @ f[(1, "gate_up")].T
        lo, hi = p.rank_config.intermediate
        np.testing.assert_allclose(silu(gu[:, :m]) * gu[:, m:], want_act[:, lo:hi], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sum(attn_parts), want_attn, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sum(mlp_parts), want_mlp, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tp", (2, 4))
def test_one_moe_expert_shards_sum_to_the_expert(tp):
    config = tiny_moe()
    ckpt = random_checkpoint(config, seed=5)
    x = np.random.default_rng(6).standard_normal((5, config.hidden_size))
    plans = all_ranks(config, tp)
    ranks = load_ranks(plans, ckpt)
    h, e_count = config.hidden_size, config.num_experts
    for e in (0, e_count - 1):
        ep = f"model.layers.1.mlp.experts.{e}."
        want = mlp(x, np.concatenate([ckpt[ep + "gate_proj.weight"], ckpt[ep + "up_proj.weight"]]),
                   ckpt[ep + "down_proj.weight"])
        parts = []
        for p, f in zip(plans, ranks):
            m = p.rank_config.moe_intermediate_size
            parts.append(mlp(x, f[(1, "experts_gate_up")].reshape(e_count, 2 * m, h)[e],
                             f[(1, "experts_down")].reshape(e_count, h, m)[e]))
        np.testing.assert_allclose(sum(parts), want, rtol=1e-10, atol=1e-12)


# ---- FP8 checkpoints: the scale blocks covering a shard -----------------------------------------------------------
def test_fp8_shards_dequantize_from_their_scale_blocks():
    """16x16 blocks, tp 4: 24 intermediate columns, 24 q rows and 8 kv rows per rank, so shards start half-way
    into a block (offset 8); dequantizing a shard from scale_inv[scale_index] at scale_offset equals the slice of the
    dequantized whole tensor."""
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    config = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=8, quantization_config=quant)
    table = Qwen3Model.weight_table(config)
    rng = np.random.default_rng(7)
    files = {}
    for w in table:
        if w.quantized:
            q, s = quantize_blockwise(rng.standard_normal(w.shape), w.block)
            files[w.name] = (q, s, dequantize_blockwise(q, s, w.block, np.float32))
    offsets = set()
    for tp in (2, 4):
        for p in all_ranks(config, tp):
            for sh in p.shards:
                if sh.name not in files:
                    assert sh.block is None and sh.scale_index is None, sh.name
                    continue
                q, s, full = files[sh.name]
                (bo, bi), (r0, c0) = sh.block, sh.scale_offset
                offsets.add((r0, c0))
                rows, cols = sh.shape
                scale = np.repeat(np.repeat(s[sh.scale_index], bo, 0), bi, 1)[r0:r0 + rows, c0:c0 + cols]
                got = (sh.take(q).astype(np.float32) * scale).astype(np.float32)
                np.testing.assert_array_equal(got, full[sh.index], err_msg=sh.name)
    assert {(8, 0), (0, 8)} <= offsets  # shards starting mid-block in rows and in columns were exercised


# ---- (d) errors name the field ------------------------------------------------------------------------------------
BAD = [
    (lambda: tiny_qwen3(), 0, "tensor_parallel_size must be a positive integer"),
    (lambda: tiny_qwen3(), -2, "tensor_parallel_size must be a positive integer"),
    (lambda: tiny_qwen3(), 2.0, "tensor_parallel_size must be a positive integer"),
    (lambda: tiny_qwen3(), True, "tensor_parallel_size must be a positive integer"),
    (lambda: tiny_qwen3(heads=16, kv_heads=2), 3, r"num_attention_heads \(16\) is not divisible by "
                                                  r"tensor_parallel_size 3.*allows: 1, 2, 4, 8, 16\)"),
    (lambda: preset("14b"), 16, r"num_attention_heads \(40\).*allows: 1, 2, 4, 8\)"),
    (lambda: tiny_qwen3(heads=12, kv_heads=6), 4, r"num_key_value_heads \(6\) and tensor_parallel_size 4"),
    (lambda: tiny_qwen3().replace(intermediate_size=120), 16, r"intermediate_size \(120\) is not divisible"),
    (lambda: tiny_qwen3().replace(intermediate_size=96), 8, r"intermediate_size \(96\) / tensor_parallel_size 8 = 12"
                                                             r" is not a multiple of 8: the GEMM/GEMV"),
    (lambda: tiny_moe().replace(moe_intermediate_size=24), 2, r"moe_intermediate_size \(24\) / tensor_parallel_size 2"
                                                              r" = 12 is not a multiple of 8: the MoE expert kernels"),
    (lambda: preset("moe-tiny"), 8, r"num_attention_heads \(4\)"),
    (lambda: preset("30b-a3b", 2, mlp_only_layers=(0,), intermediate_size=6000), 16, r"intermediate_size \(6000\)"),
    (lambda: preset("30b-a3b", 2, moe_intermediate_size=776), 16, r"moe_intermediate_size \(776\) is not divisible"),
]


@pytest.mark.parametrize("make,tp,message", BAD)
def test_errors_name_the_field(make, tp, message):
    config = make()
    with pytest.raises(ValueError, match=message):
        rank_config(config, tp, 0)
    with pytest.raises(ValueError, match=message):
        shard_plan(config, None, tp, 0)
    with pytest.raises(ValueError, match=message):
        check_tp(config, tp, 64)


def test_unused_dimensions_are_not_checked():
    # a MoE model whose every layer is sparse never uses intermediate_size: 6000 / 16 is no obstacle
    config = preset("30b-a3b", 2, intermediate_size=6000)
    assert rank_config(config, 16, 0).intermediate is None
    check_tp(config, 16, 16)


def test_rank_and_gpu_count_errors():
    config = tiny_qwen3()
    for rank in (-1, 4, 1.0, None):
        with pytest.raises(ValueError, match=r"rank must be an integer in 0\.\.3 \(tensor_parallel_size 4\)"):
            shard_plan(config, None, 4, rank)
    for gpus in (0, 2, 3):
        with pytest.raises(ValueError, match=f"tensor_parallel_size 4 needs 4 GPUs .* num_gpus is {gpus}"):
            check_tp(config, 4, gpus)
    check_tp(config, 4, 4)
    with pytest.raises(ValueError, match="num_gpus must be a non-negative integer"):
        check_tp(config, 1, -1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        check_tp(config, 0, 8)
    check_tp(config, 8, 8)


def test_take_checks_the_file_shape():
    shard = shard_plan(tiny_qwen3(), None, 2, 1)["model.layers.0.mlp.down_proj.weight"]
    assert shard.take(np.zeros((64, 128))).shape == (64, 64)
    with pytest.raises(ValueError, match=r"down_proj.weight: expected the file tensor of shape \(64, 128\)"):
        shard.take(np.zeros((128, 64)))


def test_a_field_without_a_rule_is_an_error():
    class Extra(LlamaModel):
        LAYER_WEIGHTS = LlamaModel.LAYER_WEIGHTS + (("mlp.extra_proj.weight", "extra", None),)

    with pytest.raises(ValueError, match=r"no tensor-parallel rule for field 'extra' \(checkpoint tensor "
                                         r"model\.layers\.0\.mlp\.extra_proj\.weight\)"):
        shard_plan(tiny_llama(), Extra, 3, 0)


# ---- the checkers fail on planted bugs ----------------------------------------------------------------------------
def corrupt(plans, rank, name, **changes):
    """A copy of the plans with one shard of one rank changed."""
    out = list(plans)
    p = plans[rank]
    shards = tuple(dataclasses.replace(s, **changes) if s.name == name else s for s in p.shards)
    out[rank] = dataclasses.replace(p, shards=shards)
    return out


def test_checkers_catch_planted_bugs():
    config = tiny_qwen3()
    ckpt = random_checkpoint(config, seed=8)
    ids = np.arange(0, 1000, 97)
    want = reference_forward(config, ckpt, ids)
    q, k, up = (f"model.layers.1.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"))
    o, emb = "model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"
    for tp, bug in [
        (2, dict(rank=1, name=q, rows=(0, 64))),  # rank 1 takes rank 0's q heads
        (4, dict(rank=2, name=k, rows=(0, 8))),  # a replicated kv head: the wrong group's
        (2, dict(rank=0, name=up, rows=(64, 128))),  # up rows of the other rank: gate/up pairing broken
        (2, dict(rank=1, name=o, cols=(0, 64))),  # o columns that do not match the rank's q heads
        (4, dict(rank=3, name=emb, rows=(512, 744), dest_rows=(0, 232))),  # the last rank's vocabulary shifted
    ]:
        plans = corrupt(all_ranks(config, tp), **bug)
        with pytest.raises(AssertionError):
            assert_exact_cover(config, plans)
        with pytest.raises(AssertionError):
            assert_reassembles(config, plans, ckpt)
        with pytest.raises(AssertionError):
            got = tp_forward(config, plans, load_ranks(plans, ckpt), ids)
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # destinations: gate and up rows swapped on one rank covers the same rows (tiling holds) but breaks the forward
    plans = all_ranks(config, 2)
    gate = "model.layers.0.mlp.gate_proj.weight"
    plans = corrupt(corrupt(plans, 0, gate, dest_rows=(64, 128)), 0, gate.replace("gate_proj", "up_proj"),
                    dest_rows=(0, 64))
    assert_dest_tiles(config, plans[0])
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(tp_forward(config, plans, load_ranks(plans, ckpt), ids), want, rtol=1e-9)
    # a destination overlap leaves rows unfilled: both the tiling check and the loader's NaN check see it
    plans = corrupt(all_ranks(config, 2), 1, "model.layers.0.self_attn.v_proj.weight", dest_rows=(64, 72))
    with pytest.raises(AssertionError):
        assert_dest_tiles(config, plans[1])
    with pytest.raises(AssertionError):
        load_ranks(plans, ckpt)
