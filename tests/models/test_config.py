import json
import math

import pytest

from xserv.models.config import HYBRID_PRESETS, PRESET_NAMES, preset_dict, presets_dir
from xserv.models.llama import LlamaConfig, LlamaModel
from xserv.models.qwen3 import Qwen3Config, Qwen3Model
from xserv.models.registry import ARCHITECTURES, config_from_dict, config_from_pretrained, model_class


def shapes_of(config):
    return {w.name: w.shape for w in model_class(config).weight_table(config)}


def num_parameters(config):
    return sum(math.prod(s) for s in shapes_of(config).values())


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n not in HYBRID_PRESETS])  # (tests/models/test_qwen3_5_model.py)
def test_presets_load(name):
    c = config_from_dict(preset_dict(name))
    assert isinstance(c, LlamaConfig if name.startswith("llama3") else Qwen3Config)
    assert c.q_size == c.num_attention_heads * c.head_dim
    assert c.kv_size == c.num_key_value_heads * c.head_dim
    assert c.head_dim in (64, 128)
    assert c.vocab_size == 151936  # the bundled Qwen3 tokenizer's, for the Llama presets too
    assert c.dtype == "bfloat16"
    assert 151645 in c.eos_token_id
    # round trip through the HF dict
    assert type(c).from_dict(c.to_dict()) == c
    assert config_from_dict(c.to_dict()) == c


def test_real_sizes():
    c = Qwen3Config.preset("0.6b")
    assert (c.hidden_size, c.head_dim, c.q_size) == (1024, 128, 2048)  # head_dim != hidden / heads
    assert c.tie_word_embeddings
    assert abs(num_parameters(c) / 1e9 - 0.596) < 0.01
    c8 = Qwen3Config.preset("8b")
    assert not c8.tie_word_embeddings and "lm_head.weight" in shapes_of(c8)
    assert abs(num_parameters(c8) / 1e9 - 8.19) < 0.01
    # Llama 3.1 8B has 8.03e9 parameters with its 128256-token vocabulary; the preset carries Qwen3's 151936
    l8 = LlamaConfig.preset("llama3-8b")
    assert l8.head_dim == 128 and "head_dim" not in preset_dict("llama3-8b")
    assert num_parameters(l8) - 2 * (151936 - 128256) * 4096 == pytest.approx(8.03e9, rel=2e-3)
    l1 = LlamaConfig.preset("llama3-1b")  # Llama 3.2 1B: 1.236e9 with 128256 tokens, tied
    assert l1.tie_word_embeddings and l1.head_dim == 64
    assert num_parameters(l1) - (151936 - 128256) * 2048 == pytest.approx(1.236e9, rel=2e-3)


def test_weight_table_tiny():
    c = Qwen3Config.preset("tiny")
    shapes = shapes_of(c)
    assert "lm_head.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (256, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 256)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (64,)
    assert len(shapes) == 1 + 11 * 2 + 1
    table = Qwen3Model.weight_table(c)
    k = next(w for w in table if w.name == "model.layers.1.self_attn.k_proj.weight")
    assert (k.layer, k.field, k.rows) == (1, "qkv", (256, 256 + 128))
    up = next(w for w in table if w.name == "model.layers.0.mlp.up_proj.weight")
    assert (up.field, up.rows) == ("gate_up", (192, 384))
    assert {w.name for w in table if w.is_norm} == {f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")} | {"model.norm.weight"}


def test_llama_weight_table_has_no_qk_norm():
    c = LlamaConfig.preset("llama3-tiny", tie_word_embeddings=False)
    shapes = shapes_of(c)
    assert len(shapes) == 1 + 9 * 2 + 2
    assert not any("q_norm" in n or "k_norm" in n for n in shapes)
    assert shapes["lm_head.weight"] == (151936, 128)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (64, 128)  # 1 kv head x head_dim 64


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


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "MistralForCausalLM"])
def test_registry_names_unknown_architecture_and_known_ones(arch):
    d = preset_dict("0.6b")
    d["architectures"] = [arch]
    with pytest.raises(ValueError, match=f"unsupported architecture {arch}: xserv supports "
                                         f"LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        config_from_dict(d)


def test_registry_lookups(tmp_path):
    assert ARCHITECTURES["Qwen3ForCausalLM"] == (Qwen3Config, Qwen3Model)
    assert ARCHITECTURES["LlamaForCausalLM"] == (LlamaConfig, LlamaModel)
    for name, (config_cls, model_cls) in ARCHITECTURES.items():
        assert config_cls.ARCHITECTURE == name
    assert model_class(Qwen3Config.preset("tiny")) is Qwen3Model
    assert model_class(LlamaConfig.preset("llama3-tiny")) is LlamaModel
    # model_type alone (no 'architectures') is enough
    d = {k: v for k, v in preset_dict("llama3-tiny").items() if k != "architectures"}
    assert isinstance(config_from_dict(d), LlamaConfig)
    with pytest.raises(ValueError, match="model_type 'gpt2'.*LlamaForCausalLM, Qwen3ForCausalLM"):
        config_from_dict({**d, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="names no architecture"):
        config_from_dict({k: v for k, v in d.items() if k != "model_type"})
    with pytest.raises(ValueError, match="architectures"):
        config_from_dict({**d, "architectures": []})
    with pytest.raises(ValueError, match="not a registered model config"):
        model_class(object())
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("llama3-tiny")))
    assert config_from_pretrained(tmp_path) == LlamaConfig.preset("llama3-tiny")


