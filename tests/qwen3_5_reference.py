"""An independent float64 NumPy reference decoder for the Qwen3.5 hybrid text model (Gated DeltaNet + gated softmax
attention) and Qwen3-Next, written from ../shared/qwen3.5/ARCHITECTURE.md alone. It shares no code with xserv/ops or
xserv/models on purpose: the product runs xserv's ops, and the two must agree.

    ref = HybridReference(folder)                       # any of the layouts below
    logits, states = ref.forward(token_ids)             # [T, vocab] float64, per-layer states after the last token
    more, states = ref.forward(next_ids, states)        # continue from those states

Checkpoint layouts (config.json `architectures[0]`):

* `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`: text under `model.language_model.`,
  `lm_head` at the top, `model.visual.*` and `mtp.*` ignored (never read);
* `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (text-only export): flat `model.*`;
* `Qwen3NextForCausalLM`: flat `model.*`, the GDN input projections fused and grouped by key head
  (`in_proj_qkvz`, `in_proj_ba`), un-grouped here as ARCHITECTURE 3.1 says; experts as per-expert tensors or fused 3-D.

The head is tied by the OUTER config's `tie_word_embeddings` (ARCHITECTURE 6). The GDN layers run the token-by-token
recurrence of ARCHITECTURE 3.2 (`gdn_form="chunked"` runs the chunked form of 3.3 instead, for cross-checks).

States (`forward` returns one entry per layer; `initial_states()` gives a fresh set):
  GDN layer:       {"conv": [conv_dim, K-1] the last K-1 pre-conv inputs, oldest first; "ssm": [nv, dk, dv]}
  attention layer: {"k": [n, nkv, hd] post-norm post-RoPE keys; "v": [n, nkv, hd]}
The RoPE position of the next token is the attention layers' cache length.

Rounding (`bf16_points=True`): where transformers' bfloat16 run (its torch code path, SDPA attention) rounds to
bfloat16, this rounds too (round to nearest even), everything else stays float64 (where transformers computes in
float32). The points, in order of the forward pass:
  weights      every parameter as loaded (A_log, dt_bias and norm weights included)
  linear       every projection's output (q/k/v/o, in_proj_*, out_proj, MLP and expert projections, router, head)
  norm         every RMSNorm's output (zero-centred: after the (1 + w) product; gated: after the normalised value
               is cast back, after its product with w, and at the end)
  residual     each residual sum
  rope         cos and sin, each product with them and their sum
  attention    scores and softmax stay wide (as fused SDPA kernels keep them); the probabilities before the product
               with V, the attention output, sigmoid(gate), the gated output
  conv         the depthwise conv's output and its SiLU
  gdn          beta = sigmoid(b), the core output before the gated norm (g, the L2 norms and the recurrence stay wide)
  mlp          silu(gate), silu(gate) * up
  moe          each expert's weighted output and the running sum over experts (in expert order), sigmoid of the
               shared-expert gate, its product with the shared expert, the final sum
It is a model of transformers' bf16 noise, not a bit-exact copy of it (cuBLAS/SDPA kernels sum in their own order,
flash-style attention rounds unnormalised probabilities): on the tiny random folders of
tests/models/test_qwen3_5_parity_gpu.py its mean error against float64 is within 8% of transformers 5.17's own bf16
run (on the CPU).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GDN_CHUNK = 64
L2_EPS = 1e-6  # added to the sum of squares in the GDN q/k L2 norm (ARCHITECTURE 3.2 step 6)
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"

# architectures[0] -> (prefix of the text decoder, which layers are MoE)
_ARCHS = {
    "Qwen3_5ForConditionalGeneration": ("model.language_model.", "dense"),
    "Qwen3_5ForCausalLM": ("model.", "dense"),
    "Qwen3_5MoeForConditionalGeneration": ("model.language_model.", "moe"),
    "Qwen3_5MoeForCausalLM": ("model.", "moe"),
    "Qwen3NextForCausalLM": ("model.", "next"),
}


# ----------------------------------------------------------------------------------------------------------- file IO

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U8": "u1", "BOOL": "?"}


class SafetensorsFolder:
    """The tensors of every *.safetensors file of a folder, read lazily (only what is asked for), as float64."""

    def __init__(self, folder):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.folder}: no *.safetensors file")
        self._where: dict[str, tuple[np.memmap, int, dict]] = {}
        for f in files:
            raw = np.memmap(f, np.uint8, mode="r")
            n = int.from_bytes(raw[:8].tobytes(), "little")
            header = json.loads(raw[8:8 + n].tobytes())
            for name, meta in header.items():
                if name != "__metadata__":
                    self._where[name] = (raw, 8 + n, meta)

    def __contains__(self, name) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name) -> np.ndarray:
        if name not in self._where:
            raise ValueError(f"{self.folder}: checkpoint has no tensor {name!r}")
        raw, base, meta = self._where[name]
        lo, hi = meta["data_offsets"]
        buf = raw[base + lo: base + hi]
        if meta["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            arr = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] in _ST_DTYPES:
            arr = np.frombuffer(buf, _ST_DTYPES[meta["dtype"]])
        else:
            raise ValueError(f"{name}: tensor dtype {meta['dtype']} is not supported by the reference")
        return arr.reshape(meta["shape"]).astype(np.float64)


# ------------------------------------------------------------------------------------------------------------ config

def layer_schedule(text_cfg: dict) -> list[str]:
    """Each layer's kind: `layer_types` when present, else layer i is full attention iff (i + 1) % interval == 0
    (`full_attention_interval`, default 4), as transformers builds it (ARCHITECTURE 1)."""
    n = text_cfg["num_hidden_layers"]
    types = text_cfg.get("layer_types")
    if types is None:
        interval = text_cfg.get("full_attention_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"full_attention_interval must be a positive integer, got {interval!r}")
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    bad = [t for t in types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)]
    if bad:
        raise ValueError(f"layer_types holds unknown kinds {bad}")
    return list(types)


class TextConfig:
    """What the reference reads from config.json, names as in ARCHITECTURE's notation."""

    def __init__(self, outer: dict):
        archs = outer.get("architectures") or []
        if not archs or archs[0] not in _ARCHS:
            raise ValueError(f"architectures {archs!r}: the reference reads {sorted(_ARCHS)}")
        self.arch = archs[0]
        self.prefix, moe_rule = _ARCHS[self.arch]
        t = outer.get("text_config", outer)
        self.tie = bool(outer.get("tie_word_embeddings", False))  # the OUTER flag (ARCHITECTURE 6)
        self.hidden, self.vocab, self.eps = t["hidden_size"], t["vocab_size"], t.get("rms_norm_eps", 1e-6)
        self.layer_types = layer_schedule(t)
        self.n_layers = len(self.layer_types)
        self.nh, self.nkv = t["num_attention_heads"], t["num_key_value_heads"]
        self.hd = t.get("head_dim") or self.hidden // self.nh
        rope = t.get("rope_parameters") or {}
        theta = rope.get("rope_theta", t.get("rope_theta"))
        if theta is None:
            raise ValueError("config has no rope_theta (neither in rope_parameters nor at the top)")
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r}: the reference implements the default RoPE only")
        self.rope_theta = float(theta)
        factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
        self.rotary_dim = int(self.hd * factor)
        self.nk, self.nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        self.dk, self.dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
        self.conv_k = t["linear_conv_kernel_dim"]
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.num_experts = t.get("num_experts", 0) or 0
        self.top_k = t.get("num_experts_per_tok", 0)
        if moe_rule == "dense":
            self.moe_layers = set()
            self.norm_topk = True
        elif moe_rule == "moe":  # Qwen3.5-MoE: every layer, the router always renormalises (ARCHITECTURE 5)
            self.moe_layers = set(range(self.n_layers))
            self.norm_topk = True
        else:  # Qwen3-Next: decoder_sparse_step and mlp_only_layers decide
            step, only = t.get("decoder_sparse_step", 1), set(t.get("mlp_only_layers") or [])
            self.moe_layers = {i for i in range(self.n_layers)
                               if self.num_experts > 0 and (i + 1) % step == 0 and i not in only}
            self.norm_topk = bool(t.get("norm_topk_prob", True))


