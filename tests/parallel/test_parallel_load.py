"""The tensor-parallel shard loader (xserv/parallel/load.py), on the CPU: each rank's model, loaded from the
memory-mapped checkpoint through its ShardPlan, holds exactly the plan's slices of the full model's fields (the
existing single-GPU loader's), bit for bit, FP8 shards dequantized from the scale blocks that cover them included;
tp 1 is the single-GPU loader; loading a rank copies only shards (never a whole tensor) into host memory; and one
decoder layer run per rank on the loaded weights, the o_proj and down / experts outputs summed across ranks (the
all-reduce, in NumPy), gives the full model's layer output.

Checkpoints: tiny Qwen3 (untied, odd vocabulary 1003: padding rows at tp 2 and 4), tiny Llama (tied, 4 q / 2 kv
heads, vocabulary 1001), moe-tiny (2 layers: layer 0 sparse, layer 1 a dense MLP), and FP8 checkpoints of the
dense tiny preset (48 x 40 blocks, so most shards start inside a block) and of moe-tiny (128 x 128 blocks: each
expert's 64 columns split inside one block)."""
from __future__ import annotations

import tracemalloc
from collections import Counter

import ml_dtypes
import numpy as np
import pytest

from test_sharding import attention, mlp, moe_block, rmsnorm
from xserv.models.checkpoint import CheckpointReader
from xserv.fp8_format import dequantize_blockwise, quantize_blockwise
from xserv.models.random_checkpoint import make_test_model
from xserv.models.registry import config_from_pretrained, load_model, model_class
from xserv.parallel import dequantize_shard, load_shard, shard_from_checkpoint, shard_plan, valid_tp_sizes
from xserv.tensor import Tensor

