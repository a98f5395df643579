"""Render a set of conversations with transformers' apply_chat_template and store the strings as a test fixture.

    pip install transformers   # a tool dependency only; no torch needed for templates
    python -m tools.dev.make_chat_fixtures [--tokenizer xserv/presets/tokenizer] [--out tests/fixtures/chat_template_cases.json]

tests/test_tokenizer.py checks that xserv.tokenizer renders every case to exactly the stored string.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Returns <json> & 'quotes' untouched.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

# (name, messages, keyword arguments for apply_chat_template)
CASES = [
    ("single_user", [{"role": "user", "content": "Hello!"}], {"add_generation_prompt": True}),
    ("single_user_no_generation_prompt", [{"role": "user", "content": "Hello!"}], {"add_generation_prompt": False}),
    ("system_user_thinking_off",
     [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "2+2?"}],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("system_user_thinking_on",
     [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "2+2?"}],
     {"add_generation_prompt": True, "enable_thinking": True}),
    ("multi_turn",
     [{"role": "system", "content": "Be kind."},
      {"role": "user", "content": "Hi, who are you?"},
      {"role": "assistant", "content": "I am a language model."},
      {"role": "user", "content": "Tell me a joke."}],
     {"add_generation_prompt": True}),
    ("history_with_think_content",
     [{"role": "user", "content": "What is 17*3?"},
      {"role": "assistant", "content": "<think>\n17*3 = 51.\n</think>\n\n51"},
      {"role": "user", "content": "And 17*4?"},
      {"role": "assistant", "content": "<think>\nAdd 17 to 51.\n</think>\n\n68"}],
     {"add_generation_prompt": False}),
    ("think_in_last_turn_then_prompt",
     [{"role": "user", "content": "Name a prime."},
      {"role": "assistant", "content": "<think>\nsmall one\n</think>\n\n2"},
      {"role": "user", "content": "Another?"}],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("reasoning_content_field",
     [{"role": "user", "content": "Why is the sky blue?"},
      {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Short wavelengths scatter more."}],
     {"add_generation_prompt": False}),
    ("unicode_emoji_cjk",
     [{"role": "system", "content": "Réponds en français 🇫🇷."},
      {"role": "user", "content": "你好，世界！こんにちは 😀👍🏽 — naïve café"},
      {"role": "assistant", "content": "Bonjour ! 🌍 你好"},
      {"role": "user", "content": "  leading and trailing spaces \n\n"}],
     {"add_generation_prompt": True}),
    ("tools_and_tool_calls",
     [{"role": "system", "content": "You can check the weather."},
      {"role": "user", "content": "Weather in Paris and Zürich?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
          {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
      {"role": "tool", "content": "{\"temp\": 18}"},
      {"role": "tool", "content": "{\"temp\": 12}"}],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("tools_without_system",
     [{"role": "user", "content": "Weather in Oslo?"}],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "enable_thinking": False}),
    ("assistant_text_and_tool_call",
     [{"role": "user", "content": "Oslo?"},
      {"role": "assistant", "content": "Checking.", "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
      {"role": "tool", "content": "cold"},
      {"role": "assistant", "content": "It is cold."}],
     {"add_generation_prompt": False}),
]


ENCODE_TEXTS = [
    "Hello, world",
    "  leading spaces\t\ttabs\n\n\nnewlines   ",
    "你好，世界！こんにちは 안녕하세요",
    "naïve café — “quotes” 𝔘𝔫𝔦 🇯🇵 👨‍👩‍👧‍👦",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>",
    "def f(x):\n    return x ** 2  # 1234567890",
]


def main(argv=None) -> int:
    import transformers
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(REPO / "xserv" / "presets" / "tokenizer"))
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "chat_template_cases.json"))
    args = ap.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    cases = []
    for name, messages, kwargs in CASES:
        text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({"name": name, "messages": messages, "kwargs": kwargs, "expected": text, "expected_ids": ids})
    encodings = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in ENCODE_TEXTS]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "generator": "python -m tools.dev.make_chat_fixtures",
        "transformers_version": transformers.__version__,
        "tokenizer": "xserv/presets/tokenizer (Qwen3)",
        "cases": cases,
        "encodings": encodings,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {out} (transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
