"""What the fast read engine asks of a load planner, written down as protocols.

The readers drive a DCP ``LoadPlanner``; the fast read engine (:mod:`qckpt.read.fast_read`)
calls a few more methods where the planner has them, to read a whole destination's items as one
run and to read ahead of a destination's scratch. The streaming planner of
:mod:`qckpt.load.planner` implements :class:`RunPlanner`; the engine never imports it (the load
sits above the read).

The ordering invariant these calls keep (see :mod:`qckpt.read.fast_read`): every call happens
on the calling thread; ``commit_tensor`` / ``commit_run`` in exactly the plan's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.planner import ReadItem


class ItemPlanner(Protocol):
    """DCP's item calls: where an item's data go, and that they are in place."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor: ...

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None: ...


class RunPlanner(ItemPlanner, Protocol):
    """The run calls the engine uses where a planner has them (else it goes item by item)."""

    def streams(self, fqn: str) -> bool:
        """Whether ``fqn`` goes through a scratch (at most ``max_inflight`` live at once)."""
        ...

    def resolve_run(self, fqn: str) -> torch.Tensor | None:
        """The contiguous buffer ``fqn``'s items fill (None: take the items one by one)."""
        ...

    def run_layout(self, fqn: str) -> tuple[torch.Size, torch.dtype, Any] | None:
        """(shape, dtype, device) of that buffer with nothing allocated (None: a plain one)."""
        ...

    def commit_run(self, items: Sequence[ReadItem]) -> None:
        """``commit_tensor`` of consecutive items of one destination, in plan order."""
        ...
