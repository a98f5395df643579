"""The hybrid Gated DeltaNet models (Qwen3.5 / 3.6 / 3.8, their text-only export, Qwen3-Next) on the NumPy backend:
configs, the three checkpoint layouts, and the forward pass against the independent float64 reference
(tests/qwen3_5_reference.py) through one prefill, chunked prefill with the state carried, decode steps and packed
batches; then the engine end to end (state slots, preemption)."""
import json

import numpy as np
import pytest

from qwen3_5_reference import TINY_TEXT_CONFIG, reference_logits, write_random_folder
from qwen3_reference import rel_err_rows
from xserv.engine.batch import SeqChunk, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.engine.state_cache import StateCache, slot_bytes
from xserv.models.base import CausalLM
from xserv.models.config import HYBRID_PRESETS, preset_dict
from xserv.models.qwen3_5 import HybridModel, state_layout
from xserv.models.qwen3_5_config import Qwen3_5Config
from xserv.models.random_checkpoint import make_test_model
from xserv.models.registry import config_from_dict, load_model

BLOCK = 4  # small blocks: sequences span several, block tables get exercised
# The tiny config at the real per-head shapes (head_dim 256 with RoPE on 64, GDN heads of 128), so that the same
# folders run the CUDA kernels on a GPU.
TEXT = {**TINY_TEXT_CONFIG, "head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 512, "initializer_range": 0.05,
        "rope_parameters": {**TINY_TEXT_CONFIG["rope_parameters"], "rope_theta": 10_000_000.0,
                            "mrope_section": [11, 11, 10]}}
# Runs of one model that round differently (chunks vs one prefill, a batch vs alone): the bf16 roundings of 4 layers
# and the head, measured at most ~1e-2 relative L2 per row; a state not carried or a sequence reading another's slot
# moves rows by > 0.1.
REF_TOL = 2e-2


def assert_as_close_as_bf16(ours, folder, ids):
    """The model's logits are as close to the float64 reference as the reference's own run rounded at transformers'
    bf16 points is (what "correct" means for a bf16 model): per-row relative L2 error within 1.5x of that run's,
    whose own size (1-3e-2 here) is set by the random weights. A dropped gate, norm weight or state is 5-50x that."""
    exact = reference_logits(folder, ids)
    bf16_run = rel_err_rows(reference_logits(folder, ids, bf16_points=True), exact)
    err = rel_err_rows(ours, exact)
    assert err.mean() <= 1.5 * bf16_run.mean() and err.max() <= 1.5 * bf16_run.max(), (err, bf16_run)


def load(folder):
    return load_model(folder, "cpu", progress=False, max_positions=1024)


def caches(model, num_blocks=128, slots=4):
    kv = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), num_blocks, "cpu", model.dtype)
    kv.state = StateCache(model.state_layout, slots, "cpu")
    return kv


