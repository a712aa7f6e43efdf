"""The CLI's consoles (``qckpt.cli.output``): progress bars on a terminal only."""

from __future__ import annotations


def test_progress_bars_show_rate_and_eta_on_a_terminal_only(monkeypatch):
    import io

    from rich.console import Console

    from qckpt.cli import output

    for terminal in (True, False):
        buf = io.StringIO()
        con = Console(file=buf, force_terminal=terminal, width=120)
        monkeypatch.setattr(output, "err", con)
        with output.progress("exporting", 4) as advance:
            for _ in range(4):
                advance()
        text = buf.getvalue()
        assert ("eta" in text and "/s" in text) if terminal else text == "", (terminal, text)
