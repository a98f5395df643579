"""Every sampling option and stop condition of the `LLM` API, each in a test that fails if the option were ignored
or inverted. The model is tests/scripted_model.py's: its next-token logits are written down in the test module, so
every expectation here comes from the documented semantics applied to those logits, not from a run of the engine.
Semantics (README, xserv/sampling.py, docs/kernels/sampling.md): penalties (repetition, then presence and frequency
on output tokens) -> temperature (0 = greedy argmax) -> top-k -> top-p -> min-p -> one draw keyed by the request's
seed; n samples seeded seed, seed + 1, ...; log-probs of the raw logits. A request stops at an EOS token
(config.json's or generation_config.json's) unless ignore_eos, at one of its stop token ids (kept in token_ids, not
in the text), at a stop string (cut from the text), or after max_tokens."""
import pytest

from scripted_model import (AFTER_EOS, COUNT, DRAW, DRAW_LOGITS, END_OF_TEXT, IM_END, WORD_IDS,  # noqa: F401
                            scripted_model)
from xserv import LLM, SamplingParams

COUNT_PROMPT, COLORS_PROMPT, DRAW_PROMPT, EIGHT_PROMPT = "Count:", "Colors: green", "I like peach", "Numbers: eight"
TOP2 = {" apple", " banana"}  # DRAW's two most likely words (probabilities .185 and .144 at temperature 1)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(request, scripted_model):  # noqa: F811
    """The NumPy backend here; on a GPU machine the CUDA one too (its sampler is a kernel of its own)."""
    return LLM(str(scripted_model.path), device=request.param, max_model_len=256, kv_cache_tokens=4096,
               max_num_seqs=8, progress=False)


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def run(llm, prompt, params):
    return llm.generate(prompt, params)[0]


def test_the_script_words_are_the_tokenizers(llm):
    assert {word: llm.tokenizer.decode([token]) for word, token in WORD_IDS.items()} == {w: w for w in WORD_IDS}


# ---- stop conditions -------------------------------------------------------------------------------------------------
def test_eos_from_config_stops(llm, scripted_model):  # noqa: F811
    out = run(llm, COUNT_PROMPT, greedy(max_tokens=50))
    assert scripted_model.words(out.token_ids) == list(COUNT) + [IM_END]
    assert out.text == "".join(COUNT) and out.finish_reason == "stop"


def test_eos_from_generation_config_stops(llm, scripted_model):  # noqa: F811
    out = run(llm, EIGHT_PROMPT, greedy(max_tokens=50))
    assert scripted_model.words(out.token_ids) == [" nine", END_OF_TEXT]
    assert out.text == " nine" and out.finish_reason == "stop"


def test_ignore_eos_goes_on_to_max_tokens(llm, scripted_model):  # noqa: F811
    out = run(llm, COUNT_PROMPT, greedy(max_tokens=7, ignore_eos=True))
    assert scripted_model.words(out.token_ids) == list(COUNT) + [IM_END] + list(AFTER_EOS)
    assert out.text == "".join(COUNT + AFTER_EOS) and out.finish_reason == "length"


@pytest.mark.parametrize("max_tokens, finish", [(1, "length"), (3, "length"), (5, "stop")])
def test_max_tokens(llm, scripted_model, max_tokens, finish):  # noqa: F811
    out = run(llm, COUNT_PROMPT, greedy(max_tokens=max_tokens))
    want = (list(COUNT) + [IM_END])[:max_tokens]
    assert scripted_model.words(out.token_ids) == want and out.finish_reason == finish  # 5: the EOS came last


def test_stop_token_ids(llm, scripted_model):  # noqa: F811
    three = scripted_model.id(" three")
    out = run(llm, COUNT_PROMPT, greedy(max_tokens=50, stop_token_ids=[three]))
    assert scripted_model.words(out.token_ids) == [" one", " two", " three"]
    assert out.text == " one two" and out.finish_reason == "stop"
    # ignore_eos ignores EOS only: a stop token id still ends the request
    five = scripted_model.id(" five")
    out = run(llm, COUNT_PROMPT, greedy(max_tokens=50, stop_token_ids=[five], ignore_eos=True))
    assert scripted_model.words(out.token_ids) == list(COUNT) + [IM_END, " five"]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("stop, text, num_tokens", [
    ([" three"], " one two", 3),  # a whole token
    (["o th"], " one tw", 3),  # across two tokens: " two" is held back until " three" decides
    ([" four", "ne t"], " o", 2),  # the first stop string to appear wins, whatever its place in the list
])
def test_stop_strings(llm, scripted_model, stop, text, num_tokens):  # noqa: F811
    params = greedy(max_tokens=50, stop=stop)
    out = run(llm, COUNT_PROMPT, params)
    assert out.text == text and out.finish_reason == "stop"
    assert scripted_model.words(out.token_ids) == list(COUNT[:num_tokens])  # generation ended at the stop string
    assert "".join(llm.stream(COUNT_PROMPT, params)) == text  # the stream never shows any of the stop string


