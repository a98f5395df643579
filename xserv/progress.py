"""Progress bars (weight loading, first-run kernel compiles, checkpoint writing) only where someone watches them.

A bar redraws itself with carriage returns: on a terminal that is one line that moves; in a log file or a pipe it
is a heap of half lines. So a bar is drawn only when stderr is a terminal (or a Jupyter kernel's stream, where
tqdm.auto draws a widget), and never when the caller says progress=False.
"""
from __future__ import annotations

import sys


def stderr_is_interactive() -> bool:
    """Whether stderr is a terminal (or a Jupyter kernel's output stream)."""
    stream = sys.stderr
    if stream is None:
        return False
    if type(stream).__module__.split(".")[0] == "ipykernel":
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int, desc: str, *, enabled: bool = True, **kwargs):
    """A tqdm bar on stderr, or None when `enabled` is false or stderr is not interactive (callers skip None)."""
    if not enabled or not stderr_is_interactive():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, **kwargs)
