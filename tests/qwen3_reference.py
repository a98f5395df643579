"""Test helpers: an independent dense NumPy Qwen3 (float64, no paged cache, plain causal attention, Hugging Face
formulas), and tiny checkpoint fixtures shared by the model / engine / LLM / CLI tests."""
from __future__ import annotations

import numpy as np
import pytest


def dense_qwen3_logits(folder, token_ids) -> np.ndarray:
    """float64 [T, vocab] logits of Qwen3ForCausalLM as transformers computes them (without its dtype rounding)."""
    from xserv.models.checkpoint import CheckpointReader
    from xserv.models.config import Qwen3Config

    cfg = Qwen3Config.from_pretrained(folder)
    reader = CheckpointReader(folder)

    def w(name):
        return np.asarray(reader.get(name), np.float64)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps) * weight

    ids = np.asarray(token_ids)
    t, d = len(ids), cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]

    def rotate(x):  # x [T, heads, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    causal = np.tril(np.ones((t, t), bool))
    x = w("model.embed_tokens.weight")[ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = (h @ w(p + "self_attn.q_proj.weight").T).reshape(t, hq, d)
        k = (h @ w(p + "self_attn.k_proj.weight").T).reshape(t, hkv, d)
        v = (h @ w(p + "self_attn.v_proj.weight").T).reshape(t, hkv, d)
        q = rotate(rms(q, w(p + "self_attn.q_norm.weight")))
        k = rotate(rms(k, w(p + "self_attn.k_norm.weight")))
        group = hq // hkv
        out = np.empty((t, hq, d))
        for head in range(hq):
            kh, vh = k[:, head // group], v[:, head // group]
            scores = q[:, head] @ kh.T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[:, head] = probs @ vh
        x = x + out.reshape(t, hq * d) @ w(p + "self_attn.o_proj.weight").T
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        gate, up = h @ w(p + "mlp.gate_proj.weight").T, h @ w(p + "mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(p + "mlp.down_proj.weight").T
    x = rms(x, w("model.norm.weight"))
    head = w("model.embed_tokens.weight") if cfg.tie_word_embeddings else w("lm_head.weight")
    return x @ head.T


def rel_err_rows(out, ref) -> np.ndarray:
    """Relative L2 error of each row (position)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


@pytest.fixture(scope="session")
def tiny_model_dir():
    from xserv.models.random_checkpoint import bundled_tiny_model

    return bundled_tiny_model()


@pytest.fixture(scope="session")
def perturbed_model_dir(tmp_path_factory):
    """The tiny preset with norms off 1, untied LM head, weights std 0.1 so that every layer moves the logits."""
    from xserv.models.random_checkpoint import make_test_model

    return make_test_model("tiny", tmp_path_factory.mktemp("models") / "tiny-perturbed", seed=3, perturb_norms=True,
                           overrides={"tie_word_embeddings": False, "initializer_range": 0.1}, progress=False)
