import json
import struct

import ml_dtypes
import numpy as np
import pytest

from xserv.models.checkpoint import CheckpointReader, read_safetensors_header, resolve_model_source
from xserv.models.random_checkpoint import save_safetensors

bf16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def arrays(rng):
    return {
        "a.weight": rng.standard_normal((3, 5)).astype(bf16),
        "b.weight": rng.standard_normal((7,)).astype(np.float16),
        "c.weight": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "d.ids": rng.integers(0, 100, (6,)).astype(np.int64),
    }


def test_single_file_roundtrip(tmp_path, arrays):
    save_safetensors(tmp_path / "model.safetensors", arrays)
    r = CheckpointReader(tmp_path)
    assert sorted(r.names()) == sorted(arrays)
    for name, a in arrays.items():
        assert r.shape(name) == a.shape
        assert r.dtype(name) == a.dtype
        got = r.get(name)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got.view(np.uint8), a.view(np.uint8))
        assert not got.flags.writeable  # a view of the read-only mapping, not a copy
        assert got.base is not None
    r.validate({n: a.shape for n, a in arrays.items()})
    r.close()


def test_readable_by_safetensors_library(tmp_path, arrays):
    from safetensors.numpy import load_file

    save_safetensors(tmp_path / "model.safetensors", arrays)
    loaded = load_file(tmp_path / "model.safetensors")
    for name, a in arrays.items():
        np.testing.assert_array_equal(loaded[name].view(np.uint8), a.view(np.uint8))


def test_reads_file_written_by_safetensors_library(tmp_path, rng):
    from safetensors.numpy import save_file

    a = {"x": rng.standard_normal((4, 4)).astype(np.float32), "y": np.arange(5, dtype=np.int32)}
    save_file(a, tmp_path / "model.safetensors", metadata={"format": "pt"})
    r = CheckpointReader(tmp_path)
    np.testing.assert_array_equal(r.get("x"), a["x"])
    np.testing.assert_array_equal(r["y"], a["y"])
    assert r.metadata["model.safetensors"] == {"format": "pt"}


def test_sharded(tmp_path, arrays):
    names = list(arrays)
    save_safetensors(tmp_path / "model-00001-of-00002.safetensors", {n: arrays[n] for n in names[:2]})
    save_safetensors(tmp_path / "model-00002-of-00002.safetensors", {n: arrays[n] for n in names[2:]})
    index = {"metadata": {"total_size": 0},
             "weight_map": {n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    r = CheckpointReader(tmp_path)
    assert len(r) == 4 and len(r.files) == 2
    np.testing.assert_array_equal(r.get("c.weight"), arrays["c.weight"])
    assert dict(r.items()).keys() == set(names)


def test_index_naming_missing_shard(tmp_path, arrays):
    save_safetensors(tmp_path / "model-00001-of-00002.safetensors", arrays)
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        CheckpointReader(tmp_path)


def test_validate_lists_everything_in_one_error(tmp_path, arrays):
    save_safetensors(tmp_path / "model.safetensors", arrays)
    r = CheckpointReader(tmp_path)
    expected = {"a.weight": (3, 5), "b.weight": (8,), "c.weight": (2, 3, 4), "missing.one": (1,), "missing.two": (2,)}
    with pytest.raises(ValueError) as e:
        r.validate(expected)
    msg = str(e.value)
    for s in ("missing (2)", "missing.one", "missing.two", "unexpected (1)", "d.ids", "wrong shape (1)",
              "b.weight is [7], expected [8]"):
        assert s in msg, (s, msg)
    assert "a.weight" not in msg


def test_unknown_tensor_name(tmp_path, arrays):
    save_safetensors(tmp_path / "model.safetensors", arrays)
    with pytest.raises(KeyError, match="nope"):
        CheckpointReader(tmp_path).get("nope")


def test_corrupt_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        CheckpointReader(tmp_path)
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)  # truncated data
    with pytest.raises(ValueError, match="do not fit"):
        CheckpointReader(tmp_path)
    hdr = json.dumps({"x": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0")
    with pytest.raises(ValueError, match="bad header"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match="JSON"):
        read_safetensors_header(tmp_path / "model.safetensors")


def test_no_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tmp_path / "absent")


def test_resolve_local_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(tmp_path) == tmp_path
    assert resolve_model_source(str(tmp_path)) == tmp_path


def test_resolve_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_source(tmp_path)


def test_resolve_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_source(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_source("./relative/missing/model")


def test_resolve_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    pytest.importorskip("huggingface_hub")
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match="`xserv make-test-model --preset tiny --out DIR`"):
        resolve_model_source("Qwen/Qwen3-0.6B")


def test_resolve_hub_id_without_huggingface_hub(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "huggingface_hub":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match="huggingface_hub is not installed.*`xserv make-test-model --preset tiny"):
        resolve_model_source("Qwen/Qwen3-0.6B")


def test_resolve_hub_id_download(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub

    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw.get("local_files_only")))
        if kw.get("local_files_only"):
            raise OSError("not cached")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model_source("Qwen/Qwen3-0.6B") == tmp_path
    assert calls == [("Qwen/Qwen3-0.6B", True), ("Qwen/Qwen3-0.6B", None)]
