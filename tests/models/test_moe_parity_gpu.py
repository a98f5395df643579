"""Qwen3-MoE (Qwen3MoeForCausalLM) against Hugging Face transformers on the GPU, and its batch invariance.

Parity: random checkpoints of the moe-tiny preset scaled up (hidden 512, 4 layers, 16 experts of width 256, top-4,
16/2 heads of 128: Qwen3-30B-A3B's group of 8), in four variants: top-k probabilities renormalised
(norm_topk_prob true, as Qwen3-30B-A3B) or not, a dense layer among the sparse ones (mlp_only_layers=[1]), and every
other layer sparse (decoder_sparse_step 2). xserv's logits at every position of a 1,500-token prompt (llm.logits)
against transformers float32 (`AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`: transformers v5 fuses
the per-expert tensors on load itself), beside transformers' own bf16 run against the same float32 logits.

The bar is the peer's: xserv's max and mean relative L2 error per position are at most PEER_FACTOR x transformers
bf16's own (or FLOOR, whichever is larger). A routing near-tie (two experts' router probabilities closer than bf16's
rounding of the layer input) sends a token to another expert in any bf16 run, so a few positions differ from float32
by much more than the rest in both runs: the max alone would be a lottery, hence max and mean, each against the
peer's. (The dense models have no GPU test against transformers: tools/check_parity.py measures them, bar 2e-2 per
position with transformers bf16's own error printed beside it, docs/parity.md. It takes `--peer-factor 1.5` for the
bar used here.)

Batch invariance: 64 different greedy requests in one batch, each against its run alone, token for token up to the
first near tie of the alone run (NEAR_TIE nats between its two best tokens, as tests/server/test_server_gpu.py): on the GPU
a request's rows depend slightly on the batch around it (GEMV at one row, cuBLASLt above, the grouped expert GEMMs'
tiles), which may flip a near tie but nothing else.
"""
import numpy as np
import pytest

from qwen3_reference import hf_logits, rel_err_rows
from xserv.testing import agree_until_near_tie

pytestmark = pytest.mark.gpu

PROMPT_LEN = 1500
PEER_FACTOR = 1.5
FLOOR = 1e-2
NEAR_TIE = 0.1  # nats between the alone run's best and second-best token (tests/server/test_server_gpu.py)
BASE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "max_position_embeddings": 4096, "max_window_layers": 4}
VARIANTS = {
    "topk-renormalised": {},
    "topk-raw": {"norm_topk_prob": False},
    "dense-layer-1": {"mlp_only_layers": [1]},
    "sparse-step-2": {"decoder_sparse_step": 2, "norm_topk_prob": False},
}


def _make(tmp_path, name: str, overrides: dict, seed: int):
    from xserv.models.random_checkpoint import make_test_model

    return make_test_model("moe-tiny", tmp_path / name, seed=seed, overrides={**BASE, **overrides}, progress=False)


def _xserv_logits(folder, prompt) -> tuple[np.ndarray, list[int]]:
    from xserv import LLM

    with LLM(str(folder), device="cuda", max_model_len=len(prompt) + 64, kv_cache_tokens=len(prompt) + 1024,
             max_num_seqs=4, progress=False) as llm:
        sparse = list(llm.config.sparse_layers)
        return llm.logits(prompt), sparse


@pytest.fixture(scope="module")
def transformers_moe():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.qwen3_moe", reason="this transformers has no Qwen3MoeForCausalLM")
    return transformers.__version__


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_logits_as_close_to_float32_as_transformers_bf16(variant, transformers_moe, tmp_path):
    import torch

    folder = _make(tmp_path, variant, VARIANTS[variant], seed=list(VARIANTS).index(variant))
    prompt = np.random.default_rng(1500).integers(0, 151643, PROMPT_LEN).tolist()
    ours, our_sparse = _xserv_logits(folder, prompt)
    peer, _ = hf_logits(folder, prompt, torch.bfloat16)
    ref, hf_sparse = hf_logits(folder, prompt, torch.float32)
    assert our_sparse == hf_sparse, "xserv and transformers disagree on which layers are sparse"
    assert np.all(np.isfinite(ours))
    err, err_peer = rel_err_rows(ours, ref), rel_err_rows(peer, ref)
    bound_max = max(PEER_FACTOR * err_peer.max(), FLOOR)
    bound_mean = max(PEER_FACTOR * err_peer.mean(), FLOOR)
    worst = lambda e: ", ".join(f"{i} ({e[i]:.2e})" for i in np.argsort(e)[::-1][:4])  # noqa: E731
    print(f"{variant} (transformers {transformers_moe}; sparse layers {our_sparse}): xserv max {err.max():.3e} "
          f"mean {err.mean():.3e}; transformers bf16 max {err_peer.max():.3e} mean {err_peer.mean():.3e}; "
          f"bounds {bound_max:.3e} / {bound_mean:.3e}\n  worst xserv: {worst(err)}\n  worst bf16:  {worst(err_peer)}")
    assert err.max() <= bound_max, f"max {err.max():.3e} > {bound_max:.3e}"
    assert err.mean() <= bound_mean, f"mean {err.mean():.3e} > {bound_mean:.3e}"


@pytest.mark.timeout(900)
def test_moe_batch_of_64_equals_each_request_alone_up_to_near_ties(tmp_path):
    from xserv import LLM, SamplingParams

    folder = _make(tmp_path, "batch", {}, seed=7)
    rng = np.random.default_rng(64)
    prompts = [rng.integers(0, 10000, int(rng.integers(8, 300))).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    with LLM(str(folder), device="cuda", max_model_len=512, max_num_seqs=64, kv_cache_tokens=64 * 512 + 1024,
             enable_prefix_caching=False, progress=False) as llm:
        running = []
        together = llm.generate(prompts, params, on_step=lambda _: running.append(llm.engine.stats()["num_running"]))
        alone = [llm.generate([p], params)[0] for p in prompts]
    assert max(running) == 64, "the 64 requests never ran as one batch"
    assert all(len(o.token_ids) == 32 for o in together)
    assert len({tuple(o.token_ids) for o in alone}) > 32  # different prompts, different answers
    exact = sum(a.token_ids == t.token_ids for a, t in zip(alone, together))
    diverged = [i for i, (a, t) in enumerate(zip(alone, together)) if not agree_until_near_tie(a, t, NEAR_TIE)]
    print(f"64 requests: {exact} equal to their run alone token for token; {len(diverged)} differ before a near tie "
          f"({NEAR_TIE} nats)")
    assert not diverged, f"requests {diverged} differ from their run alone before any near tie"
