import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xserv.models.checkpoint import CheckpointReader
from xserv.models.config import preset_dict
from xserv.models.llama import LlamaConfig, LlamaModel
from xserv.models.qwen3 import Qwen3Config, Qwen3Model
from xserv.models.random_checkpoint import bundled_tiny_model, make_test_model, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_test_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_tiny_folder(tiny):
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny / f).is_file(), f
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["torch_dtype"] == "bfloat16"
    c = Qwen3Config.from_pretrained(tiny)
    assert c == Qwen3Config.preset("tiny")
    r = CheckpointReader(tiny)
    r.validate({w.name: w.shape for w in Qwen3Model.weight_table(c)})
    assert "lm_head.weight" not in r
    assert all(str(r.dtype(n)) == "bfloat16" for n in r.names())
    emb = r.get("model.embed_tokens.weight").astype(np.float32)
    assert abs(emb.std() - 0.02) < 1e-3 and abs(emb.mean()) < 1e-3
    # norm weights 1 + N(0, 0.1) by default: every norm differs from 1 and from the others
    norms = [r.get(n).astype(np.float32) for n in r.names() if n.endswith("norm.weight")]
    assert len(norms) == 2 * 4 + 1
    for n in norms:
        assert abs(n.mean() - 1) < 0.05 and 0.07 < n.std() < 0.13
    assert len({n.tobytes() for n in norms}) == len(norms)
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]
    assert (tiny / "model.safetensors").stat().st_size < 25e6


def test_deterministic_and_seeded(tiny, tmp_path):
    again = make_test_model("tiny", tmp_path / "again", seed=0)
    other = make_test_model("tiny", tmp_path / "other", seed=1)
    a, b, c = CheckpointReader(tiny), CheckpointReader(again), CheckpointReader(other)
    name = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(a.get(name).view(np.uint16), b.get(name).view(np.uint16))
    assert not np.array_equal(a.get(name).view(np.uint16), c.get(name).view(np.uint16))
    # different tensors get different values
    assert not np.array_equal(a.get("model.layers.0.mlp.up_proj.weight").view(np.uint16),
                              a.get("model.layers.0.mlp.gate_proj.weight").view(np.uint16))


def test_unit_norms(tmp_path):
    out = make_test_model("tiny", tmp_path / "unit", perturb_norms=False, overrides={"num_hidden_layers": 1})
    r = CheckpointReader(out)
    assert np.all(r.get("model.layers.0.self_attn.k_norm.weight").astype(np.float32) == 1.0)
    assert np.all(r.get("model.norm.weight").astype(np.float32) == 1.0)


def test_llama_presets(tmp_path):
    out = make_test_model("llama3-tiny", tmp_path / "llama", seed=2, overrides={"tie_word_embeddings": False})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and not cfg["mlp_bias"]
    c = LlamaConfig.from_pretrained(out)
    r = CheckpointReader(out)
    r.validate({w.name: w.shape for w in LlamaModel.weight_table(c)})
    assert "lm_head.weight" in r and not any("q_norm" in n for n in r.names())
    assert not np.allclose(r.get("model.layers.0.input_layernorm.weight").astype(np.float32), 1.0)
    assert (out / "tokenizer.json").is_file()  # the Qwen3 tokenizer, hence Qwen3's vocabulary in the presets
    assert c.vocab_size == 151936


def test_sharded_untied_perturbed(tiny, tmp_path):
    out = make_test_model("tiny", tmp_path / "sh", seed=0, shard_size="4MB",
                          overrides={"tie_word_embeddings": False})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert all((out / s).is_file() for s in shards)
    c = Qwen3Config.from_pretrained(out)
    assert not c.tie_word_embeddings
    r = CheckpointReader(out)
    r.validate({w.name: w.shape for w in Qwen3Model.weight_table(c)})
    assert index["metadata"]["total_size"] == r.total_bytes
    # same seed -> same values whatever the sharding
    name = "model.layers.1.self_attn.o_proj.weight"
    assert np.array_equal(r.get(name).view(np.uint16), CheckpointReader(tiny).get(name).view(np.uint16))
    qn = r.get("model.layers.0.self_attn.q_norm.weight").astype(np.float32)
    kn = r.get("model.layers.0.self_attn.k_norm.weight").astype(np.float32)
    assert not np.allclose(qn, 1.0) and not np.allclose(qn, kn) and abs(qn.mean() - 1) < 0.05


