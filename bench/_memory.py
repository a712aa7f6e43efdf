"""The one memory figure the benchmarks need that qckpt never touches: resetting the host peak.

qckpt reads the process's memory through :mod:`qckpt.memory` and never resets a peak (a reset
mid-command would make every whole-command peak a lie: ``tests/unit/test_phases.py``); a
benchmark that times several phases in one process resets VmHWM between them.
"""

from __future__ import annotations

from pathlib import Path


def reset_peak_rss() -> None:
    """Reset VmHWM to the current resident set (Linux >= 4.0). Read
    :func:`qckpt.memory.peak_rss` first when the whole process's peak is wanted too: a reset
    loses it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