# ---- penalties -------------------------------------------------------------------------------------------------------
def test_repetition_penalty_under_greedy(llm, scripted_model):  # noqa: F811
    plain = run(llm, COLORS_PROMPT, greedy(max_tokens=6))
    assert scripted_model.words(plain.token_ids) == [" red", " green"] * 3  # 44 beats 40 every time
    # red's 44 / 1.5 = 29.3 < blue's 40 once red has been seen; green's 29.3 is still the best after red
    out = run(llm, COLORS_PROMPT, greedy(max_tokens=6, repetition_penalty=1.5))
    assert scripted_model.words(out.token_ids) == [" red", " green", " blue", IM_END]
    assert out.text == " red green blue" and out.finish_reason == "stop"
    # a penalty < 1 favours seen tokens: the cycle stays
    out = run(llm, COLORS_PROMPT, greedy(max_tokens=6, repetition_penalty=0.5))
    assert scripted_model.words(out.token_ids) == [" red", " green"] * 3


def test_presence_and_frequency_penalties_under_greedy(llm, scripted_model):  # noqa: F811
    # OpenAI's: logit -= presence * (count > 0) + frequency * count, counting output tokens. Greedy after the
    # prompt: apple 42, banana 41.75, the six others 41.5.
    assert draw(llm, scripted_model, 8, temperature=0.0) == [" apple"] * 8
    # presence 0.4: a seen apple (41.6) loses to banana (41.75) once; then both are seen and apple leads for good
    assert draw(llm, scripted_model, 8, temperature=0.0, presence_penalty=0.4) == \
        [" apple", " banana"] + [" apple"] * 6
    # frequency 0.1: apple 42 - 0.1 a against banana 41.75 - 0.1 b (gaps of 0.05 at least)
    assert draw(llm, scripted_model, 8, temperature=0.0, frequency_penalty=0.1) == \
        [" apple", " apple", " apple", " banana", " apple", " banana", " apple", " banana"]


# ---- sampling --------------------------------------------------------------------------------------------------------
def draw(llm, scripted_model, n, **kw):  # noqa: F811
    """The words of n tokens drawn after DRAW_PROMPT (each from DRAW_LOGITS): a KeyError if any is not a DRAW word."""
    out = run(llm, DRAW_PROMPT, SamplingParams(max_tokens=n, **kw))
    assert len(out.token_ids) == n and out.finish_reason == "length"
    words = scripted_model.words(out.token_ids)
    assert set(words) <= set(DRAW)
    return words


def test_temperature(llm, scripted_model):  # noqa: F811
    assert draw(llm, scripted_model, 8, temperature=0.0) == [" apple"] * 8  # greedy: the argmax
    # T = 0.01 scales apple's 0.25 lead over banana to 25: banana's probability e^-25
    assert draw(llm, scripted_model, 8, temperature=0.01, seed=0) == [" apple"] * 8
    # T = 1: the 6 words outside TOP2 together have probability .672 per token (P(none in 8) = 1e-4)
    assert set(draw(llm, scripted_model, 8, temperature=1.0, seed=0)) - TOP2


@pytest.mark.parametrize("option, only_top2, only_top1", [
    ("top_k", 2, 1),
    ("top_p", 0.3, 0.1),  # cumulative .185 (apple), .328 (+ banana)
    ("min_p", 0.7, 0.9),  # banana / apple = e^-0.25 = .78; the others e^-0.5 = .61
])
def test_filters_keep_the_documented_tokens(llm, scripted_model, option, only_top2, only_top1):  # noqa: F811
    # apple and banana left: banana has probability .438 (P(no banana in 16) = 1e-4); with the filter ignored, an
    # other word would come (P(none in 16) = 2e-8)
    assert set(draw(llm, scripted_model, 16, seed=0, **{option: only_top2})) == TOP2
    assert draw(llm, scripted_model, 6, seed=0, **{option: only_top1}) == [" apple"] * 6  # else P = .185^6 = 4e-5