def run(model, cache, chunks):
    return model.forward(make_batch(chunks, BLOCK, "cpu"), cache).numpy().astype(np.float64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_folder(tmp_path_factory.mktemp("hybrid") / "qwen3_5", TEXT, layout="qwen3_5", extras=True,
                               bf16_values=True)


@pytest.fixture(scope="module")
def model(folder):
    return load(folder)


# ---- configs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_hybrid_presets(name):
    c = config_from_dict(preset_dict(name))
    assert isinstance(c, Qwen3_5Config) and c.head_dim == 256 and c.rotary_dim == 64
    assert c.vocab_size == 248320 and c.eos_token_id == [248044]
    assert len(c.attention_layers) * 4 == c.num_hidden_layers and c.attention_layers[0] == 3
    assert type(c).from_dict(c.to_dict()) == c and config_from_dict(c.to_dict()) == c
    assert c.tie_word_embeddings == (name in ("qwen3.5-tiny", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b"))


def test_real_state_sizes():
    """ARCHITECTURE.md section 8's table: GDN state per sequence (conv window bf16 + fp32 SSM state)."""
    for name, mib in (("qwen3.5-0.8b", 18.6), ("qwen3.5-9b", 49.1), ("qwen3.6-27b", 146.8)):
        c = config_from_dict(preset_dict(name))
        assert abs(slot_bytes(state_layout(c)) / 2**20 - mib) < 0.1, (name, slot_bytes(state_layout(c)) / 2**20)


def test_layer_schedule_and_errors():
    d = preset_dict("qwen3.5-tiny")
    del d["text_config"]["layer_types"]
    d["text_config"]["full_attention_interval"] = 2
    assert config_from_dict(d).layer_types == ("linear_attention", "full_attention") * 2
    bad = json.loads(json.dumps(d))
    bad["text_config"]["layer_types"] = ["linear_attention", "sliding"] * 2
    with pytest.raises(ValueError, match="layer_types"):
        config_from_dict(bad)
    with pytest.raises(ValueError, match="not supported yet"):
        config_from_dict({**d, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                       "activation_scheme": "dynamic", "fmt": "e4m3"}})
    nxt = {**d["text_config"], "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "num_experts": 512}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        config_from_dict(nxt)
    gated = json.loads(json.dumps(d))
    gated["text_config"]["attn_output_gate"] = False
    with pytest.raises(ValueError, match="attn_output_gate"):
        config_from_dict(gated)


# ---- loading -----------------------------------------------------------------------------------------------------
def test_loads_and_skips_the_vision_tower(folder, monkeypatch):
    from xserv.models.checkpoint import CheckpointReader

    read = []
    original = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read.append(name) or original(self, name))
    m = load(folder)
    assert isinstance(m, CausalLM) and type(m) is HybridModel
    assert read and not [n for n in read if n.startswith(("model.visual.", "mtp."))]
    c = m.config
    assert m.kv_layout == (1, c.num_key_value_heads, 256)
    assert m.layers[0].in_proj.shape == (c.gdn_proj_size, c.hidden_size)
    assert m.layers[3].qkvg.shape == (c.qkvg_size, c.hidden_size)
    assert m.layers[0].A_log.dtype == np.float32 and m.layers[0].dt_bias.dtype == np.float32


@pytest.mark.parametrize("layout", ["qwen3_5_text", "qwen3_next"])
def test_layouts_give_the_same_model(folder, model, layout, tmp_path):
    """The text-only export and Qwen3-Next's grouped projections load into the same fields (bit for bit)."""
    other = load(write_random_folder(tmp_path / layout, TEXT, layout=layout, bf16_values=True))
    for a, b in zip(model.weight_tensors(), other.weight_tensors()):
        assert a.shape == b.shape and np.array_equal(a.numpy(), b.numpy())


# ---- the forward against the float64 reference ----------------------------------------------------------------------
def test_prefill_matches_reference(folder, model):
    ids = list(np.random.default_rng(1).integers(0, TEXT["vocab_size"], 70))
    ours = run(model, caches(model), [SeqChunk(ids, 0, list(range(18)), "all", 0)])
    assert_as_close_as_bf16(ours, folder, ids)


def test_chunks_decode_and_batches_carry_the_state(folder, model):
    """One prefill = chunks of 1, 5 and 64 tokens with the state carried = a prefill then decode steps, and a packed
    batch of fresh and continuing sequences gives each one's own logits."""
    rng = np.random.default_rng(2)
    ids = list(rng.integers(0, TEXT["vocab_size"], 75))
    table = list(range(20))
    whole = run(model, caches(model), [SeqChunk(ids, 0, table, "all", 1)])
    cache = caches(model)
    pieces, start = [], 0
    for n in (1, 5, 64, 5):
        pieces.append(run(model, cache, [SeqChunk(ids[start:start + n], start, table, "all", 1)]))
        start += n
    assert rel_err_rows(np.concatenate(pieces), whole).max() < REF_TOL
    # two sequences in one batch: a continuing one (its first 40 tokens cached) and a fresh one, other slots
    other = list(rng.integers(0, TEXT["vocab_size"], 30))
    cache = caches(model)
    run(model, cache, [SeqChunk(ids[:40], 0, table, "none", 3)])
    both = run(model, cache, [SeqChunk(ids[40:], 40, table, "all", 3),
                              SeqChunk(other, 0, list(range(20, 40)), "all", 0)])
    alone = run(model, caches(model), [SeqChunk(other, 0, list(range(20, 40)), "all", 2)])
    assert rel_err_rows(both[:35], whole[40:]).max() < REF_TOL
    assert rel_err_rows(both[35:], alone).max() < REF_TOL


def test_make_test_model_writes_the_release_layout(tmp_path):
    out = make_test_model("qwen3.5-tiny", tmp_path / "tiny")
    names = json.loads((out / "config.json").read_text())
    assert names["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in names
    from xserv.models.checkpoint import CheckpointReader
    with CheckpointReader(out) as r:
        tensors = r.names()
    assert any(n.startswith("model.visual.blocks.0.") for n in tensors)
    assert "mtp.fc.weight" in tensors and "model.language_model.layers.3.self_attn.q_proj.weight" in tensors
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [248046, 248044]
    m = load(out)
    ids = [248045, 872, 198, 9419, 0]
    assert_as_close_as_bf16(run(m, caches(m), [SeqChunk(ids, 0, [0, 1], "all", 0)]), out, ids)


def test_limit_logits_cuts_the_padding_rows(folder):
    """The head keeps the tokenizer's rows only; a tied head stays the embedding table (counted once)."""
    m = load(folder)
    before, params = m.weight_bytes(), m.num_parameters()
    ids = [3, 1, 4, 1, 5]
    full = run(m, caches(m), [SeqChunk(ids, 0, [0, 1], "all", 0)])
    assert m.limit_logits(500) == 500 and m.logits_width == 500
    cut = run(m, caches(m), [SeqChunk(ids, 0, [0, 1], "all", 0)])
    # the same sums over the hidden size; a BLAS may order them by the output width: float32 roundings apart
    assert cut.shape == (5, 500) and np.allclose(cut, full[:, :500], rtol=1e-5, atol=1e-6)
    assert m.weight_bytes() <= before and m.num_parameters() <= params
    with pytest.raises(ValueError, match="num_tokens"):
        m.limit_logits(0)


def test_a_tied_head_is_counted_once(tmp_path):
    m = load(write_random_folder(tmp_path / "tied", {**TEXT, "tie_word_embeddings": True}, layout="qwen3_5"))
    assert m.lm_head is m.embed
    bytes_before = m.weight_bytes()
    m.limit_logits(500)
    assert m.weight_bytes() == bytes_before
