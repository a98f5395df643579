"""Qwen3Model on the NumPy backend: loading, and the forward pass against an independent dense implementation,
through one prefill, chunked prefill, decode steps and packed batches."""
import json
import shutil

import numpy as np
import pytest

from qwen3_reference import dense_qwen3_logits, perturbed_model_dir, rel_err_rows, tiny_model_dir  # noqa: F401
from xserv.engine.batch import SeqChunk, build_host_arrays, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.models.checkpoint import CheckpointReader
from xserv.models.config import Qwen3Config
from xserv.models.qwen3 import Qwen3Model

BLOCK = 4  # small blocks: sequences span several, block tables get exercised


def load(folder):
    config = Qwen3Config.from_pretrained(folder)
    return Qwen3Model.from_checkpoint(config, CheckpointReader(folder), "cpu", progress=False, max_positions=512)


def make_cache(model, num_blocks=64):
    c = model.config
    return KVCache(KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BLOCK), num_blocks, "cpu",
                   model.dtype)


@pytest.fixture(scope="module")
def perturbed(perturbed_model_dir):  # noqa: F811
    return load(perturbed_model_dir)


def run(model, cache, chunks):
    return model.forward(make_batch(chunks, BLOCK, "cpu"), cache).numpy().copy()


def test_loads_tiny_with_fused_weights(tiny_model_dir):  # noqa: F811
    model = load(tiny_model_dir)
    c = model.config
    assert len(model.layers) == c.num_hidden_layers
    layer = model.layers[0]
    assert layer.qkv.shape == (c.q_size + 2 * c.kv_size, c.hidden_size)
    assert layer.gate_up.shape == (2 * c.intermediate_size, c.hidden_size)
    assert model.lm_head is model.embed  # tied
    reader = CheckpointReader(tiny_model_dir)
    k = np.asarray(reader.get("model.layers.1.self_attn.k_proj.weight"), np.float32)
    np.testing.assert_array_equal(layer_rows(model.layers[1].qkv, c.q_size, c.q_size + c.kv_size), k)
    up = np.asarray(reader.get("model.layers.0.mlp.up_proj.weight"), np.float32)
    np.testing.assert_array_equal(layer_rows(layer.gate_up, c.intermediate_size, 2 * c.intermediate_size), up)


def layer_rows(t, start, stop):
    return np.asarray(t.numpy()[start:stop], np.float32)


def test_wrong_checkpoint_lists_every_problem(tiny_model_dir, tmp_path):  # noqa: F811
    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load(folder)
    msg = str(e.value)
    assert "model.layers.2.mlp.down_proj.weight" in msg and "missing" in msg
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "wrong shape" in msg


def test_matches_dense_reference(perturbed, perturbed_model_dir, rng):  # noqa: F811
    ids = rng.integers(0, perturbed.config.vocab_size, 23).tolist()
    cache = make_cache(perturbed)
    table = list(range(7, 1, -1))  # non-contiguous, descending blocks
    logits = run(perturbed, cache, [SeqChunk(ids, 0, table, "all")])
    ref = dense_qwen3_logits(perturbed_model_dir, ids)
    err = rel_err_rows(logits, ref)
    # bf16 activations against a float64 reference; a wrong rotation, head mapping or norm gives errors > 0.2
    assert err.max() < 3e-2, err


def test_prefix_chunks_and_decode_match_one_prefill(perturbed, rng):
    ids = rng.integers(0, perturbed.config.vocab_size, 19).tolist()
    table = [5, 0, 9, 3, 7]
    full = run(perturbed, make_cache(perturbed), [SeqChunk(ids, 0, table, "all")])

    cache = make_cache(perturbed)  # chunked prefill: 6 + 6 + 7 tokens
    chunked = np.concatenate([run(perturbed, cache, [SeqChunk(ids[s:e], s, table, "all")])
                              for s, e in ((0, 6), (6, 12), (12, 19))])
    cache = make_cache(perturbed)  # prefill of a prefix, then one decode step per token
    pieces = [run(perturbed, cache, [SeqChunk(ids[:8], 0, table, "all")])]
    pieces += [run(perturbed, cache, [SeqChunk(ids[p:p + 1], p, table, "last")]) for p in range(8, 19)]
    stepped = np.concatenate(pieces)
    # The paths differ only in float32 summation order (GEMMs of other M, the decode vs prefill attention), which
    # flips a few bf16 roundings of activations; the float32 residual stream carries those flips on (a bf16 one
    # mostly absorbed them), giving ~5e-3. A wrong page, position or causal offset gives > 0.1.
    assert rel_err_rows(chunked, full).max() < 1e-2
    assert rel_err_rows(stepped, full).max() < 1e-2


def test_packed_batch_matches_sequences_alone(perturbed, rng):
    v = perturbed.config.vocab_size
    a, b, c = (rng.integers(0, v, n).tolist() for n in (9, 1, 14))
    tables = [[0, 1, 2], [3], [4, 5, 6, 7]]
    alone = [run(perturbed, make_cache(perturbed), [SeqChunk(s, 0, t, "all")]) for s, t in zip((a, b, c), tables)]

    cache = make_cache(perturbed)
    # a fully, c's first 5 tokens, then a mixed batch: b new, c's remaining 9 (cached prefix), a one decode token
    run(perturbed, cache, [SeqChunk(a[:8], 0, tables[0], "none"), SeqChunk(c[:5], 0, tables[2], "none")])
    batch = make_batch([SeqChunk(b, 0, tables[1], "all"), SeqChunk(c[5:], 5, tables[2], "all"),
                        SeqChunk(a[8:], 8, tables[0], "last")], BLOCK, "cpu")
    assert batch.max_q_len == 9 and batch.logits_per_seq == [(0, 1), (1, 9), (10, 1)]
    mixed = perturbed.forward(batch, cache).numpy()
    assert rel_err_rows(mixed[0:1], alone[1]).max() < 1e-3
    assert rel_err_rows(mixed[1:10], alone[2][5:]).max() < 1e-3
    assert rel_err_rows(mixed[10:11], alone[0][8:]).max() < 1e-3


def test_batch_metadata():
    h = build_host_arrays([SeqChunk([5, 6, 7], 2, [4, 1], "last"), SeqChunk([8], 5, [0, 2], "all")], 4)
    assert h["positions"].tolist() == [2, 3, 4, 5]
    assert h["slot_mapping"].tolist() == [4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0, 2 * 4 + 1]
    assert h["cu_seqlens_q"].tolist() == [0, 3, 4]
    assert h["kv_lens"].tolist() == [5, 6]
    assert h["logits_rows"].tolist() == [2, 3]
    assert h["max_q_len"] == 3 and h["max_kv_len"] == 6
    with pytest.raises(ValueError, match="blocks"):
        build_host_arrays([SeqChunk([1, 2, 3], 4, [0], "last")], 4)
