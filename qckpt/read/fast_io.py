"""The fast read's byte I/O: shared file descriptors, positional reads, pinned host buffers.

``Files``: the open descriptors of the files a read touches, shared by its threads (positional
reads only, so no seek state is shared); ``read_exact``: a buffer filled from a file position or
a one-line error for a short file; ``byte_view``: a host tensor's bytes as a writable buffer;
``PinnedPool``: the bounded pool of page-locked buffers the reads to a GPU go through.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from qckpt.errors import CheckpointError
from qckpt.storage.files import open_regular


class Files:
    """Open descriptors of the files read, shared by the threads (positional reads only)."""

    def __init__(self) -> None:
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()

    def fd(self, path: str) -> int:
        with self._lock:
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = open_regular(path)
            return f.fileno()

    def pread(self, path: str, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (short only at the end of the file)."""
        return os.pread(self.fd(path), n, pos)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def read_exact(fd: int, buf: memoryview, pos: int, path: str) -> None:
    """Fill ``buf`` with the bytes at ``pos``; a short file is a one-line CheckpointError."""
    done, n = 0, len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done:]], pos + done)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
        if got <= 0:
            raise CheckpointError(
                f"{path}: truncated: {n} bytes expected at offset {pos}, the file ends after {done}"
            )
        done += got


def byte_view(t: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous host tensor (the caller keeps ``t`` alive). Not
    ``numpy()``: that would mark a scratch's storage unresizable, and the planner frees a
    scratch by resizing its storage to 0."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class PinnedPool:
    """At most ``count`` host buffers of ``nbytes`` (pinned unless ``pin=False``), made when
    none is free, each reused once its last host-to-device copy is done (the event recorded
    after it). Of them, at most ``hold_cap`` at a time may be kept by read-ahead staging
    (``acquire(hold=True)`` / ``release(held=True)``), so the others always serve the reads
    that copy and give back at once: those never wait for a staging buffer's admission."""

    def __init__(self, nbytes: int, count: int, *, pin: bool = True) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._made = 0
        self._count = count
        self._holds = 0
        self._hold_cap = 0
        self._pin = pin
        self._cv = threading.Condition()

    def add_holds(self, n: int) -> None:
        """Room for ``n`` more buffers, all of them for staging."""
        with self._cv:
            self._count += n
            self._hold_cap += n
            self._cv.notify_all()

    def acquire(
        self, until: Callable[[], bool] | None = None, *, hold: bool = False
    ) -> torch.Tensor | None:
        """A buffer, waiting for one if all are taken (or, with ``hold``, if the staging's
        share is); None (no buffer) when ``until()`` turns true meanwhile (checked under the
        pool's lock, so a ``wake`` after it is not missed)."""
        with self._cv:
            while (not self._free and self._made >= self._count) or (
                hold and self._holds >= self._hold_cap
            ):
                if until is not None and until():
                    return None
                self._cv.wait()
            self._holds += hold
            if self._free:
                buf, ev = self._free.pop()
            else:
                self._made += 1
                buf, ev = None, None
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if ev is not None:
            ev.synchronize()  # its previous copy has left the buffer
        return buf

    def release(self, buf: torch.Tensor, event: Any, *, held: bool = False) -> None:
        with self._cv:
            self._holds -= held
            self._free.append((buf, event))
            # all: a staging waiter woken for a buffer may still be over its share
            self._cv.notify_all()

    def wake(self) -> None:
        """Every waiter looks at its ``until`` again."""
        with self._cv:
            self._cv.notify_all()
