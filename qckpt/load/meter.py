"""A load's memory accounting, sampled at every committed item (no sampling thread).

On CUDA ``transient`` is measured per destination window: the peak inside it minus what was
allocated when it opened, minus the kept outputs allocated inside it. On CPU it is the planner's
own scratch accounting. The process figures (host RSS, the CUDA allocator's levels) are read
through :mod:`qckpt.memory`, as the export and the whole command's phases read them.
"""

from __future__ import annotations

import time

import torch

from qckpt import memory, phases

RSS_EVERY_S = 0.005


class MemoryMeter:
    """Memory accounting of one load, sampled at every committed item (no sampling thread).

    On CUDA ``transient`` is measured per destination window: the peak inside it minus what was
    allocated when it opened, minus the kept outputs allocated inside it. The allocator's peak
    counter is never reset (it is the whole command's, ``qckpt.phases``), so a window's peak is
    exact when the window raised it (``max_memory_allocated`` grew), else it is the largest
    allocation sampled inside the window, a lower bound under the command's earlier high;
    ``measured_by`` says when a figure is such a bound. On CPU ``transient`` is the planner's own
    scratch accounting; the host RSS (psutil) is sampled alongside in both cases.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.t0 = time.perf_counter()
        self.base_rss = memory.rss()
        self.peak_rss = self.base_rss
        self._rss_at, self._rss_last = time.perf_counter(), self.base_rss
        self._dev_at, self._dev_last = self._rss_at, 0
        self.base_alloc = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        # the command's high before this load (never reset: see the class doc)
        self.high_at_start = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        self.scratch = 0  # live scratch bytes (accounting)
        self.peak_scratch = 0
        self.outputs = 0  # bytes of kept outputs (FP32 main params)
        self.device_transient = 0
        self.transient_bound = 0  # the most a window's transient can be (== measured when exact)
        self._sampled_peak = self.base_alloc
        # (allocated at open, outputs at open, the allocator's high at open, sampled max inside)
        self._win: list[int] | None = None
        self.samples: list[tuple[float, int, int]] = []
        self.sample()

    @property
    def device_peak(self) -> int:
        """The load's device peak: exact when the load raised the command's high, else the
        largest allocation sampled during it."""
        if not self.cuda:
            return self._sampled_peak
        high = torch.cuda.max_memory_allocated(self.device)
        return high if high > self.high_at_start else self._sampled_peak

    @property
    def measured_by(self) -> str:
        if not self.cuda:
            return "planner scratch accounting + host RSS (psutil) sampled at read items, at most every 5 ms"
        how = (
            "cuda allocator high (torch.cuda.max_memory_allocated, never reset) + host RSS (psutil)"
        )
        if torch.cuda.max_memory_allocated(self.device) <= self.high_at_start:
            how += "; the load stayed under the command's earlier high: peak sampled per item"
        if self.transient_bound > self.device_transient:
            how += (
                f"; transient sampled per item (a lower bound; at most {self.transient_bound} "
                "bytes)"
            )
        return how

    def add_scratch(self, n: int) -> None:
        self.scratch += n
        self.peak_scratch = max(self.peak_scratch, self.scratch)

    def sub_scratch(self, n: int) -> None:
        self.scratch -= n

    def add_output(self, n: int) -> None:
        self.outputs += n

    def open_window(self) -> None:
        if self.cuda and self._win is None:
            now, high = memory.cuda_allocated(self.device)
            # scratches still live from before (the fast reader keeps up to max_inflight) are
            # part of this window's transient, not of its baseline
            self._win = [now - self.scratch, self.outputs, high, now]

    def close_window(self) -> None:
        if self.cuda and self._win is not None:
            at_open, out_open, high_open, sampled = self._win
            now, high = memory.cuda_allocated(self.device)
            kept = self.outputs - out_open
            # raised the high: exact; else somewhere between what was sampled and the old high
            peak = high if high > high_open else max(sampled, now)
            self._sampled_peak = max(self._sampled_peak, peak)
            self.device_transient = max(self.device_transient, peak - at_open - kept)
            self.transient_bound = max(
                self.transient_bound, (high if high > high_open else high_open) - at_open - kept
            )
            self._win = None

    def sample(self, force: bool = False, fresh: bool = False) -> None:
        # the host RSS costs a /proc read (0.1-0.3 ms): at most once per RSS_EVERY_S, or a
        # load of 20k small items would spend seconds on it. So does the device level:
        # torch.cuda.memory_allocated builds and flattens the allocator's whole stats dict
        # (tens of us, more under the readers' GIL traffic), so it is read at most as often,
        # and always when ``fresh`` (a scratch just allocated) or ``force``
        t = time.perf_counter()
        if force or t - self._rss_at >= RSS_EVERY_S or not self.samples:
            self._rss_at, self._rss_last = t, memory.rss()
            self.peak_rss = max(self.peak_rss, self._rss_last)
            phases.note_host_rss(self._rss_last)
        rss = self._rss_last
        if self.cuda:
            if force or fresh or t - self._dev_at >= RSS_EVERY_S or not self.samples:
                self._dev_at, self._dev_last = t, memory.cuda_allocated(self.device)[0]
            now = self._dev_last
            self._sampled_peak = max(self._sampled_peak, now)
            if self._win is not None:
                self._win[3] = max(self._win[3], now)
            level = now - self.base_alloc - self.outputs
        else:
            level = self.scratch
        self.samples.append((time.perf_counter() - self.t0, int(level), rss))

    @property
    def transient(self) -> int:
        return self.device_transient if self.cuda else self.peak_scratch