def read_config(folder) -> TextConfig:
    return TextConfig(json.loads((Path(folder) / "config.json").read_text()))


# --------------------------------------------------------------------------------------------------- the formulas

def bf16_round(x) -> np.ndarray:
    """x rounded to the nearest bfloat16 (ties to even), as float64 (through float32, whose rounding of a float64
    only matters exactly at a bf16 tie)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _keep(x):
    return x


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    """log(1 + e^x), the identity above 20 as PyTorch's default threshold."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def zero_centred_rms_norm(x, w, eps):
    """y = x / sqrt(mean(x^2) + eps) * (1 + w) over the last axis (a zero weight is gain 1)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def gated_rms_norm(o, z, w, eps, r=_keep):
    """Norm first, then the gate: (o / sqrt(mean(o^2) + eps)) * w * silu(z) with a PLAIN weight w (no 1 + w)."""
    n = r(o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps))
    return r(r(n * w) * silu(z))


def l2_normalize(x, eps=L2_EPS):
    """x / sqrt(sum(x^2) + eps) over the last axis: eps added to the SUM, not the mean."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gdn_gates(a, b, a_log, dt_bias):
    """(g, beta): g = -exp(A_log) * softplus(a + dt_bias) <= 0, the log-decay; beta = sigmoid(b)."""
    return -np.exp(a_log) * softplus(a + dt_bias), sigmoid(b)


