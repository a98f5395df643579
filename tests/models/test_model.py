"""The dense models (Qwen3, Llama 3) on the NumPy backend: loading, and the forward pass against an independent
float64 implementation, through one prefill, chunked prefill, decode steps and packed batches. On the GPU: the
CUDA model against the NumPy one, through the LLM API."""
import json
import shutil

import numpy as np
import pytest

from qwen3_reference import (dense_reference_logits, llama_model_dir, perturbed_model_dir, rel_err_rows,  # noqa: F401
                             tiny_model_dir)
from xserv.engine.batch import SeqChunk, build_host_arrays, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.models.base import CausalLM, ModelConfig
from xserv.models.checkpoint import CheckpointReader
from xserv.models.llama import LlamaModel
from xserv.models.qwen3 import Qwen3Model
from xserv.models.registry import config_from_pretrained, load_model
from xserv.tensor import Tensor

BLOCK = 4  # small blocks: sequences span several, block tables get exercised
ARCHS = ["qwen3", "llama"]


def load(folder, device="cpu"):
    return load_model(folder, device, progress=False, max_positions=512)


def make_cache(model, num_blocks=64):
    return KVCache(KVCacheSpec(*model.kv_layout, BLOCK), num_blocks, "cpu", model.dtype)


@pytest.fixture(scope="module")
def folders(perturbed_model_dir, llama_model_dir):  # noqa: F811
    return {"qwen3": perturbed_model_dir, "llama": llama_model_dir}


@pytest.fixture(scope="module")
def models(folders):
    return {arch: load(folder) for arch, folder in folders.items()}


def run(model, cache, chunks):
    return model.forward(make_batch(chunks, BLOCK, "cpu"), cache).numpy().copy()


def layer_rows(t, start, stop):
    return np.asarray(t.numpy()[start:stop], np.float32)


