"""Write a Hugging Face-format checkpoint folder (Qwen3 or Llama 3) with random weights at a preset's real shapes.

    python -m tools.make_test_model --preset tiny --out models/tiny-random

The same command as `xserv make-test-model` (xserv/models/make_test_model.py, which ships in the package), kept
under this name for the scripts and notes that use it.
"""
from __future__ import annotations

import sys

from xserv.models.make_test_model import main as _main


def main(argv=None) -> int:
    return _main(argv, prog="python -m tools.make_test_model")


if __name__ == "__main__":
    sys.exit(main())
