"""Host memory peaks for the benchmarks' child processes (Linux)."""

from __future__ import annotations

import resource
from pathlib import Path


def rss_peak() -> int:
    """This process's peak RSS in bytes.

    VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec, so a child would report its
    parent's peak (a parent that just generated the whole checkpoint).
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_rss_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0). Read :func:`rss_peak` first when the
    whole process's peak is wanted too: a reset loses it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
