"""FP8 checkpoints (Qwen's -FP8 layout): the quantization_config (accepted, rejected by name, round trip), the block
quantization against a float64 loop (partial edge blocks, ties), random FP8 checkpoints of the dense and MoE tiny
presets loaded as the file stores them (the 128 x 128-block projections as Fp8Weight: the e4m3 bytes and scales
themselves) or as their dequantized file tensors (everything else), the logits of an FP8 checkpoint against its
dequantized bf16 twin (equal where nothing stays FP8; within bf16's rounding of the weights where the projections
run on FP8 weights; NumPy, and CUDA on the GPU against the NumPy model), and the errors of a checkpoint whose scales
are missing or do not match its config."""
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from xserv.engine.batch import SeqChunk, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.models.checkpoint import CheckpointReader
from xserv.models.config import preset_dict
from xserv.fp8_format import E4M3, Fp8Weight, dequantize_blockwise, quantize_blockwise, scale_shape
from xserv.models.fp8 import Fp8BlockQuantization, dequantize_for_load
from xserv.models.llama import LlamaConfig
from xserv.models.qwen3 import Qwen3Config
from xserv.models.qwen3_moe import Qwen3MoeConfig
from xserv.models.random_checkpoint import TOKENIZER_FILES, make_test_model, save_safetensors
from xserv.models.registry import config_from_dict, config_from_pretrained, load_model, model_class
from xserv.tensor import Tensor

from qwen3_reference import write_dequantized_twin

BF16 = np.dtype(ml_dtypes.bfloat16)
# Qwen3-8B-FP8's quantization_config (/work/shared/qwen3-configs/qwen3-8b-fp8.json)
QWEN_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
SHARED_FP8_CONFIG = Path(__file__).resolve().parents[3] / "shared" / "qwen3-configs" / "qwen3-8b-fp8.json"
BLOCK = 4  # KV-cache block size of the forwards below


# ---- the config --------------------------------------------------------------------------------------------------
def test_qwen3_8b_fp8_config_round_trip():
    d = {**preset_dict("8b"), "quantization_config": dict(QWEN_FP8)}
    if SHARED_FP8_CONFIG.is_file():  # the published file itself, where the workplace has it
        d = json.loads(SHARED_FP8_CONFIG.read_text())
        assert d["quantization_config"] == QWEN_FP8
    c = config_from_dict(d)
    assert type(c) is Qwen3Config
    assert c.quantization_config == Fp8BlockQuantization((128, 128))
    out = c.to_dict()
    assert out["quantization_config"] == QWEN_FP8
    assert config_from_dict(out) == c and hash(config_from_dict(out)) == hash(c)
    # an unquantized config writes no quantization_config (bf16 config.json files stay as they were)
    plain = config_from_dict(preset_dict("8b"))
    assert plain.quantization_config is None and "quantization_config" not in plain.to_dict()
    assert plain != c and plain == c.replace(quantization_config=None)


