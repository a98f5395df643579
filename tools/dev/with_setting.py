"""Run a Python module (as `python -m` would) with module attributes of xserv set first: the plan parameters that
benchmarks compare (gemv.FP8_EARLY_TRIGGER_BYTES, gemv.FP8_PREFER_ONE_STEP, model_runner.FINE_KV_MAX_BATCH, ...).
Settings a user may set are environment variables (xserv/settings.py), not attributes.

    python -m tools.dev.with_setting xserv.ops.gemv.FP8_EARLY_TRIGGER_BYTES=0 -- xserv bench latency --model DIR
    python -m tools.dev.with_setting xserv.engine.model_runner.FINE_KV_MAX_BATCH=0 -- pytest -q tests/engine/test_engine.py

Each setting is MODULE.ATTRIBUTE=VALUE with an existing attribute; VALUE is converted to that attribute's type.
"""
from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def apply(setting: str) -> None:
    target, sep, value = setting.partition("=")
    module_name, _, attribute = target.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"with_setting: expected MODULE.ATTRIBUTE=VALUE, got {setting!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise SystemExit(f"with_setting: {module_name} has no attribute {attribute!r}")
    current = getattr(module, attribute)
    kind = type(current)
    try:
        if kind is bool:
            converted = value.lower() in ("1", "true")
        else:
            converted = kind(float(value)) if kind in (int, float) else kind(value)
    except ValueError:
        raise SystemExit(f"with_setting: {value!r} does not convert to {kind.__name__} "
                         f"({target} is {current!r})") from None
    setattr(module, attribute, converted)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    split = argv.index("--")
    for setting in argv[:split]:
        apply(setting)
    sys.argv = argv[split + 1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
