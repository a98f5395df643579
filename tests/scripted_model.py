"""A Qwen3 checkpoint with crafted weights whose next-token logits are written down by the test, so that what the
engine must output under any sampling option is known without running the engine.

How the weights do it (hidden size 64, one layer; every weight not named here is zero, every norm weight one):
- each "state" gets a slot (a hidden dimension); every token's embedding is the one-hot vector of its state's
  slot (tokens no rule names share the state DEFAULT). The attention and MLP of the layer add nothing to it (their
  output projections are zero), so the final RMSNorm sees a one-hot vector and turns it into 8 x one-hot
  (sqrt(hidden_size) = 8, exact in bf16);
- lm_head[token, slot] = logit / 8, so the logits after the last token t are exactly the rule of t's state:
  the model is a Markov chain over the last token, with logits the test chooses (0 for every token a rule
  leaves out);
- MARKER: the layer's attention has q = k = 0, so it averages v over the whole context; v reads the marker
  slot and o_proj writes the average, scaled by a large gain, into the FLAG slot. When a marker token appears
  anywhere in the context, the FLAG slot dominates the normalised hidden state and lm_head makes FLAG_REPLY win
  (logit ~ FLAG_LOGIT against at most ~1 for every rule). This makes the system prompt and the conversation
  history observable in the output.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

DEFAULT = "default"
HIDDEN = 64
FLAG_SLOT, MARKER_SLOT = 1, 2  # slot 0 is DEFAULT's; rule states take the slots from 3 on
FLAG_GAIN = 1000.0  # o_proj weight: the marker average (>= 1/200 in contexts under 200 tokens) x 8 x this >> 1
FLAG_LOGIT = 40.0


def build_scripted_model(folder, rules: dict, marker_ids=(), flag_reply: int | None = None) -> Path:
    """Write the checkpoint to `folder` and return its path.

    rules: {state: {next_token_id: logit}}; a state is DEFAULT, a token id, or a tuple of token ids that share it.
    marker_ids: tokens whose presence anywhere in the context makes `flag_reply` the next token."""
    import ml_dtypes

    from xserv.models.config import preset_dict, presets_dir
    from xserv.models.random_checkpoint import save_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # a 1-layer tiny Qwen3 with its own lm_head, and the real Qwen3 tokenizer
    config = preset_dict("tiny") | {"tie_word_embeddings": False, "num_hidden_layers": 1, "max_window_layers": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(presets_dir() / "tokenizer" / name, folder / name)
    weights = _zero_weights(config)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    if len(rules) + 3 > HIDDEN:
        raise ValueError(f"at most {HIDDEN - 3} states, got {len(rules)}")

    embed[:, 0] = 1.0  # every token starts in DEFAULT's slot
    for slot, (state, logits) in enumerate(rules.items(), start=3):
        if state == DEFAULT:
            slot = 0
        else:
            tokens = list(state) if isinstance(state, tuple) else [state]
            embed[tokens] = 0.0
            embed[tokens, slot] = 1.0
        for token, logit in logits.items():
            head[token, slot] = _exact_in_bf16(logit / 8.0)

    if marker_ids:
        if flag_reply is None:
            raise ValueError("marker_ids need a flag_reply")
        embed[list(marker_ids)] = 0.0
        embed[list(marker_ids), MARKER_SLOT] = 1.0
        attn = "model.layers.0.self_attn."
        weights[attn + "v_proj.weight"][0, MARKER_SLOT] = 1.0  # v[head 0][0] = 8 on a marker token, else 0
        weights[attn + "o_proj.weight"][FLAG_SLOT, 0] = _exact_in_bf16(FLAG_GAIN)  # hidden[FLAG] += gain x mean v
        head[flag_reply, FLAG_SLOT] = _exact_in_bf16(FLAG_LOGIT / 8.0)

    weights = {name: w.astype(ml_dtypes.bfloat16) for name, w in weights.items()}
    save_safetensors(folder / "model.safetensors", weights)
    return folder


def _exact_in_bf16(x: float) -> float:
    import ml_dtypes

    if float(np.float32(x).astype(ml_dtypes.bfloat16)) != x:
        raise ValueError(f"{x} is not exact in bfloat16: pick logits with fewer significant bits")
    return x


def _zero_weights(config: dict) -> dict[str, np.ndarray]:
    """float32 zeros for every tensor of a Qwen3ForCausalLM with an lm_head (ones for the norm weights)."""
    h, v, d = config["hidden_size"], config["vocab_size"], config["head_dim"]
    q, kv, inter = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return {name: (np.ones if name.endswith("norm.weight") else np.zeros)(shape, np.float32)
            for name, shape in shapes.items()}


# ---- the script the option tests run -----------------------------------------------------------------------------
IM_END, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"  # config.json's eos_token_id; generation_config.json's second
COUNT = (" one", " two", " three", " four")  # DEFAULT -> one -> two -> three -> four -> <|im_end|>
AFTER_EOS = (" five", " six")  # <|im_end|> -> five -> six (seen only with ignore_eos)
DRAW = (" apple", " banana", " cherry", " grape", " lemon", " mango", " olive", " plum")
# probabilities at temperature 1: apple .185, banana .144, the six others .112 each (.672 together); multiples of
# 0.25 so that logit / 8 is exact in bf16
DRAW_LOGITS = (42.0, 41.75) + (41.5,) * 6


@dataclass(frozen=True)
class ScriptedModel:
    """The checkpoint folder and the token ids of the words its script uses."""
    path: Path
    ids: dict[str, int]

    def id(self, word: str) -> int:
        return self.ids[word]

    def words(self, token_ids) -> list[str]:
        """token ids -> the script's words (KeyError on a token the script never produces)."""
        names = {i: w for w, i in self.ids.items()}
        return [names[t] for t in token_ids]