def test_config_class_rejects_the_other_architecture():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3Config"):
        Qwen3Config.from_dict(preset_dict("llama3-tiny"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*LlamaConfig"):
        LlamaConfig.from_dict(preset_dict("tiny"))


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
    with pytest.raises(ValueError, match="'llama3'.*supports none or 'yarn'"):
        Qwen3Config.from_dict({**d, "rope_scaling": preset_dict("llama3-1b")["rope_scaling"]})
    with pytest.raises(ValueError, match="hidden_act"):
        Qwen3Config.from_dict({**d, "hidden_act": "gelu"})


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen3Config.from_pretrained(tmp_path)


def test_frozen_and_hashable():
    c = Qwen3Config.preset("tiny")
    with pytest.raises(Exception):
        c.hidden_size = 5
    hash(c)


def test_yarn_and_context_length():
    d = preset_dict("8b")
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    c = Qwen3Config.from_dict(d)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert c.context_length == 4 * 32768
    assert Qwen3Config.preset("8b").context_length == 40960


def test_presets_dir():
    assert (presets_dir() / "tokenizer" / "tokenizer.json").is_file()


def test_yarn_without_original_max_position_embeddings():
    d = preset_dict("0.6b")
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    c = Qwen3Config.from_dict(d)
    assert c.rope_scaling["original_max_position_embeddings"] == 40960
    assert c.context_length == 2 * 40960


def test_transformers5_rope_parameters_layout():
    d = preset_dict("llama3-1b")
    scaling, theta = d.pop("rope_scaling"), d.pop("rope_theta")
    d["rope_parameters"] = {**scaling, "rope_theta": theta}
    assert LlamaConfig.from_dict(d) == LlamaConfig.preset("llama3-1b")


# ---- Llama ---------------------------------------------------------------------------------------------------------
def test_llama_parsing():
    c = LlamaConfig.preset("llama3-1b")
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.context_length == 131072  # llama3 scaling is already counted in max_position_embeddings
    minimal = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
               "num_hidden_layers": 2, "num_attention_heads": 4}
    m = LlamaConfig.from_dict(minimal)  # HF LlamaConfig's defaults for everything else
    assert (m.head_dim, m.num_key_value_heads, m.rope_theta, m.max_position_embeddings) == (64, 4, 10000.0, 2048)
    assert m.rope_scaling is None and not m.tie_word_embeddings
    assert LlamaConfig.from_dict({**minimal, "rope_theta": None}).rope_theta == 10000.0
    assert LlamaConfig.from_dict({**minimal, "attention_bias": False, "mlp_bias": False}) == m


@pytest.mark.parametrize("change, needle", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'.*supports none or 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "original_max_position_embeddings is required"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "factor must be a number"),
    ({"head_dim": None, "hidden_size": 129}, "no head_dim"),
    ({"num_key_value_heads": 5}, "multiple of"),
    ({"rope_theta": 0.5}, "rope_theta"),
])
def test_llama_config_errors(change, needle):
    with pytest.raises(ValueError, match=needle):
        LlamaConfig.from_dict({**preset_dict("llama3-tiny"), **change})


def test_engine_config_from_the_command_line():
    """EngineConfig's CLI options: a size left out takes the default (a zero is argparse's error, in test_cli.py);
    a non-finite fraction says so."""
    import argparse

    from xserv.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(p)
    assert EngineConfig.from_cli_args(p.parse_args([])) == EngineConfig()
    assert EngineConfig.from_cli_args(p.parse_args(["--max-num-seqs", "3", "--prefill-graph-tokens", "0"])) == \
        EngineConfig(max_num_seqs=3, prefill_graph_tokens=0)
    with pytest.raises(ValueError, match="gpu_memory_fraction must be a finite number, got nan"):
        EngineConfig(gpu_memory_fraction=float("nan"))


# ---- quantization_config ---------------------------------------------------------------------------------------
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n not in HYBRID_PRESETS])  # (FP8 hybrids: not yet)
def test_every_preset_takes_an_fp8_quantization_config(name):
    d = {**preset_dict(name), "quantization_config": FP8}
    c = config_from_dict(d)
    assert c.quantization_config.weight_block_size == (128, 128)
    assert c.to_dict()["quantization_config"] == FP8 and config_from_dict(c.to_dict()) == c
    assert {c: 1}[config_from_dict(c.to_dict())] == 1  # still frozen and hashable
    assert config_from_dict(preset_dict(name)).quantization_config is None


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported"),
    ({"quant_method": "gptq"}, "quant_method='gptq' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors' is not supported"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme='static' is not supported"),
    ({"load_in_8bit": True}, "quantization_config has no quant_method"),
])
def test_unsupported_quantization_is_an_error_not_ignored(qc, needle, tmp_path):
    """A quantized checkpoint xserv cannot read fails at its config.json, naming the method or field (it used to be
    read as an unquantized model and fail later, or load garbage)."""
    d = {**preset_dict("tiny"), "quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=needle):
        config_from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=needle):
        Qwen3Config.from_dict(d)
