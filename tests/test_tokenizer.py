import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from xserv.models.config import presets_dir
from xserv.tokenizer import IncrementalDetokenizer, Tokenizer, render_chat_template

FIXTURES = Path(__file__).parent / "fixtures" / "chat_template_cases.json"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(presets_dir() / "tokenizer" / f, d / f)
    shutil.copyfile(presets_dir() / "generation_config.json", d / "generation_config.json")
    (d / "config.json").write_text(json.dumps({"eos_token_id": 151645, "bos_token_id": 151643}))
    return d


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_folder(folder)


def test_encode_decode(tok):
    assert tok.encode("Hello, world") == [9707, 11, 1879]
    assert tok.decode([9707, 11, 1879]) == "Hello, world"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645  # special tokens in text are recognised
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.vocab_size == 151669
    assert tok.encode("") == []


def test_ids_past_the_tokenizer_vocab_decode_to_nothing(tok):
    # the checkpoints have 151936 embedding rows; a random model may sample the padding rows
    assert tok.decode([151700, 9707, 151935]) == "Hello"


def test_eos_ids(tok):
    assert tok.eos_token_ids == [151645, 151643]
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == 151643


def test_eos_from_tokenizer_config_only(tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(presets_dir() / "tokenizer" / f, tmp_path / f)
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [151645]


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


# ---- chat template ----------------------------------------------------------------------------------------------
def _cases():
    return json.loads(FIXTURES.read_text(encoding="utf-8"))


def test_fixture_file_records_its_origin():
    d = _cases()
    assert d["transformers_version"] and len(d["cases"]) >= 10


@pytest.mark.parametrize("case", _cases()["cases"], ids=lambda c: c["name"])
def test_chat_template_matches_transformers(tok, case):
    assert tok.apply_chat_template(case["messages"], **case["kwargs"]) == case["expected"]


@pytest.mark.parametrize("case", _cases()["cases"], ids=lambda c: c["name"])
def test_chat_prompt_ids_match_transformers(tok, case):
    assert tok.encode(case["expected"]) == case["expected_ids"]


@pytest.mark.parametrize("case", _cases()["encodings"], ids=lambda c: c["text"][:20])
def test_encode_matches_transformers(tok, case):
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["text"]


def test_chat_template_defaults(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="at least one message"):
        tok.apply_chat_template([])


def test_template_helpers():
    t = ("{{ messages[0].content | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}"
         "{% if boom %}{{ raise_exception('bad input') }}{% endif %}")
    out = render_chat_template(t, [{"role": "user", "content": "<a> & 'b' é"}], special_tokens={"bos_token": "<s>"})
    assert out == "\"<a> & 'b' é\"|4|<s>"
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad input"):
        render_chat_template(t, [{"role": "user", "content": "x"}], boom=True)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                             [{"role": "user", "content": "x"}])


def test_no_chat_template(folder, tmp_path):
    shutil.copyfile(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


# ---- incremental detokenization ---------------------------------------------------------------------------------
TEXTS = [
    "Hello, world! The quick brown fox.",
    "😀👍🏽🇯🇵👨‍👩‍👧‍👦 emoji sequences 🎉",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "こんにちは、世界。Ünïcödé naïve café — “quotes” ½ ∑ ∫ 𝔘𝔫𝔦",
    "mixed 中文 and English 😀 with <|im_end|> special token and\nnewlines\n\n  spaces",
]


def _stream(tok, ids, **kw):
    d = tok.detokenizer(**kw)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_round_trip(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_splits_multibyte_characters(tok):
    # byte-level BPE splits rare characters across tokens: the detokenizer must hold the partial bytes back
    text = "𝔘𝔫𝔦 🇯🇵 龘"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test needs a character split across tokens"
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # something was held back


def test_streaming_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>")
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)


def test_streaming_random_ids(tok, rng):
    # arbitrary ids (what a random-weight model emits), including ids past the tokenizer's vocab and invalid UTF-8:
    # the deltas still concatenate to the full decode
    for _ in range(20):
        ids = rng.integers(0, 151936, size=int(rng.integers(1, 60))).tolist()
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


def test_streaming_pending_is_bounded(tok):
    # a long run of lone continuation bytes is invalid UTF-8 for good: text must not be held back forever
    cont = tok.encode("\u00e9")  # 'é' = c3 a9; find single-byte tokens for the bytes
    byte_tokens = [i for i in range(256) if tok.decode([i]) == "\ufffd"]
    assert byte_tokens
    ids = tok.encode("ok ") + [byte_tokens[0]] * 20 + tok.encode(" end")
    d = tok.detokenizer()
    deltas = [d.push(i) for i in ids]
    emitted_before_end = "".join(deltas[: len(ids) - 2])
    assert emitted_before_end.startswith("ok ") and "\ufffd" in emitted_before_end
    assert "".join(deltas) + d.flush() == tok.decode(ids)
    del cont


def test_prompt_context_not_emitted(tok):
    prompt = tok.encode("The answer is")
    ids = tok.encode(" 42 😀")
    d = tok.detokenizer(prompt_ids=prompt)
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == " 42 😀"
    assert d.output_ids == ids
    assert isinstance(d, IncrementalDetokenizer)


def test_streaming_decodes_a_short_window(tok, monkeypatch):
    """Each pushed token decodes a window of a few tokens, never the text so far (no O(n^2) re-decoding); the
    deltas still add up to the full decode. (Its speed belongs to benchmarks, not to a unit test.)"""
    ids = tok.encode("lorem ipsum dolor sit amet 你好 😀 " * 60)
    lengths = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda window, **kw: (lengths.append(len(window)), decode(window, **kw))[1])
    d = tok.detokenizer()
    text = "".join(d.push(i) for i in ids) + d.flush()
    monkeypatch.undo()
    assert text == tok.decode(ids) and len(ids) > 400
    assert max(lengths) <= 2 + 2 * IncrementalDetokenizer.MAX_PENDING  # the pending tail plus one token of context
