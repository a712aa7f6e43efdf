"""The ranks of a distributed export agreeing on one temp dir, on success, and on cleanup.

Every rank plans the export alike (``plan_export`` is deterministic) and takes its share of
the work from :func:`~qckpt.export.shares.assign_items`: a contiguous run of the
plan's source tensors holding ``1 / world`` of the bytes read and written (to within one
tensor), not whole files, so the ranks share the shard files. Every rank takes its share, and
the others make the layouts (headers, offsets) of the files they write into, before the main
rank makes the temp dir beside the target and every shard file in it (header written, full size
set) and tells the others the dir's name (:meth:`Team.begin`); each rank then opens the files
its tensors land in, writes them at their planned offsets (disjoint byte ranges: fine on one
node and on a shared filesystem) and fsyncs what it wrote, and then:

1. **agree**: one ``all_gather_object`` of (ok, message, stats, slots written per file). A rank
   that failed still joins it, so that every rank learns who failed and why; a rank that died
   makes it fail (gloo sees the closed connection, or the group timeout passes) and, through the
   mesh's :class:`~qckpt.parallel.deadline.Deadline`, every later collective fails at once.
2. the main rank checks that every slot of every file was written by exactly one rank
   (:func:`~qckpt.export.shares.check_written`), writes the index, config, layout
   and model files and the marker, checks the whole dir and renames it into place
   (``AtomicDir.commit``);
3. **outcome**: one broadcast from the main rank, so that no rank exits 0 for an export that
   its last step refused.

A rank that fails while writing also drops a ``.qckpt-failed-rank-N`` file in the temp dir: the
others look for one before each source tensor and stop early, instead of writing their whole
share of a doomed export first.

Cleanup: the main rank removes the temp dir on any failure (``AtomicDir.abort``); another rank
removes it (:func:`qckpt.atomic.discard_temp`: renamed to a temp of its own first, so it can
never race the main rank's commit) only when the agreement itself failed, i.e. when the main
rank may be the one that died.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qckpt import phases
from qckpt.atomic import AtomicDir, discard_temp
from qckpt.errors import ExportError, PeerError
from qckpt.parallel.deadline import collective

FAILED_PREFIX = ".qckpt-failed-rank-"


class Team:
    """The ranks of one export: ``mesh`` is None (or of size 1) for a one-process export."""

    def __init__(self, mesh: Any = None) -> None:
        self.world = 1 if mesh is None else mesh.world_size
        self.rank = 0 if mesh is None else mesh.rank
        self.group = None if mesh is None else mesh.world_group
        self.tmp: Path | None = None
        self._next_look = 0.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        with phases.phase(phases.SYNC):  # waiting for the other ranks, as the report says
            return collective(f"export: {what}", fn, *args, group=self.group, **kw)

    def begin(self, out: AtomicDir, prepare: Callable[[Path], None] | None = None) -> Path:
        """One temp dir for every rank: the main rank makes it and runs ``prepare(tmp)`` in it
        (the shard files every rank then opens), the others learn its name after that (or that
        it failed, so that nobody waits for a dir that will never come). A failed ``prepare``
        removes the dir."""
        if self.world > 1:
            import torch.distributed as dist
        box: list[str | None] = [None]
        try:
            if self.is_main:
                tmp = out.begin()
                try:
                    if prepare is not None:
                        prepare(tmp)
                except BaseException:
                    out.abort()
                    raise
                box[0] = str(tmp)
        finally:
            if self.world > 1:
                self._run("sharing the temp dir", dist.broadcast_object_list, box, src=0)
        if box[0] is None:
            raise ExportError(
                f"export.output: the main rank could not create a temp dir (or its shard files) "
                f"beside {out.target}"
            )
        self.tmp = Path(box[0])
        return self.tmp

    # -- failures while writing ------------------------------------------------------------
    def mark_failed(self, message: str) -> None:
        """Tell the other ranks, through the temp dir, that this one failed."""
        if self.world == 1 or self.tmp is None:
            return
        try:
            (self.tmp / f"{FAILED_PREFIX}{self.rank}").write_text(message)
        except OSError:
            pass  # the agreement still tells them

    def check_peers(self) -> None:
        """Raise when another rank has marked itself failed (looked up at most every 0.2 s)."""
        if self.world == 1 or self.tmp is None:
            return
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + 0.2
        for p in sorted(self.tmp.glob(f"{FAILED_PREFIX}*")):
            rank = p.name[len(FAILED_PREFIX) :]
            if rank != str(self.rank):
                raise ExportError(f"export stopped: rank {rank} failed: {_read(p)}")

    # -- the agreement ----------------------------------------------------------------------
    def agree(
        self, ok: bool, message: str, stats: dict, written: dict[str, int] | None = None
    ) -> list[dict]:
        """Every rank's (ok, message, stats, written: the slots it wrote per shard file, for
        the main rank's whole-file check); raises ExportError naming the first rank that
        failed (PeerError when a rank is gone)."""
        mine = {
            "rank": self.rank,
            "ok": ok,
            "message": message,
            "stats": stats,
            "written": written or {},
        }
        if self.world == 1:
            return [mine]
        import torch.distributed as dist

        got: list[Any] = [None] * self.world
        self._run("waiting for every rank's shards", dist.all_gather_object, got, mine)
        for r in got:
            if not r["ok"]:
                raise ExportError(f"export failed on rank {r['rank']}: {r['message']}")
        return got

    def outcome(self, ok: bool, message: str) -> None:
        """The main rank's last word (after its commit or failure) to every other rank."""
        if self.world == 1:
            return
        import torch.distributed as dist

        box = [(ok, message)]
        self._run("the main rank's outcome", dist.broadcast_object_list, box, src=0)
        if not self.is_main and not box[0][0]:
            raise ExportError(f"export failed on rank 0: {box[0][1]}")

    def discard(self) -> None:
        """A rank other than the main one removes the temp dir (see the module doc)."""
        if not self.is_main and self.tmp is not None:
            discard_temp(self.tmp)


def _read(p: Path) -> str:
    try:
        return " ".join(p.read_text().split())[:500] or "no message"
    except OSError:
        return "no message"


__all__ = ["FAILED_PREFIX", "PeerError", "Team"]
