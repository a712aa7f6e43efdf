"""Where a command's time and memory go: named phases and the whole command's peaks.

The CLI calls :func:`begin` first thing; library code marks its steps with
``with phases.phase(READ): ...``, which costs nothing when no command is being recorded (tests,
``bench/``). A phase's time is exclusive: a phase opened inside another one is subtracted from
the outer one, so the phases never add up to more than the wall time. At a phase boundary the
GPU is synchronized (when CUDA is already in use), so queued kernels are charged to the phase
that launched them, not to the next one that waits.

``startup`` starts when the process (or, under torchrun, the launcher that started it) started,
read from ``/proc``, so it covers the interpreter and the imports a user waits for. Its parts
(``startup_part``: the recipe, torch, the command's own modules, the model's code) say where it
went without ending it; what no part names is the start-up's ``other``.

Peaks are never reset: the device peak is ``torch.cuda.max_memory_allocated`` read at report
time; the host peak is VmHWM (the kernel's high-water mark of the resident set); the peak of the
anonymous resident memory (``RssAnon``: what the process allocated, apart from the file pages
that reading a checkpoint maps) has no kernel high-water mark, so a daemon thread samples it.
The host figures are :mod:`qckpt.memory`'s, as a load's and an export's are.

Torch-free: importable by commands that never load torch.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from qckpt import memory

# the phase names every command reports in (a command reports those it went through)
STARTUP = "startup"  # process start -> the command's world: interpreter, imports, recipe, checks
WORLD = "world"  # process group and device set-up, and tearing it down
BUILD = "build"  # model built, sharded, allocated
QUANTIZE = "quantize"  # parameters quantized at build time
READ = "read"  # the checkpoint read into the model (the streaming quantize included)
DATA = "data"  # calibration batches made or read
FORWARD = "forward"  # calibration: quantizers in, weight amax, the forwards
SYNC = "sync"  # amax sync and barriers between ranks
ALGORITHM = "algorithm"  # calibrate.algorithm's pass after the amax sync (mse, gptq)
PLAN = "plan"  # an export's plan: metadata, calibration file, checks
WRITE = "write"  # files written (an export reads and quantizes as it writes)
REPORT = "report"  # reports rendered and written
NAMES = (
    STARTUP, WORLD, BUILD, QUANTIZE, READ, DATA, FORWARD, SYNC, ALGORITHM, PLAN, WRITE, REPORT
)  # fmt: skip

# the parts of the start-up (``startup_part``); they divide it, they do not end it
BEFORE_MAIN = "before_main"  # process (or launcher) start -> the CLI's main(): interpreter, CLI
RECIPE = "recipe"  # the recipe read and checked, outputs guarded, a relaunch decided
TORCH = "torch"  # import torch
QCKPT_MODULES = "qckpt_modules"  # the command's own modules (and the torch modules they import)
MODEL_CODE = "model_code"  # transformers and the model's modeling code
PART_NAMES = (BEFORE_MAIN, RECIPE, TORCH, QCKPT_MODULES, MODEL_CODE)

ANON_SAMPLE_S = 0.05
F = TypeVar("F", bound=Callable[..., Any])

_imported_at = time.perf_counter()
_lock = threading.Lock()
_current: Recorder | None = None


# ``--nproc-per-node`` relaunches the command under torchrun: the ranks count from the start of
# the command the user typed, which the relauncher passes on here (seconds since boot)
STARTED_ENV = "QCKPT_STARTED_AT"


def process_started_at(pid: int | str = "self") -> float | None:
    """When process ``pid`` started, in seconds since boot (Linux; None where /proc cannot say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # field 22 is starttime in clock ticks since boot; the command name (field 2) may hold
        # spaces and parentheses, so count from its closing one
        return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _proc_start_age(pid: int | str = "self") -> float | None:
    start = process_started_at(pid)
    return None if start is None else time.clock_gettime(time.CLOCK_BOOTTIME) - start


def _started_age() -> tuple[float, str]:
    """How long ago what the user started began, and what that was."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        try:
            start = float(os.environ[STARTED_ENV])
            return time.clock_gettime(
                time.CLOCK_BOOTTIME
            ) - start, "the relaunching command's start"
        except (KeyError, ValueError, AttributeError):
            pass
        # a torchrun worker: the user waited for torchrun (our parent) too
        age = _proc_start_age(os.getppid())
        if age is not None:
            return age, "the torchrun launcher's start"
    age = _proc_start_age()
    if age is not None:
        return age, "the process start"
    return time.perf_counter() - _imported_at, "qckpt's import (no /proc here)"


def _cuda() -> Any:
    """torch.cuda when this process already uses CUDA; never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a half-imported torch: no device figures
        return None


def _sync_device() -> None:
    cuda = _cuda()
    if cuda is not None:
        cuda.synchronize()


class Recorder:
    """One command's phases (exclusive seconds per name) and its memory peaks."""

    def __init__(self, *, sample_anon_s: float | None = ANON_SAMPLE_S) -> None:
        self.t0 = time.perf_counter()
        self.age_at_begin, self.started_at = _started_age()
        self.seconds: dict[str, float] = {STARTUP: self.age_at_begin}
        # the open phases: [name, perf_counter at entry, seconds spent in nested phases]; the
        # start-up is open from the beginning and ends where the first other phase begins
        self._stack: list[list[Any]] = [[STARTUP, self.t0, 0.0]]
        self._in_startup = True
        # seconds per start-up part; the first is everything before the CLI's main() began
        self.parts: dict[str, float] = {BEFORE_MAIN: self.age_at_begin}
        self._in_part = False
        # the highest resident set a meter sampled (the load's): VmHWM is updated lazily by
        # the kernel (not when a thread's arena gives pages back with MADV_DONTNEED), so it can
        # read below a value seen earlier; the whole command's peak is never below a window's
        self.rss_seen = 0
        self.sampler = memory.AnonPeak(sample_anon_s) if sample_anon_s else None
        if self.sampler is not None:
            self.sampler.start_thread()

    def enter(self, name: str) -> None:
        _sync_device()
        if self._in_startup and name != STARTUP and len(self._stack) == 1:
            self._in_startup = False
            self.exit()  # the start-up is over: the command's work begins
        self._stack.append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        _sync_device()
        name, t_in, nested = self._stack.pop()
        took = time.perf_counter() - t_in
        self.seconds[name] = self.seconds.get(name, 0.0) + max(took - nested, 0.0)
        if self._stack:
            self._stack[-1][2] += took

    def startup_parts(self) -> dict[str, float]:
        """Seconds per start-up part, and ``other``: the start-up no part names (up to now
        while the start-up is still open)."""
        out = {k: round(v, 4) for k, v in self.parts.items()}
        startup = self.phases()[STARTUP]
        out["other"] = round(max(startup - sum(self.parts.values()), 0.0), 4)
        return out

    def total(self) -> float:
        """Seconds from the start (see ``started_at``) until now."""
        return self.age_at_begin + time.perf_counter() - self.t0

    def phases(self) -> dict[str, float]:
        """Seconds per phase, ``other`` (time in no phase) and ``total``; phases still open
        count up to now."""
        now = time.perf_counter()
        secs = dict(self.seconds)
        inner = 0.0
        for name, t_in, nested in reversed(self._stack):
            took = now - t_in
            secs[name] = secs.get(name, 0.0) + max(took - nested - inner, 0.0)
            inner = took
        total = self.total()
        secs = {k: round(v, 4) for k, v in secs.items()}
        secs["other"] = round(max(total - sum(secs.values()), 0.0), 4)
        secs["total"] = round(total, 4)
        return secs

    def peaks(self) -> dict[str, Any]:
        """The whole command's peaks so far (nothing here is ever reset)."""
        out: dict[str, Any] = {"host_peak_rss_bytes": max(memory.peak_rss(), self.rss_seen)}
        if self.sampler is not None:
            self.sampler.sample(force=True)
            out["host_peak_anon_bytes"] = self.sampler.peak
            out["host_anon_sampled_every_s"] = self.sampler.every
        cuda = _cuda()
        if cuda is not None:
            dev = cuda.current_device()
            out["device"] = f"cuda:{dev}"
            out["device_peak_bytes"] = int(cuda.max_memory_allocated(dev))
            out["device_peak_reserved_bytes"] = int(cuda.max_memory_reserved(dev))
            # what the command holds at its report (for load: the loaded model)
            out["device_allocated_bytes"] = int(cuda.memory_allocated(dev))
        else:
            out["device"] = "cpu"
            out["device_peak_bytes"] = None
        out["measured_by"] = (
            "whole command, never reset: torch.cuda.max_memory_allocated / max_memory_reserved; "
            "host VmHWM; RssAnon (anonymous, no page cache) sampled by a thread"
        )
        return out

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


def begin(*, sample_anon_s: float | None = ANON_SAMPLE_S) -> Recorder:
    """Start recording this process's command (the CLI calls it first thing)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = Recorder(sample_anon_s=sample_anon_s)
        return _current


def end() -> None:
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = None


def current() -> Recorder | None:
    return _current


def note_host_rss(nbytes: int) -> None:
    """A resident-set size some meter sampled: the whole command's host peak holds it."""
    rec = _current
    if rec is not None and nbytes > rec.rss_seen:
        rec.rss_seen = int(nbytes)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the time inside to ``name`` (one of ``NAMES``); a no-op when nothing records."""
    rec = _current
    if rec is None:
        yield
        return
    rec.enter(name)
    try:
        yield
    finally:
        rec.exit()


@contextmanager
def startup_part(name: str) -> Iterator[None]:
    """Charge the time inside to start-up part ``name`` (one of ``PART_NAMES``) while the
    start-up is open; it stays start-up time (the phases are unchanged). Parts do not nest: an
    inner one is counted in the outer one."""
    rec = _current
    if rec is None or not rec._in_startup or rec._in_part:
        yield
        return
    rec._in_part = True
    t0 = time.perf_counter()
    try:
        yield
    finally:
        rec.parts[name] = rec.parts.get(name, 0.0) + time.perf_counter() - t0
        rec._in_part = False


def summary() -> dict[str, Any]:
    """``{"phases": {...}, "startup_parts": {...}, "compiled_at_import": {...}, "peaks": {...}}``
    for a command's ``--json``; {} when nothing records. ``compiled_at_import``: the modules this
    process imported from source with no bytecode cache (``qckpt.bytecode``)."""
    rec = _current
    if rec is None:
        return {}
    from qckpt.bytecode import compiled_at_import

    return {
        "phases": rec.phases(),
        "startup_parts": rec.startup_parts(),
        "compiled_at_import": compiled_at_import(),
        "peaks": rec.peaks(),
    }


def timed(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function is charged to phase ``name``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block (as it was after). A load or an export makes
    a few objects per tensor that live until it ends, so a 20k-tensor command set off several
    full collections, each a walk over the whole heap (the model, torch, transformers: 0.2-0.5 s
    apiece): a cost per tensor that grew with the number of tensors. Cycles made meanwhile are
    collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
