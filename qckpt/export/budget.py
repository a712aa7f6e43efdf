"""The host bytes an export rank may hold in flight, and the holds that give them back.

Everything one rank's write holds on the host (a source tensor as read, every output made of
it, a GPU's pinned buffers) is taken from a :class:`HostBudget` before it exists and given back
when the last user lets go (:class:`Hold`); a failing write stops the budget so that no thread
waits on it forever (:class:`Stopped`). :class:`Refused` carries the source-weight guard's error
with its unit's place in plan order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from qckpt.errors import ExportError


class Stopped(Exception):
    """The pipeline was torn down while a thread waited (another stage failed)."""


class Refused(Exception):
    """A quantize job's source-weight guard refused a tensor: ``error`` (the one-line
    ExportError) and ``pos``, its unit's place in plan order. The job gave back its budget
    first, so the pipeline may go on with the units before it (:meth:`qckpt.export.stages.Pipeline._reap`)."""

    def __init__(self, pos: int, error: ExportError) -> None:
        super().__init__(str(error))
        self.pos = pos
        self.error = error


class HostBudget:
    """Bytes in flight on the host, at most ``cap`` (an item larger than ``cap`` runs alone)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0
        self.peak = 0
        self.stopped = False
        self.waiting = 0  # the bytes a blocked take asks for (0: none blocked)
        self._cv = threading.Condition()

    def take(self, n: int, skip: Callable[[], bool] | None = None) -> bool:
        """Wait until ``n`` bytes fit, and take them; False (nothing taken) when ``skip()``
        turns true meanwhile (looked at after each :meth:`give` or :meth:`poke`)."""
        with self._cv:
            while not self.stopped and self.used and self.used + n > self.cap:
                if skip is not None and skip():
                    return False
                self.waiting = n
                self._cv.wait()
                self.waiting = 0
            if self.stopped:
                raise Stopped()
            if skip is not None and skip():
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def give(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()

    def poke(self) -> None:
        """Wake a blocked :meth:`take` to look at its ``skip`` again."""
        with self._cv:
            self._cv.notify_all()

    def stuck(self) -> bool:
        """A take is blocked on bytes that are not free (only a give can free them)."""
        with self._cv:
            return bool(self.waiting) and self.used + self.waiting > self.cap

    def stop(self) -> None:
        with self._cv:
            self.stopped = True
            self._cv.notify_all()


class Hold:
    """A source tensor's host bytes, given back to the budget when its last user lets go (the
    quantize stage, and every write of a pass-through view of it)."""

    def __init__(self, budget: HostBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        self.refs = 1
        self._lock = threading.Lock()

    def ref(self) -> None:
        with self._lock:
            self.refs += 1

    def unref(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.budget.give(self.nbytes)