def test_loads_tiny_with_fused_weights(tiny_model_dir):  # noqa: F811
    model = load(tiny_model_dir)
    c = model.config
    assert type(model) is Qwen3Model and isinstance(model, CausalLM) and isinstance(c, ModelConfig)
    assert len(model.layers) == c.num_hidden_layers
    layer = model.layers[0]
    assert layer.qkv.shape == (c.q_size + 2 * c.kv_size, c.hidden_size)
    assert layer.gate_up.shape == (2 * c.intermediate_size, c.hidden_size)
    assert model.lm_head is model.embed  # tied
    assert model.kv_layout == (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    reader = CheckpointReader(tiny_model_dir)
    k = np.asarray(reader.get("model.layers.1.self_attn.k_proj.weight"), np.float32)
    np.testing.assert_array_equal(layer_rows(model.layers[1].qkv, c.q_size, c.q_size + c.kv_size), k)
    up = np.asarray(reader.get("model.layers.0.mlp.up_proj.weight"), np.float32)
    np.testing.assert_array_equal(layer_rows(layer.gate_up, c.intermediate_size, 2 * c.intermediate_size), up)
    qn = np.asarray(reader.get("model.layers.1.self_attn.q_norm.weight"), np.float32)
    np.testing.assert_array_equal(model.layers[1].q_norm.numpy().astype(np.float32), qn)
    assert not np.allclose(qn, 1.0)  # the bundled tiny model's norms are not all ones
    assert model.weight_bytes() == reader.total_bytes


def test_loads_llama(models, folders):
    model = models["llama"]
    c = model.config
    assert type(model) is LlamaModel and isinstance(model, CausalLM)
    assert c.head_dim == c.hidden_size // c.num_attention_heads == 64
    assert all(layer.q_norm is None and layer.k_norm is None for layer in model.layers)
    assert model.lm_head is not model.embed  # untied
    reader = CheckpointReader(folders["llama"])
    v = np.asarray(reader.get("model.layers.1.self_attn.v_proj.weight"), np.float32)
    np.testing.assert_array_equal(layer_rows(model.layers[1].qkv, c.q_size + c.kv_size, c.qkv_size), v)
    np.testing.assert_array_equal(model.lm_head.numpy().astype(np.float32),
                                  np.asarray(reader.get("lm_head.weight"), np.float32))
    assert model.weight_bytes() == reader.total_bytes


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


def test_qwen3_checkpoint_read_as_llama_names_the_extra_norms(tiny_model_dir, tmp_path):  # noqa: F811
    folder = tmp_path / "relabelled"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected.*self_attn.q_norm.weight"):
        load(folder)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_dense_reference(models, folders, arch, rng):
    model = models[arch]
    ids = rng.integers(0, model.config.vocab_size, 23).tolist()
    cache = make_cache(model)
    table = list(range(7, 1, -1))  # non-contiguous, descending blocks
    logits = run(model, cache, [SeqChunk(ids, 0, table, "all")])
    ref = dense_reference_logits(folders[arch], ids)
    err = rel_err_rows(logits, ref)
    # bf16 activations against a float64 reference; a wrong rotation, head mapping or norm gives errors > 0.2
    assert err.max() < 3e-2, err


def test_llama_logits_depend_on_rope_scaling_and_norm_weights(models, rng):
    """The reference check above can fail on these: the same weights with plain RoPE, or with the final norm at 1,
    move the logits far past its tolerance."""
    model = models["llama"]
    ids = rng.integers(0, model.config.vocab_size, 23).tolist()
    table = list(range(6))
    logits = run(model, make_cache(model), [SeqChunk(ids, 0, table, "all")])

    def variant(config, final_norm):
        return type(model)(config, "cpu", model.embed, model.layers, final_norm, model.lm_head, max_positions=512)

    plain = variant(model.config.replace(rope_scaling=None), model.final_norm)
    assert rel_err_rows(run(plain, make_cache(plain), [SeqChunk(ids, 0, table, "all")]), logits).max() > 0.1
    ones = Tensor.from_numpy(np.ones(model.final_norm.shape, model.dtype), "cpu")
    unit = variant(model.config, ones)
    assert rel_err_rows(run(unit, make_cache(unit), [SeqChunk(ids, 0, table, "all")]), logits).max() > 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_chunks_and_decode_match_one_prefill(models, arch, rng):
    model = models[arch]
    ids = rng.integers(0, model.config.vocab_size, 19).tolist()
    table = [5, 0, 9, 3, 7]
    full = run(model, make_cache(model), [SeqChunk(ids, 0, table, "all")])

    cache = make_cache(model)  # chunked prefill: 6 + 6 + 7 tokens
    chunked = np.concatenate([run(model, cache, [SeqChunk(ids[s:e], s, table, "all")])
                              for s, e in ((0, 6), (6, 12), (12, 19))])
    cache = make_cache(model)  # prefill of a prefix, then one decode step per token
    pieces = [run(model, cache, [SeqChunk(ids[:8], 0, table, "all")])]
    pieces += [run(model, cache, [SeqChunk(ids[p:p + 1], p, table, "last")]) for p in range(8, 19)]
    stepped = np.concatenate(pieces)
    # The paths differ only in float32 summation order (GEMMs of other M, the decode vs prefill attention), which
    # flips a few bf16 roundings of activations; the float32 residual stream carries those flips on (a bf16 one
    # mostly absorbed them), giving ~5e-3. A wrong page, position or causal offset gives > 0.1.
    assert rel_err_rows(chunked, full).max() < 1e-2
    assert rel_err_rows(stepped, full).max() < 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_matches_sequences_alone(models, arch, rng):
    model = models[arch]
    v = model.config.vocab_size
    a, b, c = (rng.integers(0, v, n).tolist() for n in (9, 1, 14))
    tables = [[0, 1, 2], [3], [4, 5, 6, 7]]
    alone = [run(model, make_cache(model), [SeqChunk(s, 0, t, "all")]) for s, t in zip((a, b, c), tables)]

    cache = make_cache(model)
    # a fully, c's first 5 tokens, then a mixed batch: b new, c's remaining 9 (cached prefix), a one decode token
    run(model, cache, [SeqChunk(a[:8], 0, tables[0], "none"), SeqChunk(c[:5], 0, tables[2], "none")])
    batch = make_batch([SeqChunk(b, 0, tables[1], "all"), SeqChunk(c[5:], 5, tables[2], "all"),
                        SeqChunk(a[8:], 8, tables[0], "last")], BLOCK, "cpu")
    assert batch.max_q_len == 9 and batch.logits_per_seq == [(0, 1), (1, 9), (10, 1)]
    mixed = model.forward(batch, cache).numpy()
    # usually equal to 1e-7; a GEMM of another M can flip a bf16 rounding (1.3e-3 seen on the Llama model for some
    # inputs), while a wrong page, position or sequence boundary gives > 0.1
    assert rel_err_rows(mixed[0:1], alone[1]).max() < 1e-2
    assert rel_err_rows(mixed[1:10], alone[2][5:]).max() < 1e-2
    assert rel_err_rows(mixed[10:11], alone[0][8:]).max() < 1e-2


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


def test_config_from_pretrained_matches_model(folders, models):
    for arch, folder in folders.items():
        assert config_from_pretrained(folder) == models[arch].config


# ---- CUDA --------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_model_matches_numpy_and_reference(models, folders, arch, rng):
    """Prefill (several sequences packed) and decode steps on the CUDA model against the NumPy model and the
    float64 reference, on checkpoints whose norm weights are not all ones."""
    from xserv.engine.kv_cache import KVCache as Cache

    cpu = models[arch]
    gpu = load(folders[arch], "cuda")
    v = cpu.config.vocab_size
    seqs = [rng.integers(0, v, n).tolist() for n in (37, 5, 70)]
    tables = [[3, 9, 1, 12, 20, 21, 22, 23, 24, 25], [0, 2], list(range(30, 50))]

    def caches():
        return (make_cache(cpu), Cache(KVCacheSpec(*gpu.kv_layout, BLOCK), 64, "cuda", gpu.dtype))

    cpu_cache, gpu_cache = caches()
    # These checkpoints have weights of std 0.1, which amplifies bf16 rounding: CUDA and NumPy round at the same
    # points but sum in other orders and differ by 1.4e-2 (H100, these inputs); CUDA is 1.6e-2 from the float64
    # reference. A norm weight ignored or plain RoPE instead of llama3 moves the logits by > 0.1.
    chunks = [SeqChunk(s[:-2], 0, t, "all") for s, t in zip(seqs, tables)]
    want = cpu.forward(make_batch(chunks, BLOCK, "cpu"), cpu_cache).numpy().copy()
    got = gpu.forward(make_batch(chunks, BLOCK, "cuda"), gpu_cache).numpy().copy()
    assert np.all(np.isfinite(got))
    ref = dense_reference_logits(folders[arch], seqs[2][:-2])
    rows = sum(len(s) - 2 for s in seqs[:2])
    print(f"{arch}: CUDA vs NumPy {rel_err_rows(got, want).max():.2e}, CUDA vs float64 reference "
          f"{rel_err_rows(got[rows:], ref).max():.2e}")
    assert rel_err_rows(got, want).max() < 3e-2
    assert rel_err_rows(got[rows:], ref).max() < 3e-2
    for step in (2, 1):  # two decode steps of all three sequences
        chunks = [SeqChunk(s[-step:][:1], len(s) - step, t, "last") for s, t in zip(seqs, tables)]
        want = cpu.forward(make_batch(chunks, BLOCK, "cpu"), cpu_cache).numpy().copy()
        got = gpu.forward(make_batch(chunks, BLOCK, "cuda"), gpu_cache).numpy().copy()
        print(f"{arch}: decode step, CUDA vs NumPy {rel_err_rows(got, want).max():.2e}")
        assert rel_err_rows(got, want).max() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_fused_small_forwards_match_unfused(models, folders, arch, rng):
    """One-token forwards take the fused GEMV path (norm / SiLU / residual add folded into the projections); the
    same steps through the unfused ops (cuBLASLt) give the same logits up to fp32 summation order, and the same
    greedy token wherever the top two logits are not a near tie. A one-token prompt, then decode steps."""
    from xserv.engine.kv_cache import KVCache as Cache

    gpu = load(folders[arch], "cuda")
    v = gpu.config.vocab_size
    seq = rng.integers(0, v, 4).tolist()
    table = [5, 1, 7]
    steps = [[SeqChunk(seq[j:j + 1], j, table, "last")] for j in range(len(seq))]
    logits = {}
    for fused, attention in ((True, True), (True, False), (False, True)):
        gpu.fused_gemv, gpu.fused_attention = fused, attention
        cache = Cache(KVCacheSpec(*gpu.kv_layout, BLOCK), 16, "cuda", gpu.dtype)
        assert gpu.fused_forward_ok(1, 1) == fused and not gpu.fused_forward_ok(2, 2)
        logits[fused, attention] = [gpu.forward(make_batch(chunks, BLOCK, "cuda"), cache).numpy().copy()
                                    for chunks in steps]
    gpu.fused_gemv, gpu.fused_attention = True, True
    for got, want in zip(logits[True, True], logits[True, False]):  # attention_decode_rope is bit-identical
        np.testing.assert_array_equal(got, want)
    for got, want in zip(logits[True, True], logits[False, True]):
        assert np.all(np.isfinite(got))
        assert rel_err_rows(got, want).max() < 1e-2
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-2
        np.testing.assert_array_equal(got.argmax(1)[clear], want.argmax(1)[clear])
