"""One deadline for all the collectives of a command.

Every process group waits at most ``parallel.timeout_s`` in one collective. That alone is not
"a dead peer makes the survivors fail within the timeout": a command runs several collectives,
and a survivor whose forward timed out in one would then wait a full timeout again in the amax
sync (which it must still join to tell the others), and again in the report's collective. A
SIGSTOPped peer cost about 2x the timeout, more in longer commands.

So the groups of a mesh share one :class:`Deadline`. Each collective runs through it: while no
collective has failed it waits as its group allows (the group timeout, the deadline's whole
budget); once one has failed or timed out, the deadline has passed, and every later collective
of the command raises at once, without touching the wire, with the first failure's message.
The survivor thus fails about ``timeout_s`` after it started waiting for the dead peer.

Why the budget is not counted from the start of the command: the command's own work (loading a
checkpoint, hours of calibration) is not waiting for a peer, and a deadline that counted it
would fail healthy long runs or force a timeout too large to ever catch a dead rank.

Groups are looked up by identity (:func:`collective`), so modules that only hold a group (the
expert and tensor-parallel hooks) need no mesh; a group that no mesh registered (tests that make
their own) runs its collectives unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from qckpt.errors import PeerError, QckptError

T = TypeVar("T")

# id(group) -> (group, deadline): the group is kept so that its id cannot be reused meanwhile
_REGISTRY: dict[int, tuple[Any, Deadline]] = {}


class Deadline:
    """The shared budget of one command's collectives; see the module doc."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.failure: str | None = None  # the first collective failure's message

    @property
    def passed(self) -> bool:
        return self.failure is not None

    def run(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        error: type[QckptError] = PeerError,
        **kwargs: Any,
    ) -> T:
        """``fn(*args, **kwargs)``, a collective (or several) over ``what``; any failure is
        ``error`` with one line, and marks the deadline as passed for every later collective."""
        if self.failure is not None:
            raise error(f"{what}: not attempted, an earlier collective failed: {self.failure}")
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError subclasses
            lines = str(exc).strip().splitlines()
            first = lines[0] if lines else type(exc).__name__
            limit = "" if self.timeout_s is None else f"parallel.timeout_s={self.timeout_s:g}; "
            self.failure = f"{what} failed: a rank died or timed out ({limit}{first[:300]})"
            raise error(self.failure) from None


def register(groups: Iterable[Any], deadline: Deadline) -> None:
    """Make ``deadline`` the one of every group in ``groups`` (``None`` entries are skipped)."""
    for g in groups:
        if g is not None:
            _REGISTRY[id(g)] = (g, deadline)


def unregister(groups: Iterable[Any]) -> None:
    for g in groups:
        if g is not None:
            _REGISTRY.pop(id(g), None)


def deadline_of(group: Any) -> Deadline | None:
    entry = _REGISTRY.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def collective(
    what: str,
    fn: Callable[..., T],
    *args: Any,
    error: type[QckptError] = PeerError,
    **kwargs: Any,
) -> T:
    """Run the collective ``fn(*args, **kwargs)`` under its ``group=``'s deadline."""
    dl = deadline_of(kwargs.get("group"))
    if dl is None:
        return fn(*args, **kwargs)
    return dl.run(what, fn, *args, error=error, **kwargs)
