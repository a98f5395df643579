"""The tokenizer of a Hugging Face model folder: `tokenizers` on tokenizer.json, the chat template of
tokenizer_config.json rendered with jinja2 the way `transformers.apply_chat_template` renders it, EOS ids from
generation_config.json / config.json / tokenizer_config.json, and incremental detokenization for streaming."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from .tool_calls import decode_history_arguments, tool_call_format

_SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; templates read `reasoning_content` (transformers aliases them too).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Content parts that carry an input a text-only model cannot take, by part type (OpenAI's and Hugging Face's names)
# -> the input. Templates of vision models turn image parts into placeholder tokens (Qwen3.5's writes
# <|vision_start|><|image_pad|><|vision_end|>), which without the image encoder would be a prompt about nothing.
_MEDIA_PART_TYPES = {"image_url": "image", "image": "image", "input_image": "image", "video": "video",
                     "video_url": "video", "input_audio": "audio", "audio": "audio", "audio_url": "audio",
                     "file": "file", "input_file": "file"}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def media_input(part) -> str | None:
    """"image", "video", "audio" or "file" for a message content part that carries that input (by its `type`, or by
    the bare "image"/"image_url"/"video" key that Hugging Face templates also accept), else None."""
    if not isinstance(part, Mapping):
        return None
    kind = _MEDIA_PART_TYPES.get(part.get("type")) if isinstance(part.get("type"), str) else None
    if kind is None:
        kind = next((_MEDIA_PART_TYPES[k] for k in ("image", "image_url", "video") if k in part), None)
    return kind


def check_text_only(messages) -> None:
    """ValueError naming the first content part that is an image (video, audio, file): xserv serves text only."""
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            kind = media_input(part)
            if kind is not None:
                raise ValueError(f"{kind} input is not supported (messages[{i}].content[{j}] has type "
                                 f"{part.get('type', kind)!r}): xserv serves text-only models")


# ---- chat template ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters (<, >, &, '); transformers' does not, nor do we
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class _Namespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing underscore names (no reaching CPython internals from a template)."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                _Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            _Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({key!r})")

    class _GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers some templates carry): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON-like types (the sandbox then sees no foreign objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # NumPy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def render_chat_template(template: str, messages: list, *, add_generation_prompt: bool = True, tools=None,
                         documents=None, special_tokens: dict[str, str] | None = None, **kwargs) -> str:
    """Render a Hugging Face chat template as transformers' apply_chat_template(tokenize=False) does."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a chat needs at least one message (a list of {'role': ..., 'content': ...} dicts)")
    check_text_only(messages)
    chat = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        m = {k: v for k, v in _plain(m).items() if v is not None}  # content=None etc. as if absent
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    if tools is not None:
        if not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        tools = _plain(list(tools))
    context = {**(special_tokens or {}), **_plain(kwargs)}
    return _compile_template(template).render(messages=chat, tools=tools, documents=_plain(documents),
                                              add_generation_prompt=add_generation_prompt, **context)


# ---- the tokenizer ----------------------------------------------------------------------------------------------
class Tokenizer:
    def __init__(self, tokenizer, tokenizer_config: dict | None = None, generation_config: dict | None = None,
                 model_config: dict | None = None):
        self._tok = tokenizer
        self.config = tokenizer_config or {}
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL_TOKEN_ATTRIBUTES:
            content = _token_content(self.config.get(attr))
            if content is not None:
                self.special_tokens[attr] = content
        eos: list[int] = []
        model_config = model_config or {}
        # a multimodal checkpoint (Qwen3.5's) keeps the language model's ids under text_config
        text_config = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else {}
        for src in ((generation_config or {}).get("eos_token_id"),
                    model_config.get("eos_token_id", text_config.get("eos_token_id"))):
            eos += _ids(src)
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None and tokenizer.token_to_id(eos_text) is not None:
            eos.append(tokenizer.token_to_id(eos_text))
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))
        bos = (generation_config or {}).get("bos_token_id", model_config.get("bos_token_id"))
        self.bos_token_id: int | None = bos if isinstance(bos, int) else None
        pad = (generation_config or {}).get("pad_token_id")
        if pad is None and "pad_token" in self.special_tokens:
            pad = tokenizer.token_to_id(self.special_tokens["pad_token"])
        self.pad_token_id: int | None = pad if isinstance(pad, int) else None

    @classmethod
    def from_folder(cls, folder) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (xserv reads the fast-tokenizer file)")
        return cls(HFTokenizer.from_file(str(path)), _read_json(folder / "tokenizer_config.json"),
                   _read_json(folder / "generation_config.json"), _read_json(folder / "config.json"))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's embedding may have more rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids the tokenizer does not know (embedding padding rows) decode to nothing."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, enable_thinking: bool = True,
                            tools=None, **kwargs) -> str:
        """The prompt text for a chat: the folder's chat template rendered as transformers renders it. A template of
        the XML tool-call form iterates over a history call's arguments: arguments given as OpenAI's JSON text are
        decoded for it first (xserv/tool_calls/)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json); use plain prompts")
        if tool_call_format(self.chat_template) == "xml" and isinstance(messages, (list, tuple)):
            messages = decode_history_arguments(messages)
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=self.special_tokens,
                                    enable_thinking=enable_thinking, **kwargs)

    def detokenizer(self, skip_special_tokens: bool = False, prompt_ids=None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    def __repr__(self):
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Streaming text from a stream of token ids. `push(id)` returns the text that became final; text whose tail
    decodes to U+FFFD (an incomplete UTF-8 character split across tokens) is held back until the character
    completes. The concatenated deltas plus `flush()` equal `decode(all ids)`.

    Decoding uses a short window from `prefix_offset` (tokens already emitted, kept as context for tokenizers whose
    decode of a token depends on its left neighbour) to the end, so each step costs O(window), not O(sequence)."""

    # An incomplete UTF-8 character is at most 3 bytes, so at most 3 tokens; beyond this many pending tokens the
    # U+FFFD is a real invalid sequence (it stays in the full decode too) and the text before the tail is emitted.
    MAX_PENDING = 6

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, prompt_ids=None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        context = list(prompt_ids or [])[-4:]  # left context only; never emitted
        self.ids.extend(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._start = len(context)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if not new_text.endswith("\ufffd"):
            return self._advance(prefix_text, new_text, len(self.ids))
        if len(self.ids) - self.read_offset <= self.MAX_PENDING:
            return ""
        # A long pending tail still ending in U+FFFD holds invalid bytes for good. Emit up to the latest token
        # boundary whose text is a prefix of the current text and cannot change: it ends on a whole character, or
        # at least 3 tokens (>= 3 bytes, the longest incomplete UTF-8 tail) lie after it.
        n = len(self.ids)
        for end in range(n - 1, self.read_offset, -1):
            text = self._decode(self.ids[self.prefix_offset:end])
            if new_text.startswith(text) and (end <= n - 3 or not text.endswith("\ufffd")):
                return self._advance(prefix_text, text, end)
        return ""

    def _advance(self, prefix_text: str, new_text: str, end: int) -> str:
        # new_text extends prefix_text (the window starts on a whole-character boundary); a token that decodes to
        # nothing (an id past the tokenizer's vocabulary, a skipped special token) just moves the window on.
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes to U+FFFD, as in the full
        decode)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self._start:]