@pytest.mark.parametrize("option, value", [("top_p", 0.4), ("min_p", 0.5)])
def test_temperature_comes_before_the_filters(llm, scripted_model, option, value):  # noqa: F811
    # at T = 0.25 apple has probability .46 (> top_p .4) and banana / apple = e^-1 = .37 (< min_p .5): apple only.
    # Filtering the T = 1 distribution first would keep all eight (then P(apple 12 times) = .46^12 = 9e-5).
    assert draw(llm, scripted_model, 12, seed=0, temperature=0.25, **{option: value}) == [" apple"] * 12


def test_seed(llm, scripted_model):  # noqa: F811
    a = draw(llm, scripted_model, 8, seed=1)
    assert len(set(a)) > 1  # really sampled
    assert draw(llm, scripted_model, 8, seed=2) != a  # different seeds, different draws (P(same) = 1e-7)
    # the same seed, the same draws, whatever else runs in the batch
    batch = llm.generate([COUNT_PROMPT, DRAW_PROMPT, DRAW_PROMPT, DRAW_PROMPT, DRAW_PROMPT],
                         [greedy(max_tokens=8), SamplingParams(max_tokens=10, seed=7),
                          SamplingParams(max_tokens=8, seed=1), SamplingParams(max_tokens=6),
                          SamplingParams(max_tokens=6)])
    assert scripted_model.words(batch[2].token_ids) == a
    # requests without a seed do not share one (P(same 6 words) = 5e-6)
    assert batch[3].token_ids != batch[4].token_ids


def test_n_samples(llm, scripted_model):  # noqa: F811
    outs = llm.generate(DRAW_PROMPT, SamplingParams(n=3, seed=11, max_tokens=6))
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) == 3  # three different samples
    # sample i is seeded with seed + i
    assert outs[1].token_ids == run(llm, DRAW_PROMPT, SamplingParams(seed=12, max_tokens=6)).token_ids


def test_logprobs_are_of_the_raw_logits(llm, scripted_model):  # noqa: F811
    import math

    vocab = llm.config.vocab_size
    logits = dict(zip(DRAW, DRAW_LOGITS))
    lse = math.log(sum(math.exp(x) for x in logits.values()) + (vocab - len(DRAW)))  # every other logit is 0
    apple, banana = scripted_model.id(" apple"), scripted_model.id(" banana")
    for temperature in (0.0, 0.5):  # the log-probs do not see the temperature
        out = run(llm, DRAW_PROMPT, SamplingParams(temperature=temperature, top_k=1, max_tokens=3, logprobs=2))
        assert len(out.logprobs) == 3
        for entry in out.logprobs:
            assert entry["token_id"] == apple and entry["logprob"] == pytest.approx(42.0 - lse, abs=1e-4)
            (id0, lp0), (id1, lp1) = entry["top"]
            assert (id0, id1) == (apple, banana)
            assert (lp0, lp1) == (pytest.approx(42.0 - lse, abs=1e-4), pytest.approx(41.75 - lse, abs=1e-4))
    assert run(llm, DRAW_PROMPT, SamplingParams(max_tokens=3)).logprobs is None


# ---- chat template ---------------------------------------------------------------------------------------------------
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
# Qwen3's ChatML: <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, then the assistant's header; with thinking
# off, an empty think block.
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
          "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_roles(llm):
    greedy4 = greedy(max_tokens=4)
    thinking = llm.chat(CONVERSATION, greedy4)[0]
    assert thinking.prompt == CHATML and thinking.text == " yes"  # the prompt ends in "assistant\n"
    plain = llm.chat(CONVERSATION, greedy4, enable_thinking=False)[0]
    assert plain.prompt == CHATML + "<think>\n\n</think>\n\n" and plain.text == " no"
    assert plain.prompt_token_ids == llm.tokenizer.encode(plain.prompt)


@pytest.mark.parametrize("where", ["system", "user", "assistant"])
def test_chat_every_role_reaches_the_model(llm, where):
    messages = [dict(m) for m in CONVERSATION]
    index = {"system": 0, "user": 1, "assistant": 2}[where]
    messages[index]["content"] += " Paris"
    assert llm.chat(messages, greedy(max_tokens=3))[0].text == " flag" * 3
