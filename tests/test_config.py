import json
import math

import numpy as np
import pytest

from xserv.models.config import PRESET_NAMES, Qwen3Config, preset_dict, presets_dir


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_load(name):
    c = Qwen3Config.preset(name)
    assert c.q_size == c.num_attention_heads * c.head_dim
    assert c.kv_size == c.num_key_value_heads * c.head_dim
    assert c.head_dim in (64, 128)
    assert c.vocab_size == 151936
    assert c.dtype == "bfloat16"
    assert 151645 in c.eos_token_id
    # round trip through the HF dict
    assert Qwen3Config.from_dict(c.to_dict()) == c


def test_real_sizes():
    c = Qwen3Config.preset("0.6b")
    assert (c.hidden_size, c.head_dim, c.q_size) == (1024, 128, 2048)  # head_dim != hidden / heads
    assert c.tie_word_embeddings
    assert abs(c.num_parameters() / 1e9 - 0.596) < 0.01
    c8 = Qwen3Config.preset("8b")
    assert not c8.tie_word_embeddings and "lm_head.weight" in c8.weight_shapes()
    assert abs(c8.num_parameters() / 1e9 - 8.19) < 0.01


def test_weight_shapes_tiny():
    c = Qwen3Config.preset("tiny")
    shapes = c.weight_shapes()
    assert "lm_head.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (256, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 256)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (64,)
    assert len(shapes) == 1 + 11 * 2 + 1
    assert sum(math.prod(s) for s in shapes.values()) == c.num_parameters()


def test_head_dim_default_when_absent():
    d = preset_dict("0.6b")
    del d["head_dim"]
    assert Qwen3Config.from_dict(d).head_dim == 1024 // 16


def test_dtype_keys():
    d = preset_dict("tiny")
    del d["torch_dtype"]
    d["dtype"] = "float16"
    assert Qwen3Config.from_dict(d).dtype == "float16"
    d["dtype"] = "int8"
    with pytest.raises(ValueError, match="int8"):
        Qwen3Config.from_dict(d)


def test_eos_list_and_from_files(tmp_path):
    d = preset_dict("tiny")
    d["eos_token_id"] = [151645, 151643]
    (tmp_path / "config.json").write_text(json.dumps(d))
    c = Qwen3Config.from_pretrained(tmp_path)
    assert c.eos_token_id == [151645, 151643]
    assert Qwen3Config.from_json(tmp_path / "config.json") == c


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "LlamaForCausalLM"])
def test_unsupported_architecture(arch):
    d = preset_dict("0.6b")
    d["architectures"] = [arch]
    with pytest.raises(ValueError, match=f"unsupported architecture {arch}.*xserv supports Qwen3ForCausalLM"):
        Qwen3Config.from_dict(d)


def test_bad_values():
    d = preset_dict("tiny")
    with pytest.raises(ValueError, match="attention_bias"):
        Qwen3Config.from_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="multiple of"):
        Qwen3Config.from_dict({**d, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size"):
        Qwen3Config.from_dict({**d, "hidden_size": 0})
    with pytest.raises(ValueError, match="vocab_size"):
        Qwen3Config.from_dict({k: v for k, v in d.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="linear"):
        Qwen3Config.from_dict({**d, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="dynamic"):
        Qwen3Config.from_dict({**d, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="factor"):
        Qwen3Config.from_dict({**d, "rope_scaling": {"type": "yarn"}})


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen3Config.from_pretrained(tmp_path)


def test_frozen_and_hashable():
    c = Qwen3Config.preset("tiny")
    with pytest.raises(Exception):
        c.hidden_size = 5
    hash(c)


def test_yarn():
    d = preset_dict("8b")
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    c = Qwen3Config.from_dict(d)
    assert c.rope_scaling["rope_type"] == "yarn"
    y = c.yarn_parameters()
    assert y["factor"] == 4.0 and y["original_max_position_embeddings"] == 32768
    assert y["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
    base = Qwen3Config.preset("8b").rope_inv_freq()
    inv = c.rope_inv_freq()
    assert inv.shape == base.shape == (64,)
    # high-frequency dims extrapolate (unchanged), low-frequency dims are interpolated by `factor`
    assert inv[0] == base[0]
    np.testing.assert_allclose(inv[-1], base[-1] / 4.0, rtol=1e-6)
    assert np.all(inv <= base)
    assert Qwen3Config.preset("8b").rope_attention_factor == 1.0
    np.testing.assert_allclose(base, 1.0 / 1e6 ** (np.arange(0, 128, 2) / 128), rtol=1e-6)


def test_presets_dir():
    assert (presets_dir() / "tokenizer" / "tokenizer.json").is_file()


def test_yarn_without_original_max_position_embeddings():
    d = preset_dict("0.6b")
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    c = Qwen3Config.from_dict(d)
    assert c.rope_scaling["original_max_position_embeddings"] == 40960
    assert c.yarn_parameters()["original_max_position_embeddings"] == 40960


def test_rope_inv_freq_matches_ops_table():
    from xserv.ops.rope import rope_cos_sin_table

    d = preset_dict("8b")
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    c = Qwen3Config.from_dict(d)
    table = rope_cos_sin_table(c.head_dim, 3, c.rope_theta, c.rope_scaling)
    cos1 = np.cos(c.rope_inv_freq().astype(np.float64)) * c.rope_attention_factor
    np.testing.assert_allclose(table[1, : c.head_dim // 2], cos1, rtol=1e-5)