SMALL_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # the presets' special ids lie past the small vocabularies
QWEN_FP8_48x40 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [48, 40]}
CHECKPOINTS = {  # name -> (preset, config.json overrides, fp8)
    "qwen3": ("tiny", {"vocab_size": 1003, "tie_word_embeddings": False, **SMALL_IDS}, False),
    "llama-tied": ("llama3-tiny", {"vocab_size": 1001, "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "head_dim": 32, **SMALL_IDS}, False),
    "moe": ("moe-tiny", {"vocab_size": 997, "num_hidden_layers": 2, "mlp_only_layers": [1], **SMALL_IDS}, False),
    "fp8-dense-48x40": ("tiny", {"vocab_size": 1003, "tie_word_embeddings": False, "initializer_range": 0.1,
                                 "quantization_config": QWEN_FP8_48x40, **SMALL_IDS}, False),
    "fp8-moe": ("moe-tiny", {"vocab_size": 997, "num_hidden_layers": 2, "mlp_only_layers": [1],
                             "initializer_range": 0.1, **SMALL_IDS}, True),
}
TPS = (1, 2, 4)
MAX_POSITIONS = 16  # the rope table's rows: small, so it does not blur the host-memory measurement


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-load")
    return {name: make_test_model(preset, root / name, seed=3, overrides=overrides, fp8=fp8, progress=False)
            for name, (preset, overrides, fp8) in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def full_models(folders):
    # dtype given: FP8 checkpoints load dequantized, as the shard loader loads them (a single-GPU load keeps the
    # 128 x 128-block projections in FP8, xserv/models/fp8.py; the ranks do not yet)
    return {name: load_model(folder, "cpu", progress=False, max_positions=MAX_POSITIONS, dtype="bfloat16")
            for name, folder in folders.items()}


def tps_of(config):
    return [t for t in TPS if t in valid_tp_sizes(config)]


def field(model, layer, name) -> np.ndarray:
    owner = model if layer is None else model.layers[layer]
    return getattr(owner, name).numpy()


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == np.dtype(ml_dtypes.bfloat16) else a


def expected_fields(full, plan):
    """The rank's fields cut from the full model's fields with the plan's ranges alone: each shard's source slice
    of the (dequantized) file tensor, which the full model holds at the tensor's rows of its field, put at the
    shard's destination rows; the vocab padding rows zero. Also checks every row is filled exactly once."""
    config = full.config
    table = {w.name: w for w in model_class(config).weight_table(config)}
    out, filled = {}, {}
    for s in plan.shards:
        key = (s.layer, s.field)
        if key not in out:
            out[key] = np.zeros(plan.field_shapes[s.field], full.dtype)
            filled[key] = np.zeros(plan.field_shapes[s.field][0], int)
        w = table[s.name]
        whole = field(full, s.layer, s.field)
        tensor = whole if w.rows is None else whole[w.rows[0]:w.rows[1]]
        out[key][s.dest_rows[0]:s.dest_rows[1]] = tensor[s.index]
        filled[key][s.dest_rows[0]:s.dest_rows[1]] += 1
    for key, count in filled.items():
        want = np.ones_like(count)
        if key[0] is None and key[1] in ("embed", "lm_head") and plan.vocab_padding is not None:
            want[plan.vocab_padding[0]:plan.vocab_padding[1]] = 0
        assert np.array_equal(count, want), f"{key}: rows filled {count.tolist()}"
    if plan.vocab_padding is not None and (None, "embed") not in out:  # a rank of padding rows only
        out[(None, "embed")] = np.zeros(plan.field_shapes["embed"], full.dtype)
    return out


def rank_fields(model):
    out = {(None, f): getattr(model, f).numpy() for f in ("embed", "final_norm")}
    if model.lm_head is not model.embed:
        out[(None, "lm_head")] = model.lm_head.numpy()
    for i, layer in enumerate(model.layers):
        out.update({(i, k): v.numpy() for k, v in vars(layer).items() if v is not None})
    return out


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_rank_fields_are_the_plans_slices_of_the_full_model(name, folders, full_models):
    full = full_models[name]
    config = full.config
    assert tps_of(config) == list(TPS)
    for tp in tps_of(config):
        for rank in range(tp):
            model = load_shard(folders[name], tp, rank, max_positions=MAX_POSITIONS)
            plan = shard_plan(config, None, tp, rank)
            assert type(model) is type(full) and model.device == "cpu" and model.dtype == full.dtype
            assert model.rank_config == plan.rank_config and model.config == plan.rank_config.config
            assert model.config.vocab_size == config.vocab_size  # the gathered logits' width
            got, want = rank_fields(model), expected_fields(full, plan)
            assert set(got) == set(want), (tp, rank)
            for key, a in got.items():
                assert a.shape == plan.field_shapes[key[1]], (tp, rank, key)
                assert np.array_equal(bits(a), bits(want[key])), f"tp {tp} rank {rank} {key}"
            if plan.vocab_padding is not None:
                for f in ("embed", "lm_head"):
                    if (None, f) in got:
                        assert not got[(None, f)][plan.vocab_padding[0]:].any()
            if config.tie_word_embeddings:
                assert model.lm_head is model.embed


def test_the_checkpoints_exercise_padding_and_fp8_offsets(folders, full_models):
    """The cases the loader must get right occur in these checkpoints: vocab padding rows, shards that start
    inside an FP8 block (rows and columns), ranks that replicate a kv head."""
    q = full_models["qwen3"].config
    assert shard_plan(q, None, 4, 3).vocab_padding == (1003 - 3 * 256, 256)
    assert shard_plan(q, None, 2, 1).vocab_padding == (1003 - 504, 504)
    fp8 = full_models["fp8-dense-48x40"].config
    offsets = {s.scale_offset for r in range(4) for s in shard_plan(fp8, None, 4, r).shards if s.block}
    assert any(o[0] for o in offsets) and any(o[1] for o in offsets) and (0, 0) in offsets
    moe = full_models["fp8-moe"].config
    assert any(s.scale_offset == (32, 0) for s in shard_plan(moe, None, 2, 1).shards if s.block)
    assert shard_plan(full_models["qwen3"].config, None, 4, 1).rank_config.kv_replicas == 2


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tp1_is_the_single_gpu_loader(name, folders, full_models):
    full = full_models[name]
    model = load_shard(folders[name], 1, 0, max_positions=MAX_POSITIONS)
    assert type(model) is type(full) and model.config == full.config
    got, want = model.weight_tensors(), full.weight_tensors()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(bits(a.numpy()), bits(b.numpy()))
        assert not a.array.flags.writeable  # frozen, as from_checkpoint leaves CPU weights
    assert (model.lm_head is model.embed) == (full.lm_head is full.embed)


def test_dequantize_shard_matches_the_slice_of_the_whole(rng):
    """Every shard position inside the quantization blocks: the shard's dequantization equals the slice of the
    dequantized whole tensor bit for bit (the same float32 product, the same rounding)."""
    block = (48, 40)
    w = rng.standard_normal((150, 130)).astype(np.float32)
    q, s = quantize_blockwise(w, block)
    whole = dequantize_blockwise(q, s, block)
    for r0, r1, c0, c1 in [(0, 150, 0, 130), (0, 48, 0, 40), (32, 100, 8, 129), (47, 49, 39, 41), (96, 150, 40, 80),
                           (5, 6, 0, 130)]:
        sl = (slice(r0, r1), slice(c0, c1))
        scales = s[r0 // 48:-(-r1 // 48), c0 // 40:-(-c1 // 40)]
        got = dequantize_shard(q[sl], scales, block, (r0 % 48, c0 % 40), ml_dtypes.bfloat16)
        assert np.array_equal(got.view(np.uint16), whole[sl].view(np.uint16)), (r0, r1, c0, c1)
    with pytest.raises(ValueError, match="scales covering"):
        dequantize_shard(q[32:100, 8:129], s, block, (32, 8), ml_dtypes.bfloat16)


# ---- host memory: a rank copies its shards, never a whole tensor ---------------------------------------------------
@pytest.fixture(scope="module")
def wide_folders(tmp_path_factory):
    """Checkpoints whose largest tensors dwarf the rest, so a whole-tensor host copy would show: a 16k vocabulary
    (untied: embed and lm_head 2 MB each in bf16), and an FP8 one with a 2048-wide MLP (gate/up/down 128k e4m3
    elements each)."""
    root = tmp_path_factory.mktemp("tp-wide")
    return {"bf16": make_test_model("tiny", root / "bf16", overrides={"vocab_size": 16384, "tie_word_embeddings": False,
                                                                      **SMALL_IDS}, progress=False),
            "fp8": make_test_model("tiny", root / "fp8", overrides={"vocab_size": 1003, "intermediate_size": 2048,
                                                                    **SMALL_IDS}, fp8=True, progress=False)}


class CopySpy:
    """Records the shape of every host array copied into a tensor (Tensor.copy_: the loader's only write path)."""

    def __init__(self, monkeypatch):
        self.shapes = []
        original = Tensor.copy_

        def copy_(tensor, src):
            self.shapes.append(tuple(src.shape))
            return original(tensor, src)

        monkeypatch.setattr(Tensor, "copy_", copy_)


def traced_peak(fn):
    """(result, peak bytes of host memory allocated while fn runs: NumPy's allocations are traced)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def host_copy(reader, shard, dtype):
    """One shard's host array as the loader makes it: its contiguous copy, or for FP8 its dequantization."""
    arr = shard.take(reader.get(shard.name))
    if shard.block is not None:
        return dequantize_shard(arr, reader.get(shard.name + "_scale_inv")[shard.scale_index], shard.block,
                                shard.scale_offset, dtype)
    return np.ascontiguousarray(arr if arr.dtype == dtype else arr.astype(dtype))


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_loading_a_rank_copies_only_its_shards(kind, wide_folders, monkeypatch):
    """Each copy into the rank's fields is exactly one shard (the multiset of copied shapes is the plan's), and the
    host memory allocated while loading a rank peaks at the rank's own field bytes plus what making the host copy
    of its costliest shard takes alone (bf16: a contiguous copy; FP8: the dequantization's float32 temporaries),
    measured the same way. That bound is checked to be below what the whole largest split tensor would add: its
    bf16 copy, or for FP8 its dequantization (an extra e4m3 copy of a whole tensor, 1 byte an element, is below the
    dequantization temporaries of its shard, ~16 bytes an element, and would not show)."""
    folder = wide_folders[kind]
    config = config_from_pretrained(folder)
    cls = model_class(config)
    table = cls.weight_table(config)
    spy = CopySpy(monkeypatch)
    with CheckpointReader(folder) as reader:
        for tp in (2, 4):
            for rank in (0, tp - 1):
                plan = shard_plan(config, None, tp, rank)
                cost = {s.name: traced_peak(lambda s=s: host_copy(reader, s, ml_dtypes.bfloat16))[1]
                        for s in plan.shards}
                one_shard = max(cost.values())
                largest = max(plan.shards, key=lambda s: (np.prod(s.shape), s.block is not None))
                split = [w for w in table if plan[w.name].shape != w.shape]
                biggest = max(np.prod(w.shape) for w in split)
                whole = 2 * biggest if kind == "bf16" else cost[largest.name] * biggest // np.prod(largest.shape)
                bound = one_shard + 64 * 1024
                assert bound < whole + one_shard / 2, "the check would not see a whole-tensor copy"
                spy.shapes.clear()
                model, peak = traced_peak(lambda: shard_from_checkpoint(cls, config, reader, tp, rank,
                                                                        max_positions=MAX_POSITIONS))
                assert Counter(spy.shapes) == Counter(s.shape for s in plan.shards), (tp, rank)
                own = model.weight_bytes() + model.cos_sin.nbytes
                assert peak <= own + bound, (f"tp {tp} rank {rank}: {peak} bytes allocated, the rank's fields are "
                                             f"{own}, the host copy of its costliest shard takes {one_shard}")


# ---- the loaded layout is the one the TP math needs ----------------------------------------------------------------
def f64(a) -> np.ndarray:
    return np.asarray(a.numpy() if isinstance(a, Tensor) else a, np.float64)


def attention_forward(model, i, res):
    """Layer i's attention block output (o_proj's) of `model` (its own fields and local head counts) for the
    residual `res`, in float64: a rank's partial sum before the all-reduce, or the full model's whole output."""
    c, layer = model.config, model.layers[i]
    x = rmsnorm(res, f64(layer.input_norm), c.rms_norm_eps)
    norms = (f64(layer.q_norm), f64(layer.k_norm)) if layer.q_norm is not None else ()
    return attention(x, f64(layer.qkv), f64(layer.o_proj), c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     *norms)


def mlp_forward(model, i, h, moe_config):
    """Layer i's MLP (dense, or the routed experts with the full config's routing) of `model` on the normed h."""
    layer = model.layers[i]
    if getattr(layer, "router", None) is not None:
        e, hid, m = moe_config.num_experts, model.config.hidden_size, model.config.moe_intermediate_size
        gu = f64(layer.experts_gate_up).reshape(e, 2 * m, hid)
        dn = f64(layer.experts_down).reshape(e, hid, m)
        return moe_block(h, f64(layer.router), lambda k: (gu[k], dn[k]), moe_config)
    return mlp(h, f64(layer.gate_up), f64(layer.down))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_one_layer_summed_over_ranks_is_the_full_layer(name, folders, full_models):
    """One decoder layer (each layer of the MoE checkpoints: sparse and dense) on every rank's loaded weights with
    the rank-local head counts and widths: the o_proj outputs summed over the ranks, the post-attention norm on the
    sum (replicated), the down / experts outputs summed again: the full model's layer output (float64; the ranks
    hold the same bf16 values, so only the summation order differs). The gathered logits of the ranks' lm_head
    rows, cut to the vocabulary, are the full model's. A rank's partial alone, or twice, is not."""
    full = full_models[name]
    c = full.config
    rng = np.random.default_rng(5)
    res = rng.standard_normal((6, c.hidden_size))
    layers = range(c.num_hidden_layers) if hasattr(c, "num_experts") else (0,)
    for tp in [t for t in tps_of(c) if t > 1]:
        ranks = [load_shard(folders[name], tp, r, max_positions=MAX_POSITIONS) for r in range(tp)]
        for i in layers:
            mid = res + attention_forward(full, i, res)
            want = mid + mlp_forward(full, i, rmsnorm(mid, f64(full.layers[i].post_norm), c.rms_norm_eps), c)
            parts = [attention_forward(m, i, res) for m in ranks]
            got_mid = res + sum(parts)  # all-reduce after o_proj
            np.testing.assert_allclose(got_mid, mid, rtol=1e-10, atol=1e-10, err_msg=f"tp {tp} layer {i} attention")
            assert not np.allclose(res + tp * parts[0], mid, rtol=1e-3, atol=1e-3)  # one rank's part is not it
            h = rmsnorm(got_mid, f64(ranks[0].layers[i].post_norm), c.rms_norm_eps)  # replicated on every rank
            got = got_mid + sum(mlp_forward(m, i, h, c) for m in ranks)  # all-reduce after down / the experts
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=f"tp {tp} layer {i}")
        x = rmsnorm(res, f64(full.final_norm), c.rms_norm_eps)
        logits = np.concatenate([x @ f64(m.lm_head).T for m in ranks], axis=1)  # all-gather on rank 0
        assert logits.shape[1] == ranks[0].rank_config.padded_vocab_size
        np.testing.assert_allclose(logits[:, :c.vocab_size], x @ f64(full.lm_head).T, rtol=1e-10, atol=1e-10)
        assert not logits[:, c.vocab_size:].any()  # the padding rows are zeros


def test_errors_before_loading(folders, monkeypatch):
    folder = folders["qwen3"]
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_shard(folder, 3, 0)
    with pytest.raises(ValueError, match="rank must be"):
        load_shard(folder, 2, 2)
    with pytest.raises(ValueError, match="device must be"):
        load_shard(folder, 2, 0, device="tpu")
    import xserv.runtime

    monkeypatch.setattr(xserv.runtime, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        load_shard(folder, 2, 0, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "fp8-moe"])
def test_cuda_ranks_hold_the_cpu_ranks_fields(name, folders, monkeypatch):
    """The CUDA path of the loader (each shard copied into its device field's rows, padding zeroed on the device):
    every rank's device fields equal the CPU-loaded rank's, bit for bit. Two ranks loaded one after the other on
    the one GPU (the visible-GPU check told there are two)."""
    import xserv.runtime

    monkeypatch.setattr(xserv.runtime, "device_count", lambda: 2)
    for rank in range(2):
        on_gpu = load_shard(folders[name], 2, rank, device="cuda", max_positions=MAX_POSITIONS)
        on_cpu = load_shard(folders[name], 2, rank, max_positions=MAX_POSITIONS)
        assert on_gpu.device == "cuda"
        got, want = rank_fields(on_gpu), rank_fields(on_cpu)
        assert set(got) == set(want)
        for key, a in got.items():
            assert np.array_equal(bits(a), bits(want[key])), f"rank {rank} {key}"
