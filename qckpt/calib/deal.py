"""Calibration batches dealt to the DP ranks as they come free, not split in advance.

Under pure data parallelism (``parallel.ep == tp == 1``) a rank's forwards need no other rank, so
the batches need not be split up front. A fixed split makes the slowest rank hold every other
one at the amax sync: on 2 x H200 the two ranks ran the same tokens in 6.35 and 6.65 s, and
anything one rank spends before its forwards (reading, warm-up) adds to the wait. Here every
rank holds the whole list (views of one tensor: the set is cut into the same global batches
whatever the layout, :mod:`qckpt.calib.data`) and takes the next index from a counter in the
world's store (one round trip per batch) until none is left; a rank that runs faster runs
more batches. Each rank's first batch is its own (index = its DP rank; the counter deals from
the DP size on), as under a fixed split: a rank that came late (a long read or warm-up) still
calibrates something, so a static (per-block) input amax is held on every rank, which the sync
requires, instead of missing on a rank that found no batch left. Each batch runs once, on one
rank, with the same shape as anywhere else, and the amax sync takes the max over the ranks,
which is exact whatever rank ran what: the calibration file is the one any other split, or one
process, writes.

Not under EP or TP: there each forward exchanges tokens or activations with other ranks, which
must run the same batches in step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from qckpt.parallel.deadline import Deadline, collective, deadline_of
from qckpt.parallel.mesh import group_device


class DealtBatches:
    """Iterating yields the batches this rank takes, each taken when the last one was sent.

    ``taken``: their indices in ``batches``, in order. ``position``: batches taken by all the
    ranks so far (what a progress bar on one rank can show of the whole run)."""

    def __init__(self, batches: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.batches = batches
        self.taken: list[int] = []
        self.position = 0
        self._store = dist.distributed_c10d._get_default_store()
        # a store that does not answer (its rank, the first, died or stopped) fails like a
        # collective: the deadline then has passed and the amax sync that follows says so at
        # once instead of waiting out its own timeout
        self._deadline = deadline_of(group) or Deadline(None)
        # a counter of its own for each dealing: the first DP rank draws its number from the
        # store and sends it to the others (one small collective, under the deadline)
        gen = torch.zeros(1, dtype=torch.int64)
        if dist.get_rank(group) == 0:
            gen[0] = self._store.add("qckpt/deal/generation", 1)
        gen = gen.to(group_device(group))
        root = dist.get_global_rank(group, 0)
        collective("agreeing on the batch counter", dist.broadcast, gen, src=root, group=group)
        self._key = f"qckpt/deal/{int(gen.item())}"
        self._rank, self._ranks = dist.get_rank(group), dist.get_world_size(group)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = len(self.batches)
        if self._rank < n:  # this rank's own first batch (see the module doc)
            self.position = max(self.position, self._rank + 1)
            self.taken.append(self._rank)
            yield self.batches[self._rank]
        while True:
            # the store's add is atomic: each index goes to exactly one rank
            took = self._deadline.run("taking the next batch", self._store.add, self._key, 1)
            i = self._ranks + int(took) - 1
            self.position = min(max(self.position, i + 1), n)
            if i >= n:
                return
            self.taken.append(i)
            yield self.batches[i]


def dealable(mesh, offload: bool) -> bool:
    """Whether this run's batches may be dealt as the ranks come free (see the module doc)."""
    return (
        mesh.dp > 1 and mesh.ep == 1 and mesh.tp == 1 and not offload and mesh.dp_group is not None
    )