def rope_angles(positions, rotary_dim, theta):
    """[T, rotary_dim / 2] angles pos * theta^(-2i / rotary_dim)."""
    inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return np.asarray(positions, np.float64)[:, None] * inv[None, :]


def apply_partial_rope(x, positions, rotary_dim, theta, r=_keep):
    """x [T, heads, hd]: rotate-half RoPE on the first rotary_dim dims of each head (pairs (i, i + rotary_dim/2)),
    the rest passed through."""
    half = rotary_dim // 2
    ang = rope_angles(positions, rotary_dim, theta)[:, None, :]
    cos, sin = r(np.cos(ang)), r(np.sin(ang))
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    y1 = r(r(x1 * cos) - r(x2 * sin))
    y2 = r(r(x2 * cos) + r(x1 * sin))
    return np.concatenate([y1, y2, x[..., rotary_dim:]], axis=-1)


def causal_conv_silu(x, w, window, r=_keep):
    """Depthwise causal conv + SiLU. x [T, C] pre-conv inputs, w [C, K] (tap K-1 multiplies the current token),
    window [C, K-1] the K-1 inputs before x, oldest first. Returns (u [T, C], the new window)."""
    k = w.shape[1]
    hist = np.concatenate([window.T, x], axis=0)  # row j holds token j - (K-1)
    t = x.shape[0]
    acc = np.zeros_like(x)
    for j in range(k):
        acc = acc + hist[j: j + t] * w[:, j]
    return r(silu(r(acc))), hist[hist.shape[0] - (k - 1):].T.copy()


