import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from qwen3_reference import tiny_model_dir  # noqa: F401
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


# ---- the bundled Qwen3.5 / Qwen3.6 tokenizer (xserv/presets/tokenizer_qwen3_5) ----------------------------------
QWEN3_5 = presets_dir() / "tokenizer_qwen3_5"
# ARCHITECTURE.md section 11 / tokenizer README: the ids the engine and the serving side rely on
QWEN3_5_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
               "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067, "<think>": 248068,
               "</think>": 248069, "<|image_pad|>": 248056}


@pytest.fixture(scope="module")
def tok35():
    return Tokenizer.from_folder(QWEN3_5)


def test_qwen3_5_special_tokens(tok35):
    """Every added token of tokenizer_config.json has its id in tokenizer.json (the two files agree), each is one
    token when it appears in text, and the ids the engine stops on and the parsers look for are the documented."""
    decoder = tok35.config["added_tokens_decoder"]
    assert len(decoder) == 33 and tok35.vocab_size == 248044 + 33
    for token_id, entry in decoder.items():
        assert tok35.token_to_id(entry["content"]) == int(token_id)
        assert tok35.encode("a" + entry["content"] + "b")[1:-1] == [int(token_id)]
    assert {t: tok35.token_to_id(t) for t in QWEN3_5_IDS} == QWEN3_5_IDS
    assert tok35.eos_token == "<|im_end|>" and tok35.pad_token_id == 248044


def test_qwen3_5_encodes_as_its_source_does(tok35):
    """The example of the tiktoken package the ranks come from (its README's ids), and a round trip of the texts the
    Qwen3 tests use."""
    assert tok35.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ") == [
        9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914, 28495,
        68933, 128, 105, 68933, 128, 95]
    for text in TEXTS:
        ids = tok35.encode(text)
        assert tok35.decode(ids) == text and "".join(_stream(tok35, ids)) == text


def test_qwen3_5_no_bos_and_its_end_of_sequence_ids(tok35, tmp_path):
    """No BOS: a chat prompt's first token is <|im_start|>, special tokens added or not. End of sequence: the
    tokenizer's <|im_end|>, and the config's <|endoftext|> where a multimodal config.json keeps it (text_config)."""
    prompt = tok35.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok35.encode(prompt)[0] == tok35.encode(prompt, add_special_tokens=True)[0] == 248045
    assert tok35.bos_token_id is None and tok35.eos_token_ids == [248046]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(QWEN3_5 / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": {
        "eos_token_id": 248044}}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == [248044, 248046]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'later'",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}


def test_qwen3_5_chat_template(tok35):
    """Thinking on by default (the generation prompt opens <think>, as one token); off gives the empty block; tools
    listed one JSON object a line (HTML characters unescaped) with the XML call format shown; the system prompt
    after them; a history call written in the XML form (a string raw, other values JSON)."""
    user = [{"role": "user", "content": "hi"}]
    on = tok35.apply_chat_template(user)
    assert on == tok35.apply_chat_template(user, enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and tok35.encode(on)[-2:] == [248068, 198]
    assert tok35.apply_chat_template(user, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    system = [{"role": "system", "content": "Be brief."}] + user
    prompt = tok35.apply_chat_template(system, tools=[WEATHER_TOOL])
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.split("\n")] == [WEATHER_TOOL]
    assert "Weather <now> & 'later'" in listed and "<function=example_function_name>" in prompt
    assert prompt.index("</tools>") < prompt.index("Be brief.") < prompt.index("<|im_end|>")
    history = user + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "content": "sunny"}]
    rendered = tok35.apply_chat_template(history)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>") in rendered
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in rendered


def test_qwen3_5_history_calls_with_openai_json_arguments(tok35):
    """A history call whose arguments are OpenAI's JSON text renders as the same call given as an object (the XML
    template iterates over the object's items); text that is not a JSON object is a ValueError naming the call."""
    def history(arguments):
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "content": "ok"}]

    args = {"city": "Oslo", "days": 2, "opts": {"a": [1, None]}}
    assert tok35.apply_chat_template(history(json.dumps(args))) == tok35.apply_chat_template(history(args))
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]: arguments must be the JSON text"):
        tok35.apply_chat_template(history("[1, 2]"))


def test_qwen3_5_history_thinking(tok35):
    """Reasoning of turns before the last user query is dropped, unless preserve_thinking (the Qwen3.6 template's
    switch, and the reason the bundled template is that one)."""
    chat = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}]
    assert "r1" not in tok35.apply_chat_template(chat)
    assert "<think>\nr1\n</think>\n\na1" in tok35.apply_chat_template(chat, preserve_thinking=True)


@pytest.mark.parametrize("part, kind", [
    ({"type": "image_url", "image_url": {"url": "http://x/a.png"}}, "image"),
    ({"type": "image", "image": "a.png"}, "image"),
    ({"image": "a.png"}, "image"),  # Hugging Face's bare key
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio"),
    ({"type": "video", "video": "v.mp4"}, "video"),
])
@pytest.mark.parametrize("folder", ["tokenizer", "tokenizer_qwen3_5"])
def test_media_parts_are_refused_before_the_template(folder, part, kind):
    """The Qwen3.5 template would write image placeholders for a model without its image encoder, and Qwen3's
    cannot render a part list at all: a ValueError naming the input and its place instead, for every tokenizer."""
    t = Tokenizer.from_folder(presets_dir() / folder)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ValueError, match=rf"^{kind} input is not supported \(messages\[0\]\.content\[1\]"):
        t.apply_chat_template(messages)
    assert "look" in t.apply_chat_template([{"role": "user", "content": "look"}])


def test_llm_chat_refuses_an_image(tiny_model_dir):  # noqa: F811
    from xserv import LLM

    with LLM(tiny_model_dir, device="cpu") as llm:
        with pytest.raises(ValueError, match="image input is not supported"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
