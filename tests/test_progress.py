"""Progress bars only where someone watches: stderr a terminal (xserv/progress.py); progress=False always wins."""
import io
import sys

from xserv.progress import progress_bar


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_bar(3, "loading") is None
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, or a closed stderr
    assert progress_bar(3, "loading") is None
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert progress_bar(3, "loading", enabled=False) is None
    bar = progress_bar(3, "loading", leave=False)
    assert bar is not None
    bar.update(3)
    bar.close()
    assert "loading" in terminal.getvalue()
