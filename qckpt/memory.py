"""The process's memory, read in one place: host resident sets and the CUDA allocator's levels.

The whole command's peaks (:mod:`qckpt.phases`), a load's accounting (:mod:`qckpt.load.meter`)
and an export rank's figures (:mod:`qckpt.export.stages`) all read these, and ``bench/`` too:

* ``peak_rss``: the host peak since the process started, VmHWM (the kernel's high-water mark of
  the resident set); not ``ru_maxrss``, which Linux carries over fork+exec, so a child started
  by a big parent would report the parent's peak. Nothing in qckpt resets it (a reset
  mid-command would make every whole-command peak a lie; ``bench/`` does, between its phases);
* ``rss``: the resident set now (psutil), ``rss_anon``: the anonymous part (RssAnon: what the
  process allocated, without the file pages that reading a checkpoint maps). Linux keeps no
  high-water mark of the anonymous part, so :class:`AnonPeak` samples it, inline at most every
  ``every_s`` or from a daemon thread;
* ``cuda_allocated``: the CUDA allocator's bytes allocated now and its high, read from its
  nested stats (``torch.cuda.memory_allocated`` flattens and sorts the whole stats dict).

Torch-free: ``cuda_allocated`` uses the torch the caller already imported.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def status_bytes(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes ({} where there is none)."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def peak_rss() -> int:
    """The process's peak resident set in bytes (VmHWM; never reset by qckpt)."""
    hwm = status_bytes("VmHWM").get("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def rss() -> int:
    """The resident set now in bytes (psutil); 0 where it cannot say (never fails a caller)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing or /proc unreadable
        return 0


def rss_anon() -> int:
    """Anonymous resident memory now (RssAnon): what the process allocated, without the file
    pages it maps (libraries, or a reader's mmap of the page cache); 0 where Linux cannot say."""
    return status_bytes("RssAnon").get("RssAnon", 0)


class AnonPeak:
    """The largest :func:`rss_anon` seen since it was made (``start``: the first sample).

    ``sample()`` reads it at most every ``every_s`` (``force``: now), for callers that sample
    at their own steps; :meth:`start_thread` samples from a daemon thread instead, every
    ``every_s``, until :meth:`stop`.
    """

    def __init__(self, every_s: float = 0.005) -> None:
        self.every = every_s
        self.start = rss_anon()
        self.peak = self.start
        self._last = 0.0  # the first sample() reads
        self._halt: threading.Event | None = None

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every:
            self._last = now
            self.peak = max(self.peak, rss_anon())

    def start_thread(self) -> None:
        halt = self._halt = threading.Event()

        def loop() -> None:
            while not halt.wait(self.every):
                self.sample(force=True)

        threading.Thread(target=loop, name="qckpt-anon-rss", daemon=True).start()

    def stop(self) -> None:
        if self._halt is not None:
            self._halt.set()
        self.sample(force=True)


def cuda_allocated(device: Any) -> tuple[int, int]:
    """(bytes allocated now, the allocator's high) on CUDA ``device``, from the allocator's
    nested stats: ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` each flatten and
    sort the whole stats dict in Python (~200 keys) to return one number."""
    torch = sys.modules["torch"]  # a CUDA device: its caller holds torch already
    stats = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {})
    alloc = stats.get("all", {})
    return int(alloc.get("current", 0)), int(alloc.get("peak", 0))


def unmap_large_allocations(threshold: int = MiB) -> bool:
    """glibc: serve every allocation of ``threshold`` bytes or more with its own ``mmap``, given
    back to the kernel when freed; False where that cannot be set. Process-wide, so only the
    export command asks for it (``WriteOptions``). Without it glibc raises its mmap threshold
    to the largest block freed (up to 32 MiB) and keeps freed tensors of a few MiB in
    per-thread arenas, and the RSS of a writer that reads and writes from several threads grows
    well past what it holds (measured: 88 MiB instead of 40 MiB for 32 MiB in flight)."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