def _heads_for_values(x, nv):
    """[T, nk, d] -> [T, nv, d]: value head j uses key/query head j // (nv / nk) (each key head serves r
    CONSECUTIVE value heads)."""
    return np.repeat(x, nv // x.shape[1], axis=1)


def gdn_recurrent(q, k, v, g, beta, state=None):
    """The gated delta rule token by token (ARCHITECTURE 3.2 step 8). q, k [T, nk, dk] already L2-normalised (q also
    scaled by dk^-0.5), v [T, nv, dv], g and beta [T, nv], state [nv, dk, dv] (zeros when None).
    Returns (o [T, nv, dv], final state)."""
    t_len, nv, dv = v.shape
    qh, kh = _heads_for_values(q, nv), _heads_for_values(k, nv)
    s = np.zeros((nv, q.shape[2], dv)) if state is None else np.array(state, np.float64)
    out = np.empty((t_len, nv, dv))
    for t in range(t_len):
        s = s * np.exp(g[t])[:, None, None]                      # decay first
        m = np.einsum("hkd,hk->hd", s, kh[t])                    # what the memory predicts for k_t
        delta = beta[t][:, None] * (v[t] - m)
        s = s + kh[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkd,hk->hd", s, qh[t])               # read after the update
    return out, s


def gdn_chunked(q, k, v, g, beta, state=None, chunk=GDN_CHUNK):
    """The same rule in chunks of `chunk` tokens (ARCHITECTURE 3.3): same arguments and results as gdn_recurrent."""
    t_len, nv, dv = v.shape
    pad = (-t_len) % chunk
    qh, kh = _heads_for_values(q, nv), _heads_for_values(k, nv)

    def padded(x):
        return np.concatenate([x, np.zeros((pad,) + x.shape[1:])], axis=0)

    qh, kh, vv, gg, bb = (padded(np.asarray(x, np.float64)) for x in (qh, kh, v, g, beta))
    s = np.zeros((nv, q.shape[2], dv)) if state is None else np.array(state, np.float64)
    out = np.empty((t_len + pad, nv, dv))
    lower = np.tril(np.ones((chunk, chunk), bool))
    strict = np.tril(np.ones((chunk, chunk), bool), -1)
    eye = np.eye(chunk)
    for c0 in range(0, t_len + pad, chunk):
        rows = slice(c0, c0 + chunk)
        for h in range(nv):
            qc, kc, vc, bc = qh[rows, h], kh[rows, h], vv[rows, h], bb[rows, h]
            gam = np.cumsum(gg[rows, h])
            diff = gam[:, None] - gam[None, :]
            decay = np.exp(np.where(lower, diff, -np.inf))         # exp(G_i - G_m) for m <= i, else 0
            kt, vt = bc[:, None] * kc, bc[:, None] * vc
            ell = np.where(strict, (kt @ kc.T) * decay, 0.0)
            u = np.linalg.solve(eye + ell, vt)
            w = np.linalg.solve(eye + ell, kt * np.exp(gam)[:, None])
            vp = u - w @ s[h]
            a = (qc @ kc.T) * decay
            out[rows, h] = (qc * np.exp(gam)[:, None]) @ s[h] + a @ vp
            s[h] = np.exp(gam[-1]) * s[h] + (kc * np.exp(gam[-1] - gam)[:, None]).T @ vp
    return out[:t_len], s


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# ------------------------------------------------------------------------------------------------------- the model

class HybridReference:
    """The float64 decoder of one checkpoint folder. bf16_points: round where transformers' bf16 run rounds (see the
    module docstring)."""

    def __init__(self, folder, bf16_points: bool = False):
        self.folder = Path(folder)
        self.cfg = read_config(folder)
        self.bf16_points = bf16_points
        self.r = bf16_round if bf16_points else _keep
        self._files = SafetensorsFolder(folder)
        c, p = self.cfg, self.cfg.prefix
        self.embed = self._w(p + "embed_tokens.weight")
        self.final_norm = self._w(p + "norm.weight")
        if c.tie:
            self.head = self.embed
        else:
            self.head = self._w("lm_head.weight")
        self.layers = [self._layer(i) for i in range(c.n_layers)]

    def _w(self, name):
        return self.r(self._files.get(name))

    def _layer(self, i) -> dict:
        c, p = self.cfg, f"{self.cfg.prefix}layers.{i}."
        w = {"kind": c.layer_types[i], "in_norm": self._w(p + "input_layernorm.weight"),
             "post_norm": self._w(p + "post_attention_layernorm.weight")}
        if w["kind"] == LINEAR_ATTENTION:
            w.update(self._gdn_weights(p + "linear_attn."))
        else:
            a = p + "self_attn."
            w.update(q=self._w(a + "q_proj.weight"), k=self._w(a + "k_proj.weight"), v=self._w(a + "v_proj.weight"),
                     o=self._w(a + "o_proj.weight"), q_norm=self._w(a + "q_norm.weight"),
                     k_norm=self._w(a + "k_norm.weight"))
        m = p + "mlp."
        if i in c.moe_layers:
            w["moe"] = self._moe_weights(m)
        else:
            w["mlp"] = tuple(self._w(m + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj"))
        return w

    def _gdn_weights(self, p) -> dict:
        c = self.cfg
        if p + "in_proj_qkvz.weight" in self._files:  # Qwen3-Next: groups per key head (ARCHITECTURE 3.1)
            r = c.nv // c.nk
            qkvz = self._w(p + "in_proj_qkvz.weight").reshape(c.nk, 2 * c.dk + 2 * r * c.dv, c.hidden)
            ba = self._w(p + "in_proj_ba.weight").reshape(c.nk, 2 * r, c.hidden)
            q, k = qkvz[:, :c.dk], qkvz[:, c.dk:2 * c.dk]
            v, z = qkvz[:, 2 * c.dk:2 * c.dk + r * c.dv], qkvz[:, 2 * c.dk + r * c.dv:]
            qkv = np.concatenate([x.reshape(-1, c.hidden) for x in (q, k, v)], axis=0)
            z, b, a = z.reshape(-1, c.hidden), ba[:, :r].reshape(-1, c.hidden), ba[:, r:].reshape(-1, c.hidden)
        else:
            qkv, z = self._w(p + "in_proj_qkv.weight"), self._w(p + "in_proj_z.weight")
            b, a = self._w(p + "in_proj_b.weight"), self._w(p + "in_proj_a.weight")
        conv = self._w(p + "conv1d.weight")
        return {"qkv": qkv, "z": z, "b": b, "a": a, "conv": conv.reshape(c.conv_dim, c.conv_k),
                "A_log": self._w(p + "A_log"), "dt_bias": self._w(p + "dt_bias"), "gnorm": self._w(p + "norm.weight"),
                "out": self._w(p + "out_proj.weight")}

    def _moe_weights(self, m) -> dict:
        c = self.cfg
        if m + "experts.gate_up_proj" in self._files:  # fused 3-D: [E, 2I, H] (gate rows first) and [E, H, I]
            gate_up, down = self._w(m + "experts.gate_up_proj"), self._w(m + "experts.down_proj")
            half = gate_up.shape[1] // 2
            experts = [(gate_up[e, :half], gate_up[e, half:], down[e]) for e in range(c.num_experts)]
        else:
            experts = [tuple(self._w(f"{m}experts.{e}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
                       for e in range(c.num_experts)]
        shared = tuple(self._w(f"{m}shared_expert.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        return {"router": self._w(m + "gate.weight"), "experts": experts, "shared": shared,
                "shared_gate": self._w(m + "shared_expert_gate.weight")}

    # ---------------------------------------------------------------------------------------------- forward

    def initial_states(self) -> list[dict]:
        c = self.cfg
        return [{"conv": np.zeros((c.conv_dim, c.conv_k - 1)), "ssm": np.zeros((c.nv, c.dk, c.dv))}
                if kind == LINEAR_ATTENTION else
                {"k": np.zeros((0, c.nkv, c.hd)), "v": np.zeros((0, c.nkv, c.hd))} for kind in c.layer_types]

    def forward(self, token_ids, states=None, gdn_form: str = "recurrent",
                hidden: list | None = None) -> tuple[np.ndarray, list[dict]]:
        """Logits [T, vocab] for every position of token_ids and the per-layer states after the last one. states:
        what an earlier call returned (not modified), None for a fresh sequence. gdn_form: "recurrent" (token by
        token, ARCHITECTURE 3.2) or "chunked" (3.3). hidden: a list that receives the residual stream [T, H] after
        each layer, then after the final norm (for finding the first layer where another implementation departs)."""
        if gdn_form not in ("recurrent", "chunked"):
            raise ValueError(f"gdn_form must be 'recurrent' or 'chunked', got {gdn_form!r}")
        c, r = self.cfg, self.r
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= c.vocab):
            raise ValueError(f"token ids must lie in [0, {c.vocab}), got {ids.min()}..{ids.max()}")
        states = self.initial_states() if states is None else states
        if len(states) != c.n_layers:
            raise ValueError(f"states has {len(states)} entries for {c.n_layers} layers")
        cached = {len(s["k"]) for s in states if "k" in s}
        if len(cached) > 1:
            raise ValueError(f"attention layers hold different cache lengths {sorted(cached)}")
        start = cached.pop() if cached else 0
        positions = np.arange(start, start + len(ids))
        x = self.embed[ids]
        new_states = []
        for w, st in zip(self.layers, states):
            h = r(zero_centred_rms_norm(x, w["in_norm"], c.eps))
            if w["kind"] == LINEAR_ATTENTION:
                mixed, st = self.gdn(h, w, st, gdn_form)
            else:
                mixed, st = self.attention(h, w, st, positions)
            new_states.append(st)
            x = r(x + mixed)
            h = r(zero_centred_rms_norm(x, w["post_norm"], c.eps))
            x = r(x + (self.moe(h, w["moe"]) if "moe" in w else self.mlp(h, *w["mlp"])))
            if hidden is not None:
                hidden.append(x)
        x = r(zero_centred_rms_norm(x, self.final_norm, c.eps))
        if hidden is not None:
            hidden.append(x)
        return r(x @ self.head.T), new_states

    # The layer pieces, public so that a test can compare one layer at a time: x is a layer's normed input [T, H],
    # w = self.layers[i] (weights as loaded, un-grouped), st that layer's entry of a states list.

    def mlp(self, x, gate, up, down):
        """down(silu(gate(x)) * up(x))."""
        r = self.r
        return r(r(r(silu(r(x @ gate.T))) * r(x @ up.T)) @ down.T)

    def moe(self, x, w):
        """Softmax over all experts, top-k, renormalised (Qwen3-Next: if norm_topk_prob), plus the gated shared
        expert (ARCHITECTURE 5)."""
        c, r = self.cfg, self.r
        probs = softmax(r(x @ w["router"].T))
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:c.top_k]
            weights = probs[t, top] / (probs[t, top].sum() if c.norm_topk else 1.0)
            acc = np.zeros(x.shape[1])
            for e, wt in sorted(zip(top, weights)):  # transformers adds the experts in index order
                acc = r(acc + r(self.mlp(x[t:t + 1], *w["experts"][e])[0] * wt))
            out[t] = acc
        shared = r(r(sigmoid(r(x @ w["shared_gate"].T))) * self.mlp(x, *w["shared"]))
        return r(out + shared)

    def attention(self, x, w, st, positions):
        """Gated softmax attention (ARCHITECTURE 4) at absolute `positions`, after the cached k/v of st.
        Returns (mixer output [T, H], the new state)."""
        c, r = self.cfg, self.r
        t = x.shape[0]
        qg = r(x @ w["q"].T).reshape(t, c.nh, 2 * c.hd)  # per head: hd query entries, then hd gate entries
        q, gate = qg[..., :c.hd], qg[..., c.hd:].reshape(t, c.nh * c.hd)
        k = r(x @ w["k"].T).reshape(t, c.nkv, c.hd)
        v = r(x @ w["v"].T).reshape(t, c.nkv, c.hd)
        q = r(zero_centred_rms_norm(q, w["q_norm"], c.eps))
        k = r(zero_centred_rms_norm(k, w["k_norm"], c.eps))
        q = apply_partial_rope(q, positions, c.rotary_dim, c.rope_theta, r)
        k = apply_partial_rope(k, positions, c.rotary_dim, c.rope_theta, r)
        keys, values = np.concatenate([st["k"], k]), np.concatenate([st["v"], v])
        n_cached = len(st["k"])
        visible = np.arange(len(keys))[None, :] <= (n_cached + np.arange(t))[:, None]
        group = c.nh // c.nkv
        out = np.empty((t, c.nh, c.hd))
        for h in range(c.nh):
            scores = q[:, h] @ keys[:, h // group].T * c.hd ** -0.5
            probs = r(softmax(np.where(visible, scores, -np.inf)))
            out[:, h] = r(probs @ values[:, h // group])
        o = r(out.reshape(t, c.nh * c.hd) * r(sigmoid(gate)))
        return r(o @ w["o"].T), {"k": keys, "v": values}

    def gdn(self, x, w, st, form="recurrent"):
        """Gated DeltaNet (ARCHITECTURE 3.2) from st's conv window and SSM state. Returns (mixer output [T, H],
        the new state)."""
        c, r = self.cfg, self.r
        t = x.shape[0]
        qkv, z = r(x @ w["qkv"].T), r(x @ w["z"].T).reshape(t, c.nv, c.dv)
        b, a = r(x @ w["b"].T), r(x @ w["a"].T)
        u, window = causal_conv_silu(qkv, w["conv"], st["conv"], r)
        q = u[:, :c.key_dim].reshape(t, c.nk, c.dk)
        k = u[:, c.key_dim:2 * c.key_dim].reshape(t, c.nk, c.dk)
        v = u[:, 2 * c.key_dim:].reshape(t, c.nv, c.dv)
        g, beta = gdn_gates(a, b, w["A_log"], w["dt_bias"])
        beta = r(beta)
        q, k = l2_normalize(q) * c.dk ** -0.5, l2_normalize(k)
        core = gdn_recurrent if form == "recurrent" else gdn_chunked
        o, ssm = core(q, k, v, g, beta, st["ssm"])
        y = gated_rms_norm(r(o), z, w["gnorm"], c.eps, r)
        return r(y.reshape(t, c.value_dim) @ w["out"].T), {"conv": window, "ssm": ssm}


def reference_logits(folder, token_ids, bf16_points: bool = False) -> np.ndarray:
    """float64 [T, vocab] logits of one sequence from a fresh state."""
    return HybridReference(folder, bf16_points).forward(token_ids)[0]


# ------------------------------------------------------------------------------- random checkpoints (tests only)

# A tiny text config in Qwen3.5's own terms: 4 layers (3 GDN, then attention), 2 key heads serving 4 value heads
# (r = 2), partial RoPE on a quarter of each head, a small vocabulary. MoE fields (num_experts > 0) switch Qwen3-Next
# and Qwen3.5-MoE layouts to sparse layers.
TINY_TEXT_CONFIG = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "tie_word_embeddings": False, "initializer_range": 0.1, "hidden_act": "silu", "attention_bias": False,
    "attn_output_gate": True,
}
TINY_MOE_FIELDS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 96, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "mlp_only_layers": []}
LAYOUTS = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe")
_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                "hidden_act": "gelu_pytorch_tanh", "deepstack_visual_indexes": []}


def _random_weights(c: TextConfig, text: dict, rng) -> dict:
    """One set of weights in Qwen3.5's split form (in_proj_qkv/z/b/a), per layer both a dense MLP (if
    intermediate_size) and a MoE block (if num_experts), so that every layout is cut from the same numbers."""
    std, h = text.get("initializer_range", 0.1), c.hidden

    def n(*shape, scale=std):
        return rng.normal(0.0, scale, shape)

    w = {"embed": n(c.vocab, h, scale=1.0), "norm": n(h), "lm_head": n(c.vocab, h), "layers": []}
    for kind in c.layer_types:
        lw = {"input_layernorm": n(h), "post_attention_layernorm": n(h)}
        if kind == LINEAR_ATTENTION:
            lw.update(qkv=n(c.conv_dim, h), z=n(c.value_dim, h), b=n(c.nv, h, scale=0.3), a=n(c.nv, h, scale=0.3),
                      conv=n(c.conv_dim, 1, c.conv_k, scale=0.4), A_log=np.log(rng.uniform(0.02, 1.0, c.nv)),
                      dt_bias=n(c.nv, scale=0.5), gnorm=1.0 + n(c.dv), out=n(h, c.value_dim))
        else:
            lw.update(q=n(2 * c.nh * c.hd, h), k=n(c.nkv * c.hd, h), v=n(c.nkv * c.hd, h), o=n(h, c.nh * c.hd),
                      q_norm=n(c.hd), k_norm=n(c.hd))
        if text.get("intermediate_size"):
            i = text["intermediate_size"]
            lw["mlp"] = (n(i, h), n(i, h), n(h, i))
        if c.num_experts:
            i, s = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
            lw["moe"] = {"router": n(c.num_experts, h, scale=0.5), "gate_up": n(c.num_experts, 2 * i, h),
                         "down": n(c.num_experts, h, i), "shared": (n(s, h), n(s, h), n(h, s)), "shared_gate": n(1, h)}
        w["layers"].append(lw)
    return w


def _grouped_gdn(c: TextConfig, lw: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba: per key head g, [q_g | k_g | v_g | z_g] and [b_g | a_g]."""
    r = c.nv // c.nk
    qkvz, ba = [], []
    for g in range(c.nk):
        values = slice(g * r * c.dv, (g + 1) * r * c.dv)
        qkvz += [lw["qkv"][g * c.dk:(g + 1) * c.dk], lw["qkv"][c.key_dim + g * c.dk:c.key_dim + (g + 1) * c.dk],
                 lw["qkv"][2 * c.key_dim:][values], lw["z"][values]]
        ba += [lw["b"][g * r:(g + 1) * r], lw["a"][g * r:(g + 1) * r]]
    return np.concatenate(qkvz), np.concatenate(ba)


def _layout_config(text: dict, layout: str) -> dict:
    text = dict(text)
    tie = bool(text.get("tie_word_embeddings", False))
    if layout in ("qwen3_5", "qwen3_5_moe"):
        moe = layout == "qwen3_5_moe"
        text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text,
                "vision_config": {**_TINY_VISION, "out_hidden_size": text["hidden_size"]},
                "tie_word_embeddings": tie}
    if layout == "qwen3_5_text":
        return {**text, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    # Qwen3-Next's release config is flat and spells RoPE at the top level
    rope = text.pop("rope_parameters", None) or {}
    text.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    text.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    return {**text, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}


def write_random_folder(folder, config: dict | None = None, layout: str = "qwen3_5", seed: int = 0, *,
                        experts: str = "fused", extras: bool = False, bf16_values: bool = False) -> Path:
    """A random checkpoint (float32 safetensors + config.json) of a text config (TINY_TEXT_CONFIG when None) in
    one of LAYOUTS. The same config and seed give the same weights in every layout. experts: "fused" (3-D
    gate_up_proj / down_proj) or "per_expert" (Qwen3-Next's release form; Qwen3.5-MoE is always fused). extras:
    also write junk `mtp.*` (and, for the multimodal layouts, `model.visual.*`) tensors that a reader must ignore.
    bf16_values: weights rounded to bfloat16 values, so that a bf16 run loads exactly what a float32 run does."""
    from safetensors.numpy import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if experts not in ("fused", "per_expert"):
        raise ValueError(f"experts must be 'fused' or 'per_expert', got {experts!r}")
    text = dict(TINY_TEXT_CONFIG if config is None else config)
    outer = _layout_config(text, layout)
    c = TextConfig(outer)
    w = _random_weights(c, text, np.random.default_rng(seed))
    p = "model.language_model." if layout in ("qwen3_5", "qwen3_5_moe") else "model."
    out = {p + "embed_tokens.weight": w["embed"], p + "norm.weight": w["norm"]}
    if not c.tie:
        out["lm_head.weight"] = w["lm_head"]
    for i, lw in enumerate(w["layers"]):
        q = f"{p}layers.{i}."
        out[q + "input_layernorm.weight"] = lw["input_layernorm"]
        out[q + "post_attention_layernorm.weight"] = lw["post_attention_layernorm"]
        if c.layer_types[i] == LINEAR_ATTENTION:
            a = q + "linear_attn."
            if layout == "qwen3_next":
                out[a + "in_proj_qkvz.weight"], out[a + "in_proj_ba.weight"] = _grouped_gdn(c, lw)
            else:
                for name in ("qkv", "z", "b", "a"):
                    out[f"{a}in_proj_{name}.weight"] = lw[name]
            out.update({a + "conv1d.weight": lw["conv"], a + "A_log": lw["A_log"], a + "dt_bias": lw["dt_bias"],
                        a + "norm.weight": lw["gnorm"], a + "out_proj.weight": lw["out"]})
        else:
            a = q + "self_attn."
            out.update({f"{a}{n}_proj.weight": lw[n] for n in ("q", "k", "v", "o")})
            out.update({a + "q_norm.weight": lw["q_norm"], a + "k_norm.weight": lw["k_norm"]})
        m = q + "mlp."
        if i in c.moe_layers:
            mw = lw["moe"]
            out[m + "gate.weight"] = mw["router"]
            if experts == "fused" or layout == "qwen3_5_moe":
                out[m + "experts.gate_up_proj"], out[m + "experts.down_proj"] = mw["gate_up"], mw["down"]
            else:
                half = mw["gate_up"].shape[1] // 2
                for e in range(c.num_experts):
                    out[f"{m}experts.{e}.gate_proj.weight"] = mw["gate_up"][e, :half]
                    out[f"{m}experts.{e}.up_proj.weight"] = mw["gate_up"][e, half:]
                    out[f"{m}experts.{e}.down_proj.weight"] = mw["down"][e]
            for n, arr in zip(("gate_proj", "up_proj", "down_proj"), mw["shared"]):
                out[f"{m}shared_expert.{n}.weight"] = arr
            out[m + "shared_expert_gate.weight"] = mw["shared_gate"]
        else:
            if "mlp" not in lw:
                raise ValueError(f"layer {i} of layout {layout} is dense but the config has no intermediate_size")
            for n, arr in zip(("gate_proj", "up_proj", "down_proj"), lw["mlp"]):
                out[f"{m}{n}.weight"] = arr
    if extras:
        rng = np.random.default_rng(seed + 1)
        out["mtp.fc.weight"] = rng.normal(size=(c.hidden, 2 * c.hidden))
        out["mtp.layers.0.input_layernorm.weight"] = rng.normal(size=c.hidden)
        if layout in ("qwen3_5", "qwen3_5_moe"):
            out["model.visual.patch_embed.proj.weight"] = rng.normal(size=(8, 3, 2, 4, 4))
            out["model.visual.merger.linear_fc2.weight"] = rng.normal(size=(c.hidden, 16))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cast = bf16_round if bf16_values else _keep
    save_file({k: np.ascontiguousarray(cast(v), np.float32) for k, v in out.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(outer, indent=2))
    return folder
