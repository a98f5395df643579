"""The hybrid model on the GPU: the CUDA forward against the NumPy backend's, and both against transformers' float32
model (the device has transformers with `qwen3_5`), at positions 1..1,500, prefill in one piece, in chunks with the
state carried, and token by token; then the engine (CUDA graphs, state slots) against the NumPy engine."""
import numpy as np
import pytest

from qwen3_reference import rel_err_rows
from test_qwen3_5_model import TEXT, caches, load
from qwen3_5_reference import write_random_folder
from xserv.engine.batch import SeqChunk, make_batch
from xserv.engine.kv_cache import KVCache, KVCacheSpec
from xserv.engine.state_cache import StateCache
from xserv.models.registry import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

BLOCK = 16
LENGTH = 1500


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # the text-only export: transformers' Qwen3_5ForCausalLM reads it without a vision config
    return write_random_folder(tmp_path_factory.mktemp("hybrid_gpu") / "text", TEXT, layout="qwen3_5_text",
                               bf16_values=True)


def cuda_logits(model, ids, pieces):
    """Logits at every position of `ids`, fed in `pieces` (token counts) with the state and KV carried."""
    kv = KVCache(KVCacheSpec(*model.kv_layout, BLOCK), len(ids) // BLOCK + 2, "cuda", model.dtype)
    kv.state = StateCache(model.state_layout, 2, "cuda")
    table = list(range(len(ids) // BLOCK + 1))
    out, start = [], 0
    for n in pieces:
        batch = make_batch([SeqChunk(ids[start:start + n], start, table, "all", 1)], BLOCK, "cuda")
        out.append(model.forward(batch, kv).numpy().astype(np.float64))
        start += n
    return np.concatenate(out)


def hf_logits(folder, ids, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no Qwen3_5ForCausalLM")
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return logits.astype(np.float64)


def test_cuda_matches_transformers_float32(folder):
    import torch

    ids = list(np.random.default_rng(0).integers(0, TEXT["vocab_size"], LENGTH))
    exact = hf_logits(folder, ids, torch.float32)
    bf16_run = rel_err_rows(hf_logits(folder, ids, torch.bfloat16), exact)
    model = load_model(folder, "cuda", progress=False, max_positions=2048)
    one = cuda_logits(model, ids, [LENGTH])
    chunks = cuda_logits(model, ids, [1, 63, 64, 65, 307, LENGTH - 500])
    steps = cuda_logits(model, ids[:300], [1] * 300)  # decode steps (the recurrent kernels), a prefix
    for name, ours in (("one prefill", one), ("chunks", chunks), ("token by token", steps)):
        err = rel_err_rows(ours, exact[:len(ours)])
        ref = bf16_run[:len(ours)]
        print(f"{name}: rel L2 vs transformers fp32 mean {err.mean():.2e} max {err.max():.2e}; "
              f"transformers bf16 mean {ref.mean():.2e} max {ref.max():.2e}")
        # as close as transformers' own bf16 run is: within 1.5x of its error, row by row on average and at worst
        assert err.mean() <= 1.5 * ref.mean() and err.max() <= 1.5 * ref.max(), name


def test_cuda_matches_numpy_backend(folder):
    """The CUDA kernels against the NumPy references, model-wide: 3e-2 relative per row, the dense models' GPU
    tolerance (both round to bf16 at the same points and sum in other orders)."""
    ids = list(np.random.default_rng(1).integers(0, TEXT["vocab_size"], 200))
    gpu = cuda_logits(load_model(folder, "cuda", progress=False, max_positions=1024), ids, [150, 1, 1, 48])
    cpu_model = load(folder)
    kv = caches(cpu_model)
    cpu = cpu_model.forward(make_batch([SeqChunk(ids, 0, list(range(60)), "all", 0)], 4, "cpu"), kv).numpy()
    assert rel_err_rows(gpu, cpu.astype(np.float64)).max() < 3e-2


def test_engine_graphs_match_eager(tmp_path):
    """Greedy generation with CUDA graphs (decode and prefill graphs take the state slots as device inputs) equals
    eager runs up to near ties, for a batch of mixed lengths, on the release layout with its tokenizer."""
    from batch_shape import assert_same_run
    from xserv import LLM, SamplingParams
    from xserv.models.random_checkpoint import make_test_model

    folder = make_test_model("qwen3.5-tiny", tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 248000, int(n))] for n in rng.integers(2, 300, 9)]
    graphs = LLM(str(folder), device="cuda", max_model_len=1024, kv_cache_tokens=16384, progress=False)
    got = graphs.generate(prompts, params)
    graphs.close()
    eager = LLM(str(folder), device="cuda", max_model_len=1024, kv_cache_tokens=16384, progress=False,
                cuda_graphs=False)
    want = eager.generate(prompts, params)
    eager.close()
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_run(g, w, params, context=i)