def test_float32_dtype(tmp_path):
    out = make_test_model("tiny", tmp_path / "f32", dtype="float32", overrides={"num_hidden_layers": 1})
    assert Qwen3Config.from_pretrained(out).dtype == "float32"
    r = CheckpointReader(out)
    assert r.dtype("model.norm.weight") == np.float32
    assert "model.layers.1.mlp.up_proj.weight" not in r


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        make_test_model("3b", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype"):
        make_test_model("tiny", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="seed"):
        make_test_model("tiny", tmp_path / "x", seed=-1)
    with pytest.raises(ValueError):
        parse_size("lots")
    assert not (tmp_path / "x").exists()
    assert not list(tmp_path.glob(".x.tmp-*"))


def test_parse_size():
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123


def test_bundled_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    p = bundled_tiny_model()
    assert p == tmp_path / "cache" / "models" / "tiny-random"
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert bundled_tiny_model() == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime  # made once
    (p / "xserv_random.json").write_text("{}")  # stale marker -> remade
    assert bundled_tiny_model() == p
    info = json.loads((p / "xserv_random.json").read_text())
    assert info["preset"] == "tiny" and info["perturb_norms"] is True
    info["perturb_norms"] = False  # made by an older xserv, with unit norms -> remade
    (p / "xserv_random.json").write_text(json.dumps(info))
    bundled_tiny_model()
    assert json.loads((p / "xserv_random.json").read_text())["perturb_norms"] is True


def test_cli(tmp_path):
    out = tmp_path / "cli"
    res = subprocess.run([sys.executable, "-m", "tools.make_test_model", "--preset", "tiny", "--out", str(out),
                          "--seed", "3", "--layers", "1", "--untied", "--unit-norms", "--no-progress"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    c = Qwen3Config.from_pretrained(out)
    assert c.num_hidden_layers == 1 and not c.tie_word_embeddings
    assert np.all(CheckpointReader(out).get("model.norm.weight").astype(np.float32) == 1.0)
    # the rest through main() in this process: the subprocess above showed `python -m tools.make_test_model` runs
    from tools.make_test_model import main

    assert main(["--preset", "llama3-tiny", "--out", str(tmp_path / "llama"), "--layers", "1", "--no-progress"]) == 0
    assert LlamaConfig.from_pretrained(tmp_path / "llama").num_hidden_layers == 1
    with pytest.raises(SystemExit) as usage_error:
        main(["--preset", "huge", "--out", str(out)])
    assert usage_error.value.code == 2


def test_xserv_make_test_model_needs_no_source_tree(tmp_path, monkeypatch, capsys):
    """`xserv make-test-model` is the package's own command: it works where `tools/` is not importable (after a
    non-editable `pip install .`), and the hints that send a user to it name it."""
    from xserv.cli import main
    from xserv.models.checkpoint import _HINT

    monkeypatch.setitem(sys.modules, "tools", None)  # `import tools...` now fails, as outside the repo
    out = tmp_path / "xserv-cli"
    assert main(["make-test-model", "--preset", "tiny", "--out", str(out), "--seed", "3", "--layers", "1",
                 "--untied", "--unit-norms"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    c = Qwen3Config.from_pretrained(out)
    assert c.num_hidden_layers == 1 and not c.tie_word_embeddings
    assert np.all(CheckpointReader(out).get("model.norm.weight").astype(np.float32) == 1.0)
    assert json.loads((out / "xserv_random.json").read_text())["seed"] == 3
    assert "`xserv make-test-model --preset tiny --out DIR`" in _HINT and "tools" not in _HINT
    # a value it refuses is one line and exit 2, not a traceback
    assert main(["make-test-model", "--preset", "tiny", "--out", str(tmp_path / "bad"), "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--seed must be a non-negative integer" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as usage_error:
        main(["make-test-model", "--preset", "huge", "--out", str(out)])
    assert usage_error.value.code == 2


def test_transformers_reads_config(tiny):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(tiny)
    assert cfg.model_type == "qwen3" and cfg.head_dim == 64 and cfg.tie_word_embeddings


# ---- Qwen3-MoE checkpoints, free space, parallel writing -------------------------------------------------------
def test_moe_preset_with_overrides(tmp_path):
    """Per-expert tensors under transformers' names; the MoE fields are overridable from Python."""
    from xserv.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel

    out = make_test_model("moe-tiny", tmp_path / "moe", seed=4, progress=False,
                          overrides={"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1],
                                     "norm_topk_prob": False, "num_hidden_layers": 2})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["mlp_only_layers"], cfg["norm_topk_prob"]) == \
        (8, 2, [1], False)
    c = Qwen3MoeConfig.from_pretrained(out)
    r = CheckpointReader(out)
    r.validate({w.name: w.shape for w in Qwen3MoeModel.weight_table(c)})
    h, i = c.hidden_size, c.moe_intermediate_size
    assert r.shape("model.layers.0.mlp.gate.weight") == (8, h)
    assert r.shape("model.layers.0.mlp.experts.7.gate_proj.weight") == (i, h)
    assert r.shape("model.layers.0.mlp.experts.7.down_proj.weight") == (h, i)
    assert "model.layers.0.mlp.experts.8.up_proj.weight" not in r and "model.layers.1.mlp.gate.weight" not in r
    assert r.shape("model.layers.1.mlp.gate_proj.weight") == (c.intermediate_size, h)
    gate, up = (r.get(f"model.layers.0.mlp.experts.3.{n}_proj.weight").astype(np.float32) for n in ("gate", "up"))
    assert not np.array_equal(gate, up) and abs(gate.std() - 0.02) < 2e-3


def test_refuses_when_the_filesystem_is_too_small(tmp_path, monkeypatch):
    import xserv.models.random_checkpoint as rc

    seen = []
    monkeypatch.setattr(rc, "free_bytes", lambda folder: seen.append(folder) or 10 * 10**9)
    write = rc.write_sharded

    def must_not_write(*args, **kwargs):  # a check that lets it through fails here, not after writing 61 GB
        raise AssertionError("the weights are being written")

    monkeypatch.setattr(rc, "write_sharded", must_not_write)
    with pytest.raises(ValueError, match=r"takes 61\.\d\d GB .* has 10\.00 GB free") as e:
        make_test_model("30b-a3b", tmp_path / "big", progress=False)
    assert str(tmp_path) in str(e.value) and seen == [tmp_path]
    assert not (tmp_path / "big").exists() and not list(tmp_path.glob(".big.tmp-*"))  # nothing written
    # the same through the command: one line, exit 2
    from xserv.models.make_test_model import main

    assert main(["--preset", "235b-a22b", "--out", str(tmp_path / "bigger"), "--no-progress"]) == 2
    # enough room: written (the tiny model is 19 MB)
    monkeypatch.setattr(rc, "write_sharded", write)
    monkeypatch.setattr(rc, "free_bytes", lambda folder: 40 * 10**6)
    assert (make_test_model("tiny", tmp_path / "small", progress=False) / "model.safetensors").is_file()
    monkeypatch.setattr(rc, "free_bytes", lambda folder: 25 * 10**6)
    with pytest.raises(ValueError, match="not enough free space"):
        make_test_model("tiny", tmp_path / "small2", progress=False)


def test_workers_write_the_same_bytes(tmp_path, monkeypatch):
    """Three workers, runs of about 256 kB of tensors each over several shards: the same files, byte for byte, as
    one."""
    import xserv.models.random_checkpoint as rc
    import xserv.models.safetensors_writer as sw
    from xserv.models.make_test_model import main

    monkeypatch.setattr(sw, "JOB_BYTES", 2**18)
    kw = dict(seed=5, shard_size="1MB", overrides={"num_hidden_layers": 2})
    one = make_test_model("moe-tiny", tmp_path / "one", workers=1, progress=False, **kw)
    assert main(["--preset", "moe-tiny", "--out", str(tmp_path / "three"), "--seed", "5", "--shard-size", "1MB",
                 "--layers", "2", "--workers", "3", "--no-progress"]) == 0
    three = tmp_path / "three"
    files = sorted(p.name for p in one.iterdir() if p.name != "xserv_random.json")
    assert sorted(p.name for p in three.iterdir() if p.name != "xserv_random.json") == files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3  # the embedding, the layers
    for f in files:
        assert (one / f).read_bytes() == (three / f).read_bytes(), f
    with pytest.raises(ValueError, match="workers"):
        make_test_model("tiny", tmp_path / "x", workers=0)


# ---- FP8 checkpoints (Qwen's -FP8 layout) ------------------------------------------------------------------------
def test_fp8_workers_write_the_same_bytes(tmp_path, monkeypatch):
    """--fp8 with four workers and runs of about 16 kB (a quantized weight and its scales often in different
    runs, so a scale entry is drawn again instead of taken from its weight's): the bytes of one worker."""
    import xserv.models.random_checkpoint as rc
    import xserv.models.safetensors_writer as sw
    from xserv.models.make_test_model import main

    monkeypatch.setattr(sw, "JOB_BYTES", 2**14)
    one = make_test_model("moe-tiny", tmp_path / "one", seed=6, workers=1, progress=False, fp8=True,
                          shard_size="2MB", overrides={"num_hidden_layers": 2})
    assert main(["--preset", "moe-tiny", "--out", str(tmp_path / "four"), "--seed", "6", "--layers", "2", "--fp8",
                 "--shard-size", "2MB", "--workers", "4", "--no-progress"]) == 0
    four = tmp_path / "four"
    files = sorted(p.name for p in one.iterdir() if p.name != "xserv_random.json")
    assert sorted(p.name for p in four.iterdir() if p.name != "xserv_random.json") == files
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2
    for f in files:
        assert (one / f).read_bytes() == (four / f).read_bytes(), f
    assert json.loads((four / "xserv_random.json").read_text())["fp8"] is True
    r = CheckpointReader(four)
    assert str(r.dtype("model.layers.1.mlp.experts.15.down_proj.weight")) == "float8_e4m3fn"
    assert r.shape("model.layers.1.mlp.experts.15.down_proj.weight_scale_inv") == (1, 1)
    # a different seed, different weights; the same seed without --fp8, the float draws it quantizes
    other = make_test_model("moe-tiny", tmp_path / "other", seed=7, progress=False, fp8=True,
                            overrides={"num_hidden_layers": 2})
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert not np.array_equal(CheckpointReader(other).get(name).view(np.uint8), r.get(name).view(np.uint8))


@pytest.mark.parametrize("preset, quantized, total_gb", [
    ("tiny", 2 * (512 * 64 + 64 * 256 + 384 * 64 + 64 * 192), 0.0197),
    ("moe-tiny", 4 * (512 * 128 + 128 * 256 + 16 * 3 * 64 * 128), 0.0409), ("0.6b", 0.44e9, 0.75), ("8b", 6.95e9, 9.44),
    ("30b-a3b", 29.92e9, 31.17),
])
def test_fp8_presets_layout_and_size(preset, quantized, total_gb, tmp_path, monkeypatch):
    """The tensors `--fp8` would write for each preset (taken before anything is written): every linear weight of
    the layers e4m3 with its float32 scales of ceil(out/128) x ceil(in/128), the rest bf16 (8b: 9.4 GB of tensors,
    30b-a3b: 31 GB, against 16.4 and 61 GB in bf16)."""
    import xserv.models.random_checkpoint as rc
    from xserv.models.registry import config_from_dict, model_class

    seen = {}

    def capture(folder, entries, *args, **kwargs):
        seen["entries"] = entries
        raise KeyboardInterrupt  # stop before writing

    monkeypatch.setattr(rc, "write_sharded", capture)
    monkeypatch.setattr(rc, "free_bytes", lambda folder: 10**12)
    with pytest.raises(KeyboardInterrupt):
        make_test_model(preset, tmp_path / "m", progress=False, fp8=True)
    assert not (tmp_path / "m").exists()
    entries = {e.name: e for e in seen["entries"]}
    d = preset_dict(preset)
    c = config_from_dict({**d, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    table = model_class(c).weight_table(c)
    n_quantized = 0
    for w in table:
        e = entries[w.name]
        if w.quantized:
            n_quantized += math.prod(w.shape)
            s = entries[w.name + "_scale_inv"]
            assert str(e.dtype) == "float8_e4m3fn" and s.dtype == np.float32
            assert s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        else:
            assert str(e.dtype) == "bfloat16" and w.name + "_scale_inv" not in entries
            assert len(w.shape) == 1 or w.field in ("embed", "lm_head", "router")
    assert len(entries) == len(table) + sum(w.quantized for w in table)
    assert n_quantized == pytest.approx(quantized, rel=1e-3)
    assert sum(e.nbytes for e in entries.values()) / 1e9 == pytest.approx(total_gb, rel=1e-2)


def test_fp8_cli_says_so(tmp_path, capsys):
    from xserv.models.make_test_model import main

    assert main(["--preset", "tiny", "--out", str(tmp_path / "t"), "--layers", "1", "--fp8", "--no-progress"]) == 0
    assert "FP8 e4m3 128x128 blocks" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}


def test_make_test_model_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    """`xserv make-test-model --out DIR` deleted an existing folder that was not a model (a user's keep.txt was gone):
    a non-empty folder that is not one make-test-model wrote is refused, one line, nothing changed in it."""
    from xserv.cli import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("precious\n")
    code = main(["make-test-model", "--preset", "tiny", "--out", str(out), "--layers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and str(out) in err and "keep.txt" in err and "--force" in err and "Traceback" not in err, err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious\n"
    assert not list(tmp_path.glob(".mine.tmp-*"))  # nothing left beside it either


def test_make_test_model_replaces_only_its_own_folders(tmp_path, capsys):
    """A folder make-test-model wrote is replaced whole (a sharded one's shards too); one it wrote and a user then
    added to is refused unless --force: make-test-model replacing any existing folder deleted the user's notes.txt."""
    from xserv.cli import main

    out = tmp_path / "model"
    base = ["make-test-model", "--preset", "tiny", "--out", str(out), "--layers", "1", "--no-progress"]
    assert main([*base, "--seed", "1", "--shard-size", "1MB"]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert main([*base, "--seed", "2"]) == 0  # its own folder: replaced
    assert json.loads((out / "xserv_random.json").read_text())["seed"] == 2
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]  # the old shards are gone
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert main([*base, "--seed", "3"]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").is_file() and json.loads((out / "xserv_random.json").read_text())["seed"] == 2
    assert main([*base, "--seed", "3", "--force"]) == 0  # --force replaces any folder
    assert not (out / "notes.txt").exists() and json.loads((out / "xserv_random.json").read_text())["seed"] == 3


def test_make_test_model_force_replaces_any_folder(tmp_path):
    """--force replaces a folder make-test-model did not write (the user asked for it); an empty folder needs no
    --force."""
    from xserv.cli import main

    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("x")
    base = ["make-test-model", "--preset", "tiny", "--out", str(out), "--layers", "1", "--no-progress"]
    assert main([*base, "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "xserv_random.json").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*base[:4], str(empty), *base[5:]]) == 0 and (empty / "model.safetensors").is_file()
