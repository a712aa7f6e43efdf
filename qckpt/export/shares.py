"""Who writes what: an export plan's work items, and each rank's byte-balanced share of them.

The work is cut at source tensors, not at files: :func:`plan_items` lists the plan's items (one
per stored source tensor, with every output made of it, and one for the KV scales), and
:func:`assign_items` gives each rank one contiguous run of them whose bytes moved (read as
stored, plus written) are ``1 / world`` of the total, to within one item (whole files could miss
it by a whole ``export.max_shard_size`` file). The ranks share the shard files: the main rank
makes every file first (:func:`create_files`: header, full size), each rank opens the files its
items land in and writes its tensors at their planned offsets, and after every rank finished the
main rank checks that every slot of every file was written, once (:func:`check_written`).
:func:`lane_order` orders one rank's share so that several files are written at once; a
:class:`Run` is the bulk path's unit (adjacent small weights of one file, its :class:`Stack` s
of one shape each).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qckpt.errors import ExportError
from qckpt.export.plan import ExportPlan, OutputGroup
from qckpt.read.source import Entry
from qckpt.storage.safetensors import itemsize
from qckpt.storage.shards import create_shard_file


@dataclass
class Item:
    """One stored source tensor (or the KV scales, ``entry`` None) and the groups made of it."""

    entry: Entry | None
    groups: list[OutputGroup]
    file_of: list[int]
    host_bytes: int = 0  # the value as read: entry.dtype, not the stored dtype
    out_bytes: int = 0  # outputs that are new tensors (a pass-through of the same dtype is not)
    nbytes: int = 0  # every output written

    @property
    def cost(self) -> int:
        """What the ranks' shares are balanced on: the bytes it moves, read (as stored) plus
        written. Output bytes alone undercount the reads of a quantized tensor (two bytes read
        per byte written from BF16) against a pass-through's (one): a rank given the
        embeddings and lm_head of a model whose source lists them together read ~40% less
        than its peer for the same output bytes (bench.export's synthetic model)."""
        return (0 if self.entry is None else self.entry.nbytes) + self.nbytes

    @property
    def quantized_only(self) -> bool:
        """Every group a quantized linear: the item may go to the device (a pass-through
        would only travel there and back)."""
        return self.entry is not None and all(g.module is not None for g in self.groups)


@dataclass
class Stack:
    """Weights of one shape in a run, evenly spaced in its read buffer: one strided
    ``[k, rows, cols]`` view of it (the bytes from ``offset``, ``stride`` bytes apart)."""

    index: list[int]  # positions in the run's items
    shape: tuple[int, int]
    offset: int
    stride: int


@dataclass
class Run:
    """Consecutive items of the bulk path: quantized linears stored one after the other in one
    file, of one dtype (their shapes may differ: a MoE file lists each expert's down, gate and
    up projections by turns). Read with one positional read, checked and quantized a stack of
    one shape at a time (:class:`Stack`), written with one ``pwritev`` per file."""

    items: list[Item]
    dtype: torch.dtype
    stacks: list[Stack]
    host_bytes: int  # the stored bytes read
    out_bytes: int


_INDEX = re.compile(r"\.\d+\.")


def stacks(
    names: list[str], shapes: list[tuple[int, int]], offsets: list[int], itemsize: int
) -> list[Stack]:
    """A run's weights as stacks: per kind (shape, and name but for its indices: each expert's
    gate and up projections have one shape and alternate in a file), its weights cut into
    runs of equal spacing."""
    by_kind: dict[tuple, list[int]] = {}
    for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
        by_kind.setdefault((shape, _INDEX.sub(".#.", name)), []).append(i)
    out: list[Stack] = []
    for (shape, _), idx in by_kind.items():
        j = 0
        while j < len(idx):
            one = math.prod(shape) * itemsize
            stride = offsets[idx[j + 1]] - offsets[idx[j]] if j + 1 < len(idx) else one
            k = j + 1
            while k < len(idx) and offsets[idx[k]] - offsets[idx[k - 1]] == stride:
                k += 1
            out.append(Stack(idx[j:k], shape, offsets[idx[j]], stride if k > j + 1 else one))
            j = k
    return out


def unit_cost(u: Item | Run) -> int:
    return sum(it.cost for it in u.items) if isinstance(u, Run) else u.cost


def unit_file(u: Item | Run) -> int:
    """The shard file a unit's (first) output lands in."""
    return (u.items[0] if isinstance(u, Run) else u).file_of[0]


def aliases(g: OutputGroup) -> bool:
    """An unquantized entry written in its own dtype: the output is (a view of) the tensor read."""
    return g.module is None and g.entry is not None and g.specs[0].dtype == g.entry.dtype


def group_files(plan: ExportPlan) -> list[int]:
    """The shard file index of every group of ``plan`` (a group never straddles two files)."""
    out: list[int] = []
    file_i, left = 0, len(plan.shards.specs[0]) if plan.shards.specs else 0
    for g in plan.groups:
        while left == 0 and file_i + 1 < len(plan.shards.specs):
            file_i += 1
            left = len(plan.shards.specs[file_i])
        if len(g.specs) > left:
            raise AssertionError("a group straddles two shard files")
        out.append(file_i)
        left -= len(g.specs)
    return out


def split_balanced(sizes: Sequence[int], world: int) -> list[range]:
    """``world`` contiguous runs of ``sizes`` (in order) whose sums are each within
    ``max(sizes)`` of ``sum / world``: every cut is the item boundary nearest to ``r / world`` of
    the total (ties: the earlier one), so it misses its target by at most half an item. A run
    may be empty (fewer items than ranks). Integer arithmetic: the same on every rank."""
    scaled = [p * world for p in itertools.accumulate(sizes, initial=0)]
    total = scaled[-1] // world
    cuts = [0]
    for r in range(1, world):
        target = r * total
        i = bisect.bisect_left(scaled, target)
        if i == len(scaled) or (i > 0 and target - scaled[i - 1] <= scaled[i] - target):
            i -= 1
        cuts.append(max(i, cuts[-1]))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def lane_order(costs: Sequence[int], files: Sequence[int], lanes: int) -> list[int]:
    """The order in which one rank takes its units (indices into ``costs``): its share cut into
    ``lanes`` contiguous lanes of about equal bytes (:func:`split_balanced`), taken by turns,
    each time from the lane that has done the smallest part of its bytes (ties: the earlier
    lane), so the lanes progress alike and end together. ``files`` is each unit's (first)
    shard file. A buffered write holds its file's lock (the inode's) while it copies, so one
    file takes one copy at a time (measured on the H200: ~1.9 GB/s of FP8 into one tmpfs
    file); lanes in different files are written at once. One lane, or a share in one file:
    plan order. Each lane keeps plan order; the same on every call."""
    n = len(costs)
    lanes = min(lanes, len(set(files)))
    if lanes < 2:
        return list(range(n))
    cuts = split_balanced(costs, lanes)
    total = [sum(costs[i] for i in r) or 1 for r in cuts]
    nxt = [r.start for r in cuts]
    done = [0] * lanes
    order: list[int] = []
    while len(order) < n:
        lane = min(
            (j for j in range(lanes) if nxt[j] < cuts[j].stop), key=lambda j: done[j] / total[j]
        )
        order.append(nxt[lane])
        done[lane] += costs[nxt[lane]]
        nxt[lane] += 1
    return order


@dataclass
class Share:
    """One rank's part of an export: a contiguous run of the plan's items (source tensors, and
    the KV scales), written into whichever shard files they belong to (files are shared)."""

    rank: int
    items: list[Item]

    @property
    def cost(self) -> int:
        """The bytes this share reads and writes (what shares are balanced on)."""
        return sum(it.cost for it in self.items)

    def names(self) -> dict[int, list[str]]:
        """Per shard file this share writes into (in file order): the tensors it writes there."""
        out: dict[int, list[str]] = {}
        for it in self.items:
            for g, f in zip(it.groups, it.file_of, strict=True):
                names = out.get(f)
                if names is None:
                    names = out[f] = []
                names += [s.name for s in g.specs]
        return dict(sorted(out.items()))

    def files(self) -> list[int]:
        """The shard files (indices, in order) this share writes into."""
        return sorted({f for it in self.items for f in it.file_of})


def plan_items(plan: ExportPlan) -> list[Item]:
    """Every item of ``plan`` in plan order: one per stored source tensor (its groups, in
    whatever files they land) and one for the KV scales."""
    where = group_files(plan)
    items: list[Item] = []
    sizes: dict[str, int] = {}  # dtype code -> bytes per element: few codes, 50k lookups
    for g, f in zip(plan.groups, where, strict=True):
        src = g.entry.source if g.entry is not None else None
        if not items or src is None or items[-1].entry is not src:
            host = 0
            if src is not None:
                size = sizes.get(src.dtype)
                if size is None:
                    size = sizes[src.dtype] = itemsize(src.dtype)
                host = math.prod(src.shape) * size
            items.append(Item(src, [], [], host_bytes=host))
        it = items[-1]
        it.groups.append(g)
        it.file_of.append(f)
        n = g.nbytes
        it.nbytes += n
        if not aliases(g):
            it.out_bytes += n
    return items


def assign_items(plan: ExportPlan, world: int) -> list[Share]:
    """Every rank's share: the plan's items cut into ``world`` contiguous runs of about
    ``1 / world`` of the bytes read and written each (:attr:`Item.cost`,
    :func:`split_balanced`). Cut at tensors, not files: with whole files a rank's share could
    miss ``1 / world`` by up to a whole shard file (``export.max_shard_size``), which bounded
    two ranks at 1.92x one. Contiguous, so a rank reads and writes long runs of neighbouring
    bytes and touches few files. The same on every rank."""
    items = plan_items(plan)
    runs = split_balanced([it.cost for it in items], world)
    return [Share(rank=r, items=items[run.start : run.stop]) for r, run in enumerate(runs)]


def create_files(plan: ExportPlan, tmp: Path) -> None:
    """Every shard file of ``plan`` in ``tmp``, header written and size set
    (:func:`~qckpt.storage.shards.create_shard_file`): the main rank does this before
    any rank opens one, so that no rank can create, truncate or miss a file another writes to."""
    meta = plan.layout.shard_metadata()
    for fname, specs in zip(plan.shards.files, plan.shards.specs, strict=True):
        create_shard_file(tmp / fname, specs, meta)


def check_written(plan: ExportPlan, written: Sequence[dict[str, int]]) -> None:
    """The main rank's check, after every rank finished, that every shard file is whole:
    ``written`` is each rank's slots written per file (:meth:`ShardFile.written`); every slot
    must be written by exactly one rank. A rank checks only its own share when it closes its
    files, so a share missing from the assignment would otherwise leave a hole of zeros."""
    for fname, specs in zip(plan.shards.files, plan.shards.specs, strict=True):
        seen = 0
        for masks in written:
            mask = masks.get(fname, 0)
            if seen & mask:
                raise ExportError(f"{fname}: a tensor was written by two ranks")
            seen |= mask
        if seen != (1 << len(specs)) - 1:
            missing = [s.name for i, s in enumerate(specs) if not seen >> i & 1]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ExportError(f"{fname}: tensor {missing[0]}{more} was never written")
