"""Sampling defaults from a model folder's `generation_config.json` (what the model's authors recommend, e.g.
Qwen3: temperature 0.6, top-p 0.95, top-k 20), as vLLM applies them: a request's own values win, these fill in
what it leaves out. Used by `xserv serve`, `xserv chat` and `xserv generate`."""
from __future__ import annotations

import json
import math
from pathlib import Path

# generation_config.json key -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGER = {"top_k", "max_new_tokens"}


def sampling_defaults(folder) -> dict:
    """{SamplingParams field: value} for the keys the folder's generation_config.json sets; {} when there is none.
    `do_sample` is not read (vLLM does the same): a model that ships a temperature means it. A malformed file or
    a value of the wrong type raises ValueError naming the file and the key."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    defaults = {}
    for key, field in _FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        if key in _INTEGER:
            if int(value) != value:
                raise ValueError(f"{path}: {key} must be an integer, got {value!r}")
            value = int(value)
        else:
            value = float(value)
        defaults[field] = value
    return defaults
