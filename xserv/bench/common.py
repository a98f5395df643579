"""What the benchmarks share: parsing MIN:MAX ranges, naming the device, writing the JSON result."""
from __future__ import annotations

import json
import platform
import sys


def length_range(text: str) -> tuple[int, int]:
    """'100:1024' -> (100, 1024); '512' -> (512, 512)."""
    import argparse

    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def device_name(device: str) -> str:
    if device == "cuda":
        from ..runtime import get_device

        return get_device().name
    return f"cpu ({platform.processor() or platform.machine()})"


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)