def test_other_blocks_modules_and_architectures():
    q = {"quant_method": "fp8", "weight_block_size": [64, 32], "modules_to_not_convert": ["lm_head"],
         "ignored_layers": ["model.layers.0.mlp.gate", "lm_head"], "dequantize": False}
    c = config_from_dict({**preset_dict("moe-tiny"), "quantization_config": q})
    assert type(c) is Qwen3MoeConfig  # the MoE config keeps it through its own from_dict
    assert c.quantization_config == Fp8BlockQuantization((64, 32), ("lm_head", "model.layers.0.mlp.gate"))
    assert c.to_dict()["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                                  "weight_block_size": [64, 32],
                                                  "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    assert config_from_dict(c.to_dict()) == c
    llama = config_from_dict({**preset_dict("llama3-tiny"), "quantization_config": QWEN_FP8})
    assert type(llama) is LlamaConfig and llama.quantization_config.weight_block_size == (128, 128)
    assert Qwen3Config.preset("tiny", quantization_config=None).quantization_config is None


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "'compressed-tensors'"),
    ({"quant_method": "fbgemm_fp8"}, "'fbgemm_fp8'"),
    ({"quant_method": "my-own-int3"}, "'my-own-int3'"),
    ({"bits": 4}, "no quant_method"),
    ({**QWEN_FP8, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**QWEN_FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({k: v for k, v in QWEN_FP8.items() if k != "weight_block_size"}, "weight_block_size is required"),
    ({**QWEN_FP8, "weight_block_size": [128]}, "weight_block_size"),
    ({**QWEN_FP8, "weight_block_size": [128, 0]}, "weight_block_size"),
    ({**QWEN_FP8, "weight_block_size": [128.0, 128]}, "weight_block_size"),
    ({**QWEN_FP8, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({**QWEN_FP8, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({**QWEN_FP8, "weight_per_tensor": True}, "'weight_per_tensor'"),
    ("fp8", "quantization_config must be an object"),
])
@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_rejections_name_the_method_or_field(preset, qc, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")) as e:
        config_from_dict({**preset_dict(preset), "quantization_config": qc})
    assert "quantization_config" in str(e.value)


def test_modules_to_not_convert_matches_at_dot_boundaries():
    q = Fp8BlockQuantization(modules_to_not_convert=("model.layers.1.mlp.gate", "lm_head"))
    assert q.excludes("model.layers.1.mlp.gate") and q.excludes("lm_head")
    assert not q.excludes("model.layers.11.mlp.gate") and not q.excludes("model.layers.1.mlp.gate_proj")
    assert not q.excludes("model.layers.21.mlp.gate") and not q.excludes("model.layers.1.mlp.experts.0.gate_proj")
    every_router = Fp8BlockQuantization(modules_to_not_convert=("mlp.gate",))
    assert every_router.excludes("model.layers.7.mlp.gate")
    assert not every_router.excludes("model.layers.7.mlp.gate_proj")
    star = Fp8BlockQuantization(modules_to_not_convert=("model.layers.*.self_attn",))
    assert star.excludes("model.layers.12.self_attn.k_proj") and not star.excludes("model.layers.12.mlp.up_proj")
    assert not Fp8BlockQuantization().excludes("lm_head")


def test_weight_table_marks_the_quantized_linears():
    c = Qwen3MoeConfig.preset("moe-tiny", quantization_config={**QWEN_FP8, "weight_block_size": [48, 40]},
                              mlp_only_layers=[2], tie_word_embeddings=False)
    table = model_class(c).weight_table(c)
    quantized = {w.name for w in table if w.quantized}
    for w in table:
        linear = len(w.shape) == 2 and w.field not in ("embed", "lm_head", "router")
        assert w.quantized == linear, w.name
        if w.quantized:
            assert w.block == (48, 40) and w.scale_name == w.name + "_scale_inv"
            assert w.scale_shape == (-(-w.shape[0] // 48), -(-w.shape[1] // 40))
    assert "model.layers.2.mlp.down_proj.weight" in quantized  # the dense layer's MLP too
    assert "model.layers.0.mlp.experts.15.up_proj.weight" in quantized
    assert "model.layers.0.mlp.gate.weight" not in quantized and "lm_head.weight" not in quantized


# ---- the reference against a float64 loop -----------------------------------------------------------------------
_CODES = np.arange(256, dtype=np.uint8)
_VALUES = _CODES.view(E4M3).astype(np.float64)
_FINITE = np.isfinite(_VALUES)


def e4m3_rne(x: float) -> int:
    """The e4m3 code nearest to x (|x| <= 448), ties to the even code: by search over the 254 finite codes."""
    codes, values = _CODES[_FINITE], _VALUES[_FINITE]
    dist = np.abs(values - x)
    best = np.flatnonzero(dist == dist.min())
    best = [c for c in codes[best] if not (c == 0x80 and x >= 0) and not (c == 0 and x < 0)] or list(codes[best])
    even = [c for c in best if c % 2 == 0]
    return int((even or best)[0])


def f32(x: float) -> np.float32:
    return np.float32(x)  # float64 -> float32, round to nearest even (of a float64 product or quotient that is exact
    # or rounded once more finely: innocuous for + - * /, 53 >= 2 * 24 + 2)


def bf16_rne(x: np.float32) -> int:
    """bf16 bits of a float32, round to nearest even, by integer arithmetic."""
    u = int(np.array(x, np.float32).view(np.uint32))
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def quantize_loop(w: np.ndarray, block):
    rows, cols = w.shape
    bo, bi = block
    nbo, nbi = -(-rows // bo), -(-cols // bi)
    q = np.zeros((rows, cols), np.uint8)
    s = np.zeros((nbo, nbi), np.float32)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].astype(np.float64)
            amax = float(np.abs(blk).max())
            s[i, j] = f32(amax / 448.0) if amax > 0 else np.float32(1)
            for r in range(blk.shape[0]):
                for c in range(blk.shape[1]):
                    q[i * bo + r, j * bi + c] = e4m3_rne(float(f32(blk[r, c] / float(s[i, j]))))
    return q, s


def dequantize_loop(q: np.ndarray, s: np.ndarray, block) -> np.ndarray:
    out = np.zeros(q.shape, np.uint16)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = bf16_rne(f32(float(_VALUES[q[r, c]]) * float(s[r // block[0], c // block[1]])))
    return out


@pytest.mark.parametrize("shape, block", [((70, 45), (32, 16)), ((128, 128), (128, 128)), ((5, 300), (128, 128)),
                                          ((33, 7), (1, 3))])
def test_quantize_blockwise_matches_a_float64_loop(shape, block, rng):
    # a wide dynamic range per block (e4m3 subnormals included), an all-zero block, bf16 inputs as the checkpoints'
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape)) + 0.01
    w[:block[0], :block[1]] = 0
    w = w.astype(BF16)
    if shape == (70, 45):  # a block whose amax is 448 (scale 1): its values at e4m3 midpoints must go to even
        mid = np.array([448, 1.0625, 1.1875, -1.0625, 0.0146484375, 3.25, 0.009765625], np.float64)
        w[32:33, 16:16 + len(mid)] = mid.astype(BF16)  # 1.0625 -> 1, 1.1875 -> 1.25, 2^-9*7.5 -> 2^-9*8
        # scale 196 / 448 = 0.4375: 0.68359375 / 0.4375 is the midpoint 1.5625 (-> 1.5, even), but
        # 0.68359375 * float32(1 / 0.4375) is above it (-> 1.625): the division, not a reciprocal product
        w[40, :2] = np.array([196, 0.68359375]).astype(BF16)
    q, s = quantize_blockwise(w, block)
    q_ref, s_ref = quantize_loop(w, block)
    assert q.dtype == E4M3 and s.dtype == np.float32 and s.shape == scale_shape(shape, block)
    assert np.array_equal(s.view(np.uint32), s_ref.view(np.uint32))
    assert np.array_equal(q.view(np.uint8), q_ref)
    if shape == (70, 45):
        assert s[1, 1] == 1 and list(q[32, 16:23].astype(np.float32)) == [448, 1, 1.25, -1, 0.015625, 3.25, 0.009765625]
        assert s[1, 0] == 0.4375 and list(q[40, :2].astype(np.float32)) == [448, 1.5]
    # the round trip is within e4m3's half ulp of each block's scale
    back = dequantize_blockwise(q, s, block, np.float32)
    err = np.abs(back - w.astype(np.float32))
    assert np.all(err <= 0.0625 * np.abs(w.astype(np.float32)) + np.repeat(np.repeat(s, block[0], 0), block[1], 1)[
        :shape[0], :shape[1]] * 2.0 ** -10)


@pytest.mark.parametrize("shape, block", [((70, 45), (32, 16)), ((129, 257), (128, 128)), ((3, 5), (128, 128))])
def test_dequantize_blockwise_matches_a_float64_loop(shape, block, rng):
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (e4m3fn's only non-finite values): 1.0 instead
    q = codes.view(E4M3)
    s = np.exp2(rng.uniform(-20, 10, scale_shape(shape, block))).astype(np.float32)
    s[0, 0] = np.float32(1 + 2.0 ** -8)  # with q = 1: the bf16 midpoint between 1 and 1 + 2^-7, goes to 1 (even)
    codes[0, :2] = [0x38, 0x3A]  # 1.0 and 1.25
    if s.shape[1] > 1:
        s[0, 1] = np.float32(1 + 3 * 2.0 ** -8)  # with q = 1: the midpoint above 1 + 2^-7, goes to 1 + 2^-6 (even)
        codes[0, block[1]] = 0x38
    got = dequantize_blockwise(q, s, block)
    assert got.dtype == BF16 and got.shape == shape
    assert np.array_equal(got.view(np.uint16), dequantize_loop(codes, s, block))
    assert got[0, 0] == 1 and got[0, 1] == np.float32(1.25 * s[0, 0]).astype(BF16)
    if s.shape[1] > 1:
        assert float(got[0, block[1]]) == 1 + 2.0 ** -6
    # float32 out: the float32 products themselves; out= writes in place
    prod = np.array([[f32(float(_VALUES[codes[r, c]]) * float(s[r // block[0], c // block[1]]))
                      for c in range(shape[1])] for r in range(shape[0])], np.float32)
    assert np.array_equal(dequantize_blockwise(q, s, block, np.float32), prod)
    out = np.full(shape, np.nan, BF16)
    assert dequantize_blockwise(q, s, block, out=out) is out
    assert np.array_equal(out.view(np.uint16), got.view(np.uint16))
    with pytest.raises(ValueError, match="scale_inv"):
        dequantize_blockwise(q, s[:, :-1] if s.shape[1] > 1 else s[:0], block)


def test_parallel_load_dequantization_is_the_reference(rng):
    """Chunks of whole block rows over a thread pool: the bytes of one dequantize_blockwise call."""
    shape, block = (1000, 4100), (128, 128)  # 4 block rows a chunk: 2 chunks, partial edge blocks both ways
    q = rng.integers(0, 0x7E, shape).astype(np.uint8).view(E4M3)
    s = rng.uniform(1e-4, 1e-2, scale_shape(shape, block)).astype(np.float32)
    want = dequantize_blockwise(q, s, block)
    got = dequantize_for_load(q, s, block, BF16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(dequantize_for_load(q, s, block, np.float32), dequantize_blockwise(q, s, block, np.float32))


# ---- random FP8 checkpoints ----------------------------------------------------------------------------------------
# The dense tiny preset with blocks of 48 x 40: q (256 rows), k and v (128), gate and up (192) and the hidden size
# 64 are no multiple of the block, so each fused part's scales are the source tensor's own block rows.
VARIANTS = {
    "dense": ("tiny", {"tie_word_embeddings": False, "initializer_range": 0.1,
                       "quantization_config": {**QWEN_FP8, "weight_block_size": [48, 40]}}, False),
    "dense-128": ("tiny", {"initializer_range": 0.1}, True),
    "moe": ("moe-tiny", {"initializer_range": 0.1, "mlp_only_layers": [1]}, True),
    # experts of whole 128 x 128 blocks (H = I = 128): they stay FP8 too, for the FP8 expert GEMMs
    "moe-128": ("moe-tiny", {"initializer_range": 0.1, "mlp_only_layers": [1], "moe_intermediate_size": 128}, True),
}


@pytest.fixture(autouse=True)
def fp8_experts_kept(monkeypatch):
    """Every load here keeps FP8 experts FP8 where their shapes allow (XSERV_FP8_EXPERTS=e4m3; the default dequantizes
    them: test_fp8_experts_load_dequantized_by_default)."""
    monkeypatch.setenv("XSERV_FP8_EXPERTS", "e4m3")


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    """name -> (FP8 checkpoint, its bf16 twin: the dequantized tensors and the config without quantization_config)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, (preset, overrides, fp8) in VARIANTS.items():
        folder = make_test_model(preset, root / name, seed=7, overrides=overrides, fp8=fp8, progress=False)
        out[name] = (folder, write_dequantized_twin(folder, root / f"{name}-bf16"))
    return out


def expected_rows(reader, w) -> np.ndarray:
    arr = reader.get(w.name)
    return dequantize_blockwise(arr, reader.get(w.scale_name), w.block) if w.quantized else arr


def model_rows(model, w) -> np.ndarray:
    """The rows of w's field the model holds, as values (an Fp8Weight dequantized to float32)."""
    owner = model if w.layer is None else model.layers[w.layer]
    field = getattr(owner, w.field)
    arr = field.dequantize() if isinstance(field, Fp8Weight) else field.numpy()
    return arr if w.rows is None else arr[w.rows[0]:w.rows[1]]


# The fields that stay FP8 in layer 0 (tiny: q 256, k 128, v 128 rows: each part starts on a 128-row block; gate and
# up 192 rows each: up starts inside a block; moe-tiny: the attention projections, its experts (I = 64) not; with
# I = 128 both experts fields too)
KEPT_LAYER0 = {"dense": set(), "dense-128": {"qkv", "o_proj", "down"}, "moe": {"qkv", "o_proj"},
               "moe-128": {"qkv", "o_proj", "experts_gate_up", "experts_down"}}


@pytest.mark.parametrize("name", VARIANTS)
def test_loads_fp8_projections_as_stored_and_the_rest_dequantized(fp8_folders, name):
    folder, _ = fp8_folders[name]
    model = load_model(folder, "cpu", progress=False, max_positions=256)
    c = model.config
    assert c.quantization_config is not None and model.dtype == BF16
    assert {f for f, t in vars(model.layers[0]).items() if isinstance(t, Fp8Weight)} == KEPT_LAYER0[name]
    table = model_class(c).weight_table(c)
    kept = 0
    with CheckpointReader(folder) as r:
        for w in table:
            owner = model if w.layer is None else model.layers[w.layer]
            field = getattr(owner, w.field)
            if isinstance(field, Fp8Weight):  # the file's e4m3 bytes and its scales, at the part's rows
                kept += 1
                r0, r1 = w.rows or (0, w.shape[0])
                assert field.weight.dtype == E4M3 and field.scale_inv.dtype == np.float32
                assert np.array_equal(field.weight.numpy()[r0:r1].view(np.uint8), r.get(w.name).view(np.uint8))
                s0 = r0 // 128
                assert np.array_equal(field.scale_inv.numpy()[s0:s0 + w.scale_shape[0]], r.get(w.scale_name)), w.name
            else:
                got, want = model_rows(model, w), expected_rows(r, w)
                assert got.dtype == BF16 and np.array_equal(got.view(np.uint16), want.view(np.uint16)), w.name
    assert (kept > 0) == bool(KEPT_LAYER0[name])
    # float32 weights on request: everything dequantized, the float32 products themselves
    model32 = load_model(folder, "cpu", progress=False, max_positions=256, dtype="float32")
    assert not model32.has_fp8_weights
    w = next(w for w in table if w.field == "qkv" and w.rows[0] > 0)  # k_proj: rows inside the fused tensor
    with CheckpointReader(folder) as r:
        want = dequantize_blockwise(r.get(w.name), r.get(w.scale_name), w.block, np.float32)
    assert np.array_equal(model_rows(model32, w), want)


@pytest.mark.parametrize("name", ["dense-128", "moe-128"])  # moe-128: its experts FP8 too
def test_fp8_weights_count_their_bytes_and_parameters(fp8_folders, name):
    folder, twin = fp8_folders[name]
    fp8 = load_model(folder, "cpu", progress=False, max_positions=64)
    bf16 = load_model(twin, "cpu", progress=False, max_positions=64)
    assert fp8.num_parameters() == bf16.num_parameters()
    kept = [t for layer in fp8.layers for t in vars(layer).values() if isinstance(t, Fp8Weight)]
    saved = sum(t.num_parameters - t.scale_inv.nbytes for t in kept)  # 2 bytes -> 1 byte a weight, plus scales
    assert kept and fp8.weight_bytes() == bf16.weight_bytes() - saved
    # the benchmarks' FLOP limits count parameters, not bytes
    from xserv.bench.common import prefill_flops

    assert prefill_flops(fp8, [17, 5]) == prefill_flops(bf16, [17, 5]) > 0


def test_fp8_decode_roofline_leaves_the_embedding_table_out(fp8_folders):
    """The FP8 batch-1 roofline: FP8 weight bytes + the bf16 lm_head + K/V; an untied input embedding table is
    read one row a token, so it is left out (a bf16 dense model's convention still counts it)."""
    from xserv.bench.common import decode_weight_bytes, embedding_table_bytes

    folder, twin = fp8_folders["dense"]  # untied; nothing stays FP8 here: the bf16 convention
    plain = load_model(folder, "cpu", progress=False, max_positions=64)
    assert not plain.has_fp8_weights and embedding_table_bytes(plain) == 0
    untied = make_test_model("tiny", folder.parent / "untied-128", seed=3, fp8=True, progress=False,
                             overrides={"tie_word_embeddings": False, "initializer_range": 0.1})
    fp8 = load_model(untied, "cpu", progress=False, max_positions=64)
    c = fp8.config
    assert fp8.has_fp8_weights and embedding_table_bytes(fp8) == 2 * c.vocab_size * c.hidden_size == fp8.embed.nbytes
    assert decode_weight_bytes(fp8, 1) == fp8.weight_bytes() - fp8.embed.nbytes


def forward_logits(model, seqs) -> list[np.ndarray]:
    """Logits of a packed prefill of `seqs` (every position), a decode step of all of them, and a decode step of
    the first alone (one token: the fused path on CUDA)."""
    cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 32, model.device, model.dtype)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(seqs))]

    def step(chunks):
        return model.forward(make_batch(chunks, BLOCK, model.device), cache).numpy().copy()

    return [step([SeqChunk(s, 0, t, "all") for s, t in zip(seqs, tables)]),
            step([SeqChunk([7], len(s), t, "last") for s, t in zip(seqs, tables)]),
            step([SeqChunk([9], len(seqs[0]) + 1, tables[0], "last")])]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def pow2_folders(fp8_folders, tmp_path_factory):
    """name -> (the FP8 checkpoint with every scale rounded to a power of two, its dequantized bf16 twin): the values
    e4m3 x 2^k have 4 significant bits, so the twin's bf16 weights are the FP8 weights' values exactly, and the two
    models differ only in how the projections sum (linear_fp8 vs the bf16 linear)."""
    root = tmp_path_factory.mktemp("fp8-pow2")
    out = {}
    for name in ("dense-128", "moe", "moe-128"):
        folder = root / name
        with CheckpointReader(fp8_folders[name][0]) as r:
            scales = {n: np.exp2(np.round(np.log2(a))).astype(np.float32) for n, a in r.items()
                      if n.endswith("_scale_inv")}
        copy_without(fp8_folders[name][0], folder, replace=scales)
        for f in TOKENIZER_FILES + ("generation_config.json",):
            shutil.copyfile(fp8_folders[name][0] / f, folder / f)
        out[name] = (folder, write_dequantized_twin(folder, root / f"{name}-bf16"))
    return out


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "moe-128"])  # its FP8 experts: the test below
def test_logits_equal_the_dequantized_bf16_twin(fp8_folders, pow2_folders, name, rng):
    """Nothing kept FP8 ("dense", 48 x 40 blocks): the twin's bytes, the same logits. Projections on FP8 weights:
    with power-of-two scales the twin's weights are the same values, so the logits agree but for the order of the
    sums (float64 in linear_fp8's reference, float32 in the bf16 linear's): within 1e-3 relative, every row. (With
    the checkpoint's own scales the twin rounds every weight to bf16, and the logits differ by ~1e-2: the test could
    not tell a wrong scale row from that.)"""
    folder, twin = (pow2_folders if name in pow2_folders else fp8_folders)[name]
    fp8 = load_model(folder, "cpu", progress=False, max_positions=256)
    bf16 = load_model(twin, "cpu", progress=False, max_positions=256)
    assert bf16.config.quantization_config is None and bf16.config == fp8.config.replace(quantization_config=None)
    assert fp8.has_fp8_weights == bool(KEPT_LAYER0[name])
    seqs = [rng.integers(0, fp8.config.vocab_size, n).tolist() for n in (11, 3)]
    got, want = forward_logits(fp8, seqs), forward_logits(bf16, seqs)
    for g, w in zip(got, want):
        assert np.all(np.isfinite(g))
        if not fp8.has_fp8_weights:
            assert np.array_equal(g, w)
        else:
            assert max(relative_error(a, b) for a, b in zip(g, w)) < 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_experts_are_the_twins_experts_bit_for_bit(fp8_folders, device, rng):
    """FP8 experts ("moe-128": e4m3 with their block scales, the CUDA path's FP8 expert GEMMs) compute what the twin's
    dequantized bf16 experts compute, bit for bit: with every other FP8 projection replaced by the twin's bf16 tensor,
    the logits of a prefill, a decode step of two and one of one (the fused one-token MoE step on CUDA) are the twin
    model's exactly. (With the FP8 attention projections kept, a sum-order difference upstream can flip a routing
    near-tie: test_logits_equal_the_dequantized_bf16_twin's 1e-3 does not hold for this variant.)"""
    folder, twin = fp8_folders["moe-128"]
    fp8 = load_model(folder, device, progress=False, max_positions=256)
    bf16 = load_model(twin, device, progress=False, max_positions=256)
    for mine, theirs in zip(fp8.layers, bf16.layers):
        kept = {f for f, t in vars(mine).items() if isinstance(t, Fp8Weight)}
        if mine.router is not None:
            assert {"experts_gate_up", "experts_down"} <= kept
        for field in kept - {"experts_gate_up", "experts_down"}:
            setattr(mine, field, getattr(theirs, field))
    seqs = [rng.integers(0, fp8.config.vocab_size, n).tolist() for n in (11, 3)]
    for g, w in zip(forward_logits(fp8, seqs), forward_logits(bf16, seqs)):
        assert np.all(np.isfinite(g)) and np.array_equal(g, w)


def test_fp8_experts_load_dequantized_by_default(fp8_folders, monkeypatch):
    """Without XSERV_FP8_EXPERTS (or with bf16) a MoE FP8 checkpoint loads as its bf16 twin, every projection (the
    attention's too), and the load notice says how to keep it FP8; an unknown value is a clear error naming the
    variable."""
    folder, twin = fp8_folders["moe-128"]
    c = config_from_pretrained(folder)
    cls = model_class(c)
    for value in (None, "bf16"):
        if value is None:
            monkeypatch.delenv("XSERV_FP8_EXPERTS")
        else:
            monkeypatch.setenv("XSERV_FP8_EXPERTS", value)
        model = load_model(folder, "cpu", progress=False, max_positions=64)
        bf16 = load_model(twin, "cpu", progress=False, max_positions=64)
        for layer, twin_layer in zip(model.layers, bf16.layers):
            fields = {f: t for f, t in vars(layer).items() if isinstance(t, (Tensor, Fp8Weight))}
            assert fields and not any(isinstance(t, Fp8Weight) for t in fields.values())
            for field, t in fields.items():
                assert np.array_equal(t.numpy().view(np.uint16), getattr(twin_layer, field).numpy().view(np.uint16))
        notice = cls.fp8_load_notice(c)
        assert "mixture-of-experts checkpoint: dequantized to bfloat16 at load" in notice
        assert "XSERV_FP8_EXPERTS=e4m3 keeps it in FP8" in notice
        assert not cls.loads_fp8_experts(c)
    monkeypatch.setenv("XSERV_FP8_EXPERTS", "e4m3")
    assert cls.loads_fp8_experts(c) and not cls.loads_fp8_experts(config_from_pretrained(fp8_folders["moe"][0]))
    # the start-up compiles the moe piece of the experts' format, as the model class names it (FP8 on one GPU only:
    # under tensor parallelism every FP8 weight loads dequantized)
    from xserv.runtime.compiler import startup_families

    shapes = cls.kernel_shapes(c)
    assert shapes["moe"] == 1 and shapes["fp8"] == 1 and shapes["moe_fp8"] == 1
    assert cls.kernel_shapes(c, tp_size=2)["moe_fp8"] == 0
    assert "moe:e1_x1" in startup_families("sm_90a", shapes)
    assert "moe:e1_x0" in startup_families("sm_90a", {**shapes, "moe_fp8": 0})
    notice = cls.fp8_load_notice(c)  # only the dense layer's gate and up (up starts inside a block) are dequantized
    quantized = sum(w.quantized for w in cls.weight_table(c))
    assert f"2 of its {quantized} quantized weights" in notice and "experts" not in notice
    assert "XSERV_FP8_EXPERTS" not in notice
    monkeypatch.setenv("XSERV_FP8_EXPERTS", "fp4")
    with pytest.raises(ValueError, match="XSERV_FP8_EXPERTS='fp4': expected one of bf16, e4m3"):
        load_model(folder, "cpu", progress=False, max_positions=64)


def test_fp8_is_the_quantized_bf16_checkpoint_of_the_same_seed(fp8_folders, tmp_path):
    """make_test_model(fp8=True) quantizes the draws the float checkpoint of its seed holds."""
    folder, _ = fp8_folders["dense-128"]
    plain = make_test_model("tiny", tmp_path / "plain", seed=7, overrides=VARIANTS["dense-128"][1], progress=False)
    c = config_from_pretrained(folder)
    with CheckpointReader(folder) as r, CheckpointReader(plain) as p:
        for w in model_class(c).weight_table(c):
            if w.quantized:
                q, s = quantize_blockwise(p.get(w.name), w.block)
                assert np.array_equal(r.get(w.name).view(np.uint8), q.view(np.uint8)), w.name
                assert np.array_equal(r.get(w.scale_name), s), w.name
            else:
                assert np.array_equal(r.get(w.name).view(np.uint16), p.get(w.name).view(np.uint16)), w.name


# ---- checkpoints that do not match their config ----------------------------------------------------------------
def copy_without(folder: Path, out: Path, drop=(), replace=None, config_changes=None) -> Path:
    out.mkdir()
    with CheckpointReader(folder) as r:
        tensors = {n: a.copy() for n, a in r.items() if n not in drop}
    tensors.update(replace or {})
    save_safetensors(out / "model.safetensors", tensors)
    config = json.loads((folder / "config.json").read_text())
    for k, v in (config_changes or {}).items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_missing_or_wrong_scales_are_named(fp8_folders, tmp_path):
    folder, _ = fp8_folders["moe"]
    scale = "model.layers.1.mlp.down_proj.weight_scale_inv"  # layer 1 is the dense one
    expert = "model.layers.3.mlp.experts.5.gate_proj.weight_scale_inv"
    bad = copy_without(folder, tmp_path / "bad", drop=[scale],
                       replace={expert: np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError) as e:
        load_model(bad, "cpu", progress=False)
    msg = str(e.value)
    assert f"missing (1): {scale}" in msg
    assert f"wrong shape (1): {expert} is [2, 2], expected [1, 1]" in msg
    # a scale in another dtype, an e4m3 tensor where the config keeps bf16 (the router)
    router = "model.layers.0.mlp.gate.weight"
    with CheckpointReader(folder) as r:
        router_e4m3 = r.get(router).astype(np.float32).astype(E4M3)
    typed = copy_without(folder, tmp_path / "typed", replace={
        scale: np.ones((1, 2), np.float64), router: router_e4m3})
    with pytest.raises(ValueError, match=r"wrong dtype \(2\)") as e:
        load_model(typed, "cpu", progress=False)
    assert f"{scale} is F64, expected F32" in str(e.value) and f"{router} is F8_E4M3, expected BF16" in str(e.value)


def test_config_and_checkpoint_disagree(fp8_folders, tmp_path):
    folder, twin = fp8_folders["dense"]
    # FP8 tensors, config.json without its quantization_config: the scales are unexpected, the e4m3 weights named
    stripped = copy_without(folder, tmp_path / "stripped", config_changes={"quantization_config": None})
    with pytest.raises(ValueError, match="no quantization_config") as e:
        load_model(stripped, "cpu", progress=False)
    assert "unexpected (" in str(e.value) and "model.layers.0.self_attn.q_proj.weight is F8_E4M3" in str(e.value)
    # bf16 tensors, a config that says FP8: every scale missing, every linear weight of the wrong dtype
    claimed = copy_without(twin, tmp_path / "claimed", config_changes={"quantization_config": QWEN_FP8})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight_scale_inv") as e:
        load_model(claimed, "cpu", progress=False)
    assert "model.layers.1.mlp.up_proj.weight is BF16, expected F8_E4M3" in str(e.value)


def test_modules_to_not_convert_stay_bf16(tmp_path):
    q = {**QWEN_FP8, "modules_to_not_convert": ["model.layers.1.self_attn.k_proj", "mlp.down_proj"]}
    folder = make_test_model("tiny", tmp_path / "m", seed=2, overrides={"quantization_config": q}, progress=False)
    with CheckpointReader(folder) as r:
        assert r.dtype("model.layers.1.self_attn.k_proj.weight") == BF16
        assert r.dtype("model.layers.0.self_attn.k_proj.weight") == E4M3
        assert r.dtype("model.layers.1.mlp.down_proj.weight") == r.dtype("model.layers.0.mlp.down_proj.weight") == BF16
        assert "model.layers.1.self_attn.k_proj.weight_scale_inv" not in r
        model = load_model(folder, "cpu", progress=False, max_positions=64)
        c = model.config
        for w in model_class(c).weight_table(c):
            if isinstance(getattr(model.layers[w.layer] if w.layer is not None else model, w.field), Fp8Weight):
                want = dequantize_blockwise(r.get(w.name), r.get(w.scale_name), w.block, np.float32)
                assert np.array_equal(model_rows(model, w), want), w.name
            else:
                assert np.array_equal(model_rows(model, w).view(np.uint16), expected_rows(r, w).view(np.uint16)), w.name
        # layer 1's qkv holds a bf16 part (k_proj), so the whole field is bf16 there; layer 0's stays FP8
        assert isinstance(model.layers[0].qkv, Fp8Weight) and not isinstance(model.layers[1].qkv, Fp8Weight)


def test_llm_says_once_what_was_dequantized(fp8_folders, caplog):
    """tiny (2 layers, 7 quantized weights each): its gate/up parts are off the 128-row grid (4 dequantized); the
    notice, one warning on the 'xserv' logger, names the counts and an example; an FP8 checkpoint whose every
    quantized weight stays FP8 says nothing; nor does a bf16 one."""
    import logging

    from xserv import LLM, SamplingParams

    def fp8_notices():
        return [r.getMessage() for r in caplog.records if r.name == "xserv" and "FP8" in r.getMessage()]

    folder, twin = fp8_folders["dense-128"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    caplog.set_level(logging.WARNING, logger="xserv")
    with LLM(str(folder), device="cpu", max_model_len=64, progress=False) as llm:
        llm.generate("Hello", greedy)
    [notice] = fp8_notices()
    assert notice.startswith("FP8 e4m3, 128x128 blocks checkpoint: 4 of its 14 quantized weights are dequantized to "
                             "bfloat16 at load"), notice
    assert "e.g. model.layers.0.mlp.gate_proj.weight); the other 10 stay FP8" in notice
    caplog.clear()
    all_kept = make_test_model("tiny", folder.parent / "all-kept", seed=3,
                               overrides={"intermediate_size": 256, "initializer_range": 0.1}, fp8=True, progress=False)
    with LLM(str(all_kept), device="cpu", max_model_len=64, progress=False) as llm:
        llm.generate("Hello", greedy)
    with LLM(str(twin), device="cpu", max_model_len=64, progress=False) as llm:
        llm.generate("Hello", greedy)
    assert fp8_notices() == []


def emulate_fp8_gemm_activations(monkeypatch):
    """Make the NumPy model compute what the CUDA model computes on the cuBLASLt FP8 path (sm_90 and up): there a
    call of M >= 8 rows quantizes the activations of its first M - M % 4 rows to e4m3 per 1 x 128 group (the W8A8
    GEMM; xserv/ops/fp8_linear.py), which the NumPy reference, bf16 activations throughout, does not."""
    import xserv.ops.fp8_linear as F
    from xserv.ops.fp8_quant import dequantize_1x128, quantize_1x128_reference

    plain = F.linear_fp8_reference

    def w8a8(x, q, s, *args):
        m = x.shape[0]
        if m >= F.FP8_GEMM_FROM_M:
            main = m - m % F.FP8_GEMM_M_MULTIPLE
            x = x.astype(np.float64)
            x[:main] = dequantize_1x128(*quantize_1x128_reference(x[:main].astype(BF16)))
        return plain(x, q, s, *args)

    monkeypatch.setattr(F, "linear_fp8_reference", w8a8)


@pytest.mark.gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_cuda_fp8_model_against_numpy(fp8_folders, name, rng, monkeypatch):
    """On the GPU (a prefill of two packed sequences, 14 rows: the FP8 GEMM path; a decode step of two and of one: the
    FP8 GEMV): the CUDA model of the FP8 checkpoint against the NumPy model of the same checkpoint computing what the
    device's path computes. Weight-only paths (below sm_90, XSERV_ARCH=sm_80 / sm_89: bf16 activations): every row
    within the model tests' 3e-2 (the MoE model: 80% of rows, as test_moe_model: routing near-ties). The W8A8 GEMM
    of sm_90 (activations rounded to e4m3 per 1 x 128 group, emulated in the NumPy model): e4m3's rounding is a step
    function (2^-4 relative), so the two models' last-bit differences upstream flip some activations' codes and the
    logits differ by that quantization noise, not by bf16 noise: rows within 1e-1 and their mean within 6e-2 (an
    H100: dense 1.6e-2..4.6e-2, mean 3.2e-2; MoE 2.0e-2..7.4e-2). A wrong scale row or a misplaced shard is O(1).
    Where nothing stays FP8 ("dense"), the twin's bytes: the logits equal the bf16 twin's."""
    from xserv.ops.fp8_linear import choose_path
    from xserv.runtime import get_device

    folder, twin = fp8_folders[name]
    fp8 = load_model(folder, "cuda", progress=False, max_positions=256)
    assert fp8.has_fp8_weights == bool(KEPT_LAYER0[name])
    seqs = [rng.integers(0, fp8.config.vocab_size, n).tolist() for n in (11, 3)]
    got = forward_logits(fp8, seqs)
    if not fp8.has_fp8_weights:
        for g, w in zip(got, forward_logits(load_model(twin, "cuda", progress=False, max_positions=256), seqs)):
            assert np.all(np.isfinite(g)) and np.array_equal(g, w)
        return
    w8a8 = choose_path(14, get_device().arch) == "cublas_fp8"
    if w8a8:
        emulate_fp8_gemm_activations(monkeypatch)
    reference = forward_logits(load_model(folder, "cpu", progress=False, max_positions=256), seqs)
    bound = 1e-1 if w8a8 else 3e-2
    for g, r in zip(got, reference):
        assert np.all(np.isfinite(g))
        errors = np.array([relative_error(a, b) for a, b in zip(g, r)])
        if name.startswith("moe"):
            assert np.mean(errors < bound) >= 0.8, errors
        else:
            assert errors.max() < bound, errors
        if w8a8:
            assert errors.mean() < 6e-2, errors


# ---- the fused one-token path on FP8 weights ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def fused_fp8_folders(fp8_folders, tmp_path_factory):
    """name -> FP8 checkpoint: "all" (the tiny dense preset with I = 256: gate and up start on block rows, so all four
    projections stay FP8, the gate/up one through the paired SiLU-and-mul entry), "dense-128" (gate/up dequantized:
    a layer mixing FP8 and bf16 projections), "moe" (FP8 attention projections, a dense-MLP layer beside sparse
    ones)."""
    folder = make_test_model("tiny", tmp_path_factory.mktemp("fp8-fused") / "all", seed=11, fp8=True, progress=False,
                             overrides={"initializer_range": 0.1, "intermediate_size": 256})
    return {"all": folder, "dense-128": fp8_folders["dense-128"][0], "moe": fp8_folders["moe"][0]}


FUSED_KEPT = {"all": {"qkv", "o_proj", "gate_up", "down"}, "dense-128": KEPT_LAYER0["dense-128"],
              "moe": KEPT_LAYER0["moe"]}


def fused_and_unfused_decode(model, seq, steps=3):
    """Logits of `steps` one-token decode steps after a prefill of seq, through the model's fused one-token path
    (_forward_fused, what fused_forward_ok picks on CUDA) and through its unfused ops (forward with fused_gemv off),
    each on a cache of its own: lists of float32 [1, vocab]."""
    table = list(range(8))
    out = {}
    for fused in (True, False):
        model.fused_gemv = fused
        cache = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), 16, model.device, model.dtype)
        model.forward(make_batch([SeqChunk(seq, 0, table, "last")], BLOCK, model.device), cache)
        logits = []
        for j in range(steps):
            batch = make_batch([SeqChunk([3 + j], len(seq) + j, table, "last")], BLOCK, model.device)
            if fused and model.device == "cpu":  # the CPU never picks it: run it directly, on the ops' references
                logits.append(model._forward_fused(batch, cache, model.make_workspace(1, 1), 1, 1).numpy().copy())
            else:
                assert model.fused_forward_ok(1, 1) == (fused and model.device == "cuda")
                logits.append(model.forward(batch, cache).numpy().copy())
        out[fused] = logits
    model.fused_gemv = True
    return out[True], out[False]


@pytest.mark.parametrize("name", FUSED_KEPT)
def test_fused_path_on_fp8_weights_is_the_unfused_path_on_the_cpu(fused_fp8_folders, name, rng):
    """The fused ops on Fp8Weight projections (rmsnorm_linear, rmsnorm_linear_silu_mul, linear_add) compute, on the
    CPU, the composition of the unfused ops' references: the model's fused one-token path gives the unfused path's
    logits bit for bit. (A fused reference that skipped a scale, the norm or the bf16 roundings would not.)"""
    model = load_model(fused_fp8_folders[name], "cpu", progress=False, max_positions=64)
    assert {f for f, w in vars(model.layers[0]).items() if isinstance(w, Fp8Weight)} == FUSED_KEPT[name]
    assert model.fused_fp8_ok()
    fused, unfused = fused_and_unfused_decode(model, rng.integers(0, model.config.vocab_size, 5).tolist())
    for got, want in zip(fused, unfused):
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, want)


def test_fused_path_refuses_fp8_weights_it_cannot_take(fused_fp8_folders):
    """fused_forward_ok needs every FP8 projection to fit the FP8 entries; a gate/up weight whose I is not a multiple
    of 4 (an up row group would straddle a scale block) keeps the model on the unfused ops."""
    model = load_model(fused_fp8_folders["all"], "cpu", progress=False, max_positions=64)
    assert model.fused_fp8_ok()
    layer = model.layers[0]
    n, k = layer.gate_up.shape
    q, s = quantize_blockwise(np.ones((n - 4, k), np.float32))
    layer.gate_up = Fp8Weight(Tensor.from_numpy(q, "cpu"), Tensor.from_numpy(s, "cpu"))
    model._fp8_fused_ok = None
    assert not model.fused_fp8_ok()


@pytest.mark.gpu
@pytest.mark.parametrize("name", FUSED_KEPT)
def test_cuda_fused_path_on_fp8_weights_matches_unfused(fused_fp8_folders, name, rng):
    """On the GPU a one-token step of an FP8 model takes the fused path (fused_forward_ok): its logits against the
    same steps through the unfused ops (the RMSNorm and SiLU-and-mul kernels around the plain FP8 GEMV) up to fp32
    summation order, and the same greedy token wherever the top two are not a near tie; and against the NumPy
    model's unfused path within the model tests' 3e-2."""
    gpu = load_model(fused_fp8_folders[name], "cuda", progress=False, max_positions=64)
    cpu = load_model(fused_fp8_folders[name], "cpu", progress=False, max_positions=64)
    seq = rng.integers(0, gpu.config.vocab_size, 5).tolist()
    fused, unfused = fused_and_unfused_decode(gpu, seq)
    reference = fused_and_unfused_decode(cpu, seq)[1]
    for got, want, ref in zip(fused, unfused, reference):
        assert np.all(np.isfinite(got))
        assert relative_error(got, want) < 1e-2 and relative_error(got, ref) < 3e-2
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-2
        np.testing.assert_array_equal(got.argmax(1)[clear], want.argmax(1)[clear])