def option_script(ids: dict[str, int]) -> tuple[dict, list[int], int]:
    """(rules, marker ids, flag reply) of the model the option tests use. After a prompt whose last token no rule
    names, it counts (COUNT, then <|im_end|>); other prompts pick a branch by their last token:
    - "... green": red (44) -> green (44) -> red (44) or blue (40) -> <|im_end|>; greedy cycles red green red green
      unless a repetition penalty > 44/40 pushes an already-seen red below blue;
    - "... peach": eight tokens drawn from the fixed distribution DRAW_LOGITS, forever (for the samplers);
    - "... eight": nine -> <|endoftext|> (an EOS from generation_config.json only);
    - a chat prompt: it ends in "assistant" + newline -> " yes", or, with thinking off, in "</think>" + two
      newlines (one token) -> " no"; then <|im_end|>;
    - "Paris" / " Paris" anywhere in the context (system prompt, history, prompt): " flag" every token."""
    i = ids
    rules = {DEFAULT: {i[" one"]: 40.0}, i[" one"]: {i[" two"]: 40.0}, i[" two"]: {i[" three"]: 40.0},
             i[" three"]: {i[" four"]: 40.0}, i[" four"]: {i[IM_END]: 40.0},
             i[IM_END]: {i[" five"]: 40.0}, i[" five"]: {i[" six"]: 40.0},
             i[" green"]: {i[" red"]: 44.0, i[" blue"]: 40.0}, i[" red"]: {i[" green"]: 44.0},
             i[" blue"]: {i[IM_END]: 40.0},
             tuple(i[w] for w in (" peach",) + DRAW): {i[w]: x for w, x in zip(DRAW, DRAW_LOGITS)},
             i[" eight"]: {i[" nine"]: 40.0}, i[" nine"]: {i[END_OF_TEXT]: 40.0},
             i["\n"]: {i[" yes"]: 40.0}, i["\n\n"]: {i[" no"]: 40.0}, (i[" yes"], i[" no"]): {i[IM_END]: 40.0}}
    return rules, [i["Paris"], i[" Paris"]], i[" flag"]


# Their ids in the Qwen3 tokenizer (each word is one token); test_options.py checks them against the tokenizer.
WORD_IDS = {" one": 825, " two": 1378, " three": 2326, " four": 3040, " five": 4236, " six": 4743, " apple": 23268,
            " banana": 43096, " cherry": 40880, " grape": 51152, " lemon": 29464, " mango": 69268, " olive": 32113,
            " plum": 41172, IM_END: 151645, END_OF_TEXT: 151643, " green": 6176, " red": 2518, " blue": 6303,
            " peach": 72088, " eight": 8063, " nine": 11627, "\n": 198, "\n\n": 271, " yes": 9834, " no": 902,
            "Paris": 59604, " Paris": 12095, " flag": 5181}


_MADE: list[ScriptedModel] = []  # made once per test process, whichever modules import the fixture


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory) -> ScriptedModel:
    if not _MADE:
        _MADE.append(_make_scripted_model(tmp_path_factory.mktemp("models") / "scripted"))
    return _MADE[0]


def _make_scripted_model(folder) -> ScriptedModel:
    ids = WORD_IDS
    rules, markers, flag = option_script(ids)
    folder = build_scripted_model(folder, rules, markers, flag)
    # the two end-of-sequence sources a Qwen3 folder has
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": ids[IM_END]}, indent=2))
    generation = {"eos_token_id": [ids[IM_END], ids[END_OF_TEXT]], "bos_token_id": ids[END_OF_TEXT]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return ScriptedModel(folder, ids)
