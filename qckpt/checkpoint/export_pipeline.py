"""Writing an export plan's shard files: reads, quantization and writes overlapped.

**Who writes what.** The work is cut at source tensors, not at files: :func:`plan_items` lists
the plan's items (one per stored source tensor, with every output made of it, and one for the
KV scales), and :func:`assign_items` gives each rank one contiguous run of them whose bytes
moved (read as stored, plus written) are ``1 / world`` of the total, to within one item (whole
files could miss it by a whole ``export.max_shard_size`` file). The ranks share the shard
files: the main rank makes every file first (:func:`create_files`: header, full size), each
rank opens the files its items land in and writes its tensors at their planned offsets, and
after every rank finished the main rank checks that every slot of every file was written, once
(:func:`check_written`). One process is the same with one share holding every item.

One rank writes its share (:func:`write_share`) in three stages:

* **read**: a feeder thread walks this rank's source tensors in lane order (:func:`lane_order`:
  the share cut into ``lanes`` contiguous lanes, taken by turns, each in plan order, so that
  that many shard files are written at once); for each it first takes its host bytes from a
  :class:`HostBudget` (the stored value plus every output made from it), then hands the read
  to a small pool (``readers`` threads; one for a DCP source, whose reader is not thread-safe).
  Results are consumed in that order.
* **quantize**: a pool of threads (one on the CPU; on a GPU four, each on its own CUDA stream)
  moves each source tensor to ``device`` (a GPU when there is one: one host-to-device copy,
  after which its host bytes are given back), checks it against its calibrated amax (the
  source-weight guard) and quantizes it with the layout. On a GPU consecutive small items are
  one job (:meth:`_Pipeline._batch`, up to ``BATCH_BYTES``), nothing waits for the device per
  tensor (the guard's verdicts stay on the device), and the job's outputs and verdicts come
  back into one pinned host block with one wait for the stream; then a refused tensor raises
  the guard's one-line error, or the outputs go to the writers.
* **write**: a pool of ``writers`` threads writes each output at its planned offset in its
  file (:class:`~qckpt.checkpoint.safetensors_io.ShardFile`, ``pwrite``), so several files (and
  several tensors of one file) are written at once; each write gives its bytes back. A buffered
  write holds its file's lock while it copies, so the writes into one file take turns: the
  lanes are what lets one rank write several files at once.

**A refused tensor** (the source-weight guard) stops the feeder at it (no later unit in plan
order is started) while the units before it still run, so the error raised is the first
refused tensor in plan order whatever order the lanes and the quantize threads took them in.

**The bulk path** (:class:`_Run`): consecutive items that are each one quantized linear
whose stored bytes are its value, stored one after the other in one safetensors file, of one
dtype (the experts of a MoE layer: 3 MB each in Qwen3-30B-A3B, ~18k of them) go as one unit up
to ``RUN_BYTES``: one positional read of their whole byte range (pinned on a GPU), one
host-to-device copy, then per stack of one kind (:class:`_Stack`: one shape and projection,
evenly spaced, a strided ``[k, rows, cols]`` view) one source-weight guard reduction and one
quantize (:meth:`~qckpt.checkpoint.export_layouts.Layout.quantize_stack`, the per-item path's
element-wise math, so the same bytes), one copy of the quantized weights and verdicts back with
one wait, the first refused weight's one-line error as alone, and one ``pwritev`` per shard
file of the outputs, which lie next to each other there. The per-item Python (~3.5 ms per
tensor on the GPU, measured) is paid per run. Layouts whose weights do not stack
(:meth:`~qckpt.checkpoint.export_layouts.Layout.stacks`: per-block scales, NVFP4, ModelOpt's
per-tensor FP8), DCP sources, split fused tensors and everything else take the per-item path;
``QCKPT_EXPORT_BULK=0`` turns runs off (the A/B of the benchmarks).

Host memory: everything in flight is counted against the budget, ``2 x`` the largest source
tensor's host bytes (plus ``RUN_SLACK_BYTES`` when there are runs); one item larger than the budget still runs, alone. On a GPU the pinned
buffers are in it too: a read for the device at the power of two torch pins it at, a job's
block of outputs as its outputs' bytes. Peak anonymous host memory is then at most the budget
plus the quantize kernels' chunk temporaries (a few tens of MiB) over what the process held
before: the ``2 x largest + 256 MiB`` bound of the export.
The files are the same whatever the device, the thread counts or the order writes land in:
each tensor has one planned place, and GPU and CPU quantization are bit-identical.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import contextlib
import contextvars
import itertools
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from qckpt import phases
from qckpt.checkpoint.export_layouts import (
    CHUNK_ELEMS,
    check_source_stack,
    check_source_weight,
    refuse_source_weight,
)
from qckpt.checkpoint.export_plan import ExportPlan, _Group
from qckpt.checkpoint.safetensors_io import ShardFile, create_shard_file, itemsize
from qckpt.checkpoint.sources import Entry
from qckpt.errors import ExportError

ProgressFn = Callable[[int, int, str], None]
MiB = 2**20
# what the export may hold on the host beyond its tensors in flight (kernel chunk temporaries,
# allocator slack): the "+ 256 MiB" of the documented bound
HOST_SLACK_BYTES = 256 * MiB
# a GPU quantize job takes consecutive small items up to this many bytes (read plus written)
# together: a 3 MB expert weight cost ~5 ms of launches, copies and waits on its own, so their
# Python work, launches and the one wait for their outputs are paid per batch
BATCH_BYTES = 32 * MiB
# offsets of the outputs in a batch's pinned host block: every dtype's alignment
_ALIGN = 64
# the bulk path (:class:`_Run`): adjacent small weights read, checked, quantized and written
# together, up to this many bytes (read plus written) in one run
RUN_BYTES = 64 * MiB
# the host budget's room for runs beyond 2 x the largest source tensor: a model of small
# tensors (the tiny 48-layer MoE: 256 KiB the largest) would otherwise run in runs of a few
# weights; taken from the export's 256 MiB of slack (HOST_SLACK_BYTES)
RUN_SLACK_BYTES = 32 * MiB
# a run quantizes as many of its weights at a time as fit in this many elements (the float32
# temporaries): on the CPU fp8_quantize's chunk, on a GPU more (its memory is not the bound)
RUN_CHUNK_ELEMS_GPU = 1 << 26
# shard files one rank writes at once (lane_order): a buffered write holds its file's lock while
# it copies, so one file takes one copy at a time; two processes writing two files were 2.32x
# one writing one (H200, tmpfs)
LANES = 2


# --------------------------------------------------------------------------------------------
# host memory figures (Linux /proc; 0 where unavailable)


def peak_rss() -> int:
    """The process's peak RSS since it started (VmHWM; never reset by qckpt)."""
    return phases.host_peak_rss()


def rss_anon() -> int:
    """Anonymous resident memory now (RssAnon): what the process allocated, without the file
    pages it maps (libraries, or a reader's mmap of the page cache); 0 where Linux cannot say."""
    return phases.status_kib("RssAnon").get("RssAnon", 0)


def unmap_large_allocations(threshold: int = MiB) -> bool:
    """glibc: serve every allocation of ``threshold`` bytes or more with its own ``mmap``, given
    back to the kernel when freed; False where that cannot be set. Process-wide, so only the
    export command asks for it (:class:`WriteOptions`). Without it glibc raises its mmap
    threshold to the largest block freed (up to 32 MiB) and keeps freed tensors of a few MiB in
    per-thread arenas, and the RSS of a writer that reads and writes from several threads grows
    well past what it holds (measured: 88 MiB instead of 40 MiB for 32 MiB in flight)."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class AnonSampler:
    """The largest :func:`rss_anon` seen, sampled at most every ``every_s`` (Linux has no
    high-water mark for anonymous memory alone)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s = every_s
        self.start = rss_anon()
        self.peak = self.start
        self._last = 0.0

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self._last = now
            self.peak = max(self.peak, rss_anon())


# --------------------------------------------------------------------------------------------
# the work items


@dataclass
class _Item:
    """One stored source tensor (or the KV scales, ``entry`` None) and the groups made of it."""

    entry: Entry | None
    groups: list[_Group]
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
class _Stack:
    """Weights of one shape in a run, evenly spaced in its read buffer: one strided
    ``[k, rows, cols]`` view of it (the bytes from ``offset``, ``stride`` bytes apart)."""

    index: list[int]  # positions in the run's items
    shape: tuple[int, int]
    offset: int
    stride: int


@dataclass
class _Run:
    """Consecutive items of the bulk path: quantized linears stored one after the other in one
    file, of one dtype (their shapes may differ: a MoE file lists each expert's down, gate and
    up projections by turns). Read with one positional read, checked and quantized a stack of
    one shape at a time (:class:`_Stack`), written with one ``pwritev`` per file."""

    items: list[_Item]
    dtype: torch.dtype
    stacks: list[_Stack]
    host_bytes: int  # the stored bytes read
    out_bytes: int


_INDEX = re.compile(r"\.\d+\.")


def _stacks(
    names: list[str], shapes: list[tuple[int, int]], offsets: list[int], itemsize: int
) -> list[_Stack]:
    """A run's weights as stacks: per kind (shape, and name but for its indices: each expert's
    gate and up projections have one shape and alternate in a file), its weights cut into
    runs of equal spacing."""
    by_kind: dict[tuple, list[int]] = {}
    for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
        by_kind.setdefault((shape, _INDEX.sub(".#.", name)), []).append(i)
    out: list[_Stack] = []
    for (shape, _), idx in by_kind.items():
        j = 0
        while j < len(idx):
            one = math.prod(shape) * itemsize
            stride = offsets[idx[j + 1]] - offsets[idx[j]] if j + 1 < len(idx) else one
            k = j + 1
            while k < len(idx) and offsets[idx[k]] - offsets[idx[k - 1]] == stride:
                k += 1
            out.append(_Stack(idx[j:k], shape, offsets[idx[j]], stride if k > j + 1 else one))
            j = k
    return out


def _unit_cost(u: _Item | _Run) -> int:
    return sum(it.cost for it in u.items) if isinstance(u, _Run) else u.cost


def _unit_file(u: _Item | _Run) -> int:
    """The shard file a unit's (first) output lands in."""
    return (u.items[0] if isinstance(u, _Run) else u).file_of[0]


def _aliases(g: _Group) -> bool:
    """An unquantized entry written in its own dtype: the output is (a view of) the tensor read."""
    return g.module is None and g.entry is not None and g.specs[0].dtype == g.entry.dtype


# --------------------------------------------------------------------------------------------
# which tensors a rank writes


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
    items: list[_Item]

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


def plan_items(plan: ExportPlan) -> list[_Item]:
    """Every item of ``plan`` in plan order: one per stored source tensor (its groups, in
    whatever files they land) and one for the KV scales."""
    where = group_files(plan)
    items: list[_Item] = []
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
            items.append(_Item(src, [], [], host_bytes=host))
        it = items[-1]
        it.groups.append(g)
        it.file_of.append(f)
        n = g.nbytes
        it.nbytes += n
        if not _aliases(g):
            it.out_bytes += n
    return items


def assign_items(plan: ExportPlan, world: int) -> list[Share]:
    """Every rank's share: the plan's items cut into ``world`` contiguous runs of about
    ``1 / world`` of the bytes read and written each (:attr:`_Item.cost`,
    :func:`split_balanced`). Cut at tensors, not files: with whole files a rank's share could
    miss ``1 / world`` by up to a whole shard file (``export.max_shard_size``), which bounded
    two ranks at 1.92x one. Contiguous, so a rank reads and writes long runs of neighbouring
    bytes and touches few files. The same on every rank."""
    items = plan_items(plan)
    runs = split_balanced([it.cost for it in items], world)
    return [Share(rank=r, items=items[run.start : run.stop]) for r, run in enumerate(runs)]


def create_files(plan: ExportPlan, tmp: Path) -> None:
    """Every shard file of ``plan`` in ``tmp``, header written and size set
    (:func:`~qckpt.checkpoint.safetensors_io.create_shard_file`): the main rank does this before
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


# --------------------------------------------------------------------------------------------
# the budget


class Stopped(Exception):
    """The pipeline was torn down while a thread waited (another stage failed)."""


class _Refused(Exception):
    """A quantize job's source-weight guard refused a tensor: ``error`` (the one-line
    ExportError) and ``pos``, its unit's place in plan order. The job gave back its budget
    first, so the pipeline may go on with the units before it (:meth:`_Pipeline._reap`)."""

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


# --------------------------------------------------------------------------------------------
# holding a source tensor


class _Hold:
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


# --------------------------------------------------------------------------------------------
# the stages


@dataclass
class WriteStats:
    """What one rank's writer did (busy seconds summed over each stage's threads)."""

    files: list[str] = field(default_factory=list)  # every shard file it wrote a tensor into
    tensors_written: int = 0
    sources: int = 0  # stored tensors read
    lanes: int = 1  # shard files written at once (lane_order)
    runs: int = 0  # runs of the bulk path (_Run) ...
    run_sources: int = 0  # ... and the stored tensors they took (the rest went one at a time)
    bytes_read: int = 0  # as stored on disk
    bytes_written: int = 0  # tensor data, headers excluded
    read_seconds: float = 0.0
    quantize_seconds: float = 0.0  # device copies, the source-weight guard, quantize, copy back
    write_seconds: float = 0.0
    budget_bytes: int = 0
    inflight_peak_bytes: int = 0
    rss_anon_start_bytes: int = 0
    rss_anon_peak_bytes: int = 0
    # per file touched, the slots written (ShardFile.written): for the main rank's whole-file
    # check, not part of the report
    slots: dict[str, int] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["slots"]
        return d


class _Pipeline:
    """The three stages of one rank's write; see the module doc."""

    def __init__(
        self,
        plan: ExportPlan,
        tmp: Path,
        share: Share,
        device: torch.device,
        readers: int,
        writers: int,
        quantizers: int,
        bulk: bool = True,
        lanes: int = 1,
    ) -> None:
        self.plan = plan
        self.device = device
        self.items = share.items
        self.chunk_elems = CHUNK_ELEMS if device.type == "cpu" else RUN_CHUNK_ELEMS_GPU
        self.bulk = bulk and plan.layout.stacks() and hasattr(plan.source, "read_span")
        largest = 2 * max([it.host_bytes for it in self.items] + [1])
        self.units: list[_Item | _Run] = list(self.items)
        if self.bulk:
            self.units = self._units(min(RUN_BYTES, (largest + RUN_SLACK_BYTES) // 2))
        runs = [u.host_bytes + u.out_bytes for u in self.units if isinstance(u, _Run)]
        files = [_unit_file(u) for u in self.units]
        self.order = lane_order([_unit_cost(u) for u in self.units], files, lanes)
        self.pos = {id(u): i for i, u in enumerate(self.units)}  # place in plan order
        # a refusal: (its unit's place, the error) of the first in plan order seen so far; the
        # units after it are not started (the cut), the ones before it still run to the end,
        # so that the error named is the first in plan order whatever the order units ran in
        self.failed: _Refused | None = None
        self.cut = len(self.units)
        self.budget = HostBudget(largest + (RUN_SLACK_BYTES if runs else 0))
        # on a GPU, what the quantize threads hold there together (their streams overlap one
        # tensor's copies with another's kernels): the same 2 x largest as one thread would,
        # or a run per quantize thread
        on_dev = [it.host_bytes for it in self.items if self._on_device(it)]
        self.dev_budget = HostBudget(max(2 * max(on_dev + [1]), quantizers * max(runs + [0])))
        self.streams = threading.local()
        names = share.names()
        self.stats = WriteStats(files=[plan.shards.files[i] for i in names])
        self.stats.lanes = min(lanes, len(set(files))) or 1
        self.stats.budget_bytes = self.budget.cap
        self.sampler = AnonSampler()
        self.stats.rss_anon_start_bytes = self.sampler.start
        meta = plan.layout.shard_metadata()
        self.out: dict[int, ShardFile] = {}
        dcp = plan.source.format == "dcp"  # its reader keeps per-load state: one thread
        self.read_pool = cf.ThreadPoolExecutor(1 if dcp else readers, "qckpt-read")
        self.write_pool = cf.ThreadPoolExecutor(writers, "qckpt-write")
        self.quantizers = quantizers
        self.quant_pool = cf.ThreadPoolExecutor(quantizers, "qckpt-quantize")
        self.ready: queue.Queue = queue.Queue()
        self.pending: list[cf.Future] = []  # writes
        self.jobs: list[cf.Future] = []  # quantize jobs
        self.back: list = []  # a queued entry taken by _batch that did not fit its batch
        self.finished: collections.deque[str] = collections.deque()
        self.lock = threading.Lock()
        self.done = 0
        for i, mine in names.items():  # made by the main rank (create_files); shared
            self.out[i] = ShardFile(tmp / plan.shards.files[i], plan.shards.specs[i], meta, mine)

    # -- read ----------------------------------------------------------------------------------
    def _read(self, it: _Item) -> list:
        """[tensor] (a box the quantize stage empties, so no other reference outlives it)."""
        if it.entry is None:
            return [None]
        t0 = time.perf_counter()
        src = self.plan.source
        t = src.read(it.entry, pinned=True) if self._pinned(it) else src.read(it.entry)
        with self.lock:
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.bytes_read += it.entry.nbytes
            self.stats.sources += 1
        self.sampler.sample()
        return [t]

    def _feed(self) -> None:
        """Take each unit's bytes in lane order (:func:`lane_order`), then start its read; None
        marks the end. Units after a refused one in plan order (the cut) are left out."""
        try:
            for pos in self.order:
                u = self.units[pos]

                def skip(pos: int = pos) -> bool:
                    return pos > self.cut

                if isinstance(u, _Run):
                    cost = self._run_read_cost(u) + self._run_out_cost(u)
                    read: Callable = self._read_run
                else:
                    cost = self._host_cost(u) + u.out_bytes
                    read = self._read
                if self.budget.take(cost, skip):
                    self.ready.put((u, self.read_pool.submit(_in_context(), read, u)))
            self.ready.put(None)
        except Stopped:
            self.ready.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
            self.ready.put(exc)

    # -- write ---------------------------------------------------------------------------------
    def _write(self, f: ShardFile, name: str, t: torch.Tensor, give: int, hold: _Hold | None):
        t0 = time.perf_counter()
        try:
            n = f.write(name, t)
        finally:
            del t
            self.budget.give(give)
            if hold is not None:
                hold.unref()
        with self.lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.bytes_written += n
            self.stats.tensors_written += 1
        self.sampler.sample()

    def _submit(self, *args: Any) -> None:
        with self.lock:
            self.pending = _unfinished(self.pending)
            self.pending.append(self.write_pool.submit(self._write, *args))

    # -- quantize ------------------------------------------------------------------------------
    def _outputs(
        self, it: _Item, box: list, checks: list
    ) -> Iterator[tuple[int, str, torch.Tensor, bool]]:
        """(file, name, output tensor, is a view of the source) of every group of ``it``; the
        source-weight guard's verdicts go to ``checks`` (looked at by :meth:`_process`, with the
        source view the message is made from)."""
        plan = self.plan
        if it.entry is None:  # the KV scales: from the calibration file only
            for a in plan.attn_modules:
                for name, q in plan.layout.kv_tensors(a, plan.amax):
                    yield it.file_of[0], name, q, False
            return
        from qckpt.models.naming import hf_tensors

        views = dict(hf_tensors(it.entry.name, box.pop(), plan.model_type))
        for g, f in zip(it.groups, it.file_of, strict=True):
            v = views.pop(g.entry.name)
            if g.module is None:
                yield f, g.entry.name, v.to(g.specs[0].dtype), _aliases(g)
                continue
            cal = plan.cal_amax[f"{g.module}.weight_amax"]
            checks.append((g.module, v, cal, check_source_weight(g.module, v, cal)))
            for name, q in plan.layout.quantize_linear(g.module, v, plan.amax):
                yield f, name, q, False
            del v

    def _on_device(self, it: _Item) -> bool:
        return it.quantized_only and self.device.type != "cpu"

    def _pinned(self, it: _Item) -> bool:
        """Read into page-locked memory: an item for a GPU, whose copy is then a DMA queued on
        the quantize thread's stream (from pageable memory the driver first copies every byte
        on the CPU into its staging buffer, on the quantize thread: the profiled H200 export
        spent much of its quantize threads' time in that copy)."""
        return self.device.type == "cuda" and self._on_device(it)

    def _host_cost(self, it: _Item) -> int:
        """An item's read as the host budget counts it: a pinned read at the power of two that
        torch's pinned allocator rounds it up to, so the budget bounds what it holds."""
        n = it.host_bytes
        return 1 << (n - 1).bit_length() if self._pinned(it) and n > 1 else n

    def _stream(self) -> Any:
        """This quantize thread's own CUDA stream (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        if getattr(self.streams, "s", None) is None:
            self.streams.s = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self.streams.s)

    def _job(self, batch: list[tuple[_Item, cf.Future]]) -> None:
        """One quantize job: one item, or consecutive small items that all go to the device
        (:meth:`_batch`), on this thread's own CUDA stream there; or one run (:class:`_Run`)."""
        if isinstance(batch[0][0], _Run):
            self._run_job(*batch[0])
            return
        on_dev = self._on_device(batch[0][0])
        cost = sum(it.host_bytes + it.out_bytes for it, _ in batch) if on_dev else 0
        if on_dev:
            cf.wait([fut for _, fut in batch])  # the reads first: the device budget is not idle
            self.dev_budget.take(cost)
        try:
            with (self._stream() if on_dev else None) or contextlib.nullcontext():
                self._process(batch)
        finally:
            if on_dev:
                self.dev_budget.give(cost)
        for it, _ in batch:
            if it.entry is not None:
                self.finished.append(it.entry.name)  # reported by the calling thread

    def _report(self, progress: ProgressFn | None, n: int) -> None:
        """Progress of the items finished so far, from the calling thread (a callback that
        blocks or raises, Ctrl-C included, then stops the calling thread, never a worker)."""
        while self.finished:
            name = self.finished.popleft()
            self.done += 1
            if progress is not None:
                progress(self.done, n, name)

    def _process(self, batch: list[tuple[_Item, cf.Future]]) -> None:
        """Quantize a job's items; then, after one wait for the device (:meth:`_to_host`), look
        at their source-weight verdicts and hand their outputs to the writers."""
        t0 = time.perf_counter()
        staged: list[tuple[_Item, _Hold | None, list]] = []
        checks: list = []
        marks: list[int] = []  # per check, its item's place in plan order
        copied: list[_Hold] = []  # host bytes of sources copied to the device
        for it, fut in batch:
            box = fut.result()
            hold: _Hold | None = _Hold(self.budget, self._host_cost(it))
            if self._on_device(it):
                # queued on this thread's stream; a pinned source's block is not reused before
                # the copy ran (torch records it), a pageable one is staged by the time the call
                # returns; either way its bytes are given back after the job's one wait
                box.append(box.pop().to(self.device, non_blocking=True))
                copied.append(hold)
                hold = None
            staged.append((it, hold, list(self._outputs(it, box, checks))))
            marks += [self.pos[id(it)]] * (len(checks) - len(marks))
            del box
        verdicts, block = self._to_host(staged, checks, self._on_device(batch[0][0]))
        for h in copied:
            h.unref()
        bad = [i for i, b in enumerate(verdicts) if b]
        if bad:  # the first refused tensor in plan order (a job may hold two lanes' items)
            i = min(bad, key=lambda i: marks[i])
            for _, hold, _ in staged:  # its budget back first: the pipeline may go on
                if hold is not None:
                    hold.unref()
            self.budget.give(sum(it.out_bytes for it, _ in batch))
            self._refuse(marks[i], *checks[i][:3])
        checks.clear()
        self._hand_over(staged, block)
        self._busy(time.perf_counter() - t0)
        self.sampler.sample()

    def _to_host(self, staged: list, checks: list, on_dev: bool) -> tuple[list[bool], int]:
        """The guard's verdicts of a job, as booleans. A job on the device: its outputs and
        verdicts copied into one host block (pinned on a GPU: the copies queue on this
        thread's stream without waiting) and one wait for the stream, where a wait per output
        and per check was most of a small tensor's time; ``staged``'s outputs are replaced by
        their views into the block, in place. Returns the verdicts and the block's output bytes
        (0: no block)."""
        if not on_dev:  # on the CPU a tensor's value is there already: nothing to wait for
            return [bool(c[3]) for c in checks], 0
        outs = [o for _, _, os_ in staged for o in os_]
        tensors = [o[2] for o in outs]
        tensors.append(
            torch.stack([c[3] for c in checks]) if checks else torch.zeros(0, dtype=bool)
        )
        host = _copy_back(tensors, self.device)
        del tensors
        views = iter(host)
        for _, _, os_ in staged:
            os_[:] = [(f, name, next(views), "block") for f, name, _, _ in os_]
        return host[-1].tolist(), sum(h.nbytes for h in host[:-1])

    def _hand_over(self, staged: list, block_bytes: int) -> None:
        """Submit every output's write; each gives back its reserved host bytes when written
        (a pass-through's source and the pinned block when their last write is done)."""
        out_left = sum(it.out_bytes for it, _, _ in staged)
        block = None
        if block_bytes:
            block = _Hold(self.budget, min(block_bytes, out_left))
            out_left -= block.nbytes
        for _, hold, outs in staged:
            for f, name, q, how in outs:
                owner = hold if how is True else block if how == "block" else None
                give = 0
                if owner is not None:
                    owner.ref()
                else:
                    give = min(q.nbytes, out_left)
                    out_left -= give
                self._submit(self.out[f], name, q, give, owner)
            outs.clear()
            if hold is not None:
                hold.unref()
        if block is not None:
            block.unref()
        self.budget.give(out_left)  # reserved, never written (nothing, unless the plan was off)

    def _refuse(self, pos: int, module: str, v: torch.Tensor, cal: torch.Tensor) -> NoReturn:
        """Raise the refusal of ``module``'s source weight ``v`` (the one-line message of the
        plain check, made on it alone) as a :class:`_Refused` of the unit at ``pos``."""
        try:
            refuse_source_weight(module, v, cal)
        except ExportError as exc:
            exc.__traceback__ = None  # its frames hold the job's tensors
            raise _Refused(pos, exc) from None
        raise AssertionError(f"{module}: the source-weight verdict and its check differ")

    def _busy(self, seconds: float) -> None:
        with self.lock:
            self.stats.quantize_seconds += seconds

    # -- the bulk path -------------------------------------------------------------------------
    def _bulk_span(self, it: _Item) -> tuple[str, int, int] | None:
        """(file, begin, end) of an item a run can take: one quantized linear whose stored
        bytes are its value (no split of a fused tensor, no conversion on read), no larger
        than a run's quantize chunk; None for any other."""
        e = it.entry
        if e is None or len(it.groups) != 1 or len(e.shape) != 2:
            return None
        g = it.groups[0]
        if g.module is None or g.entry.name != e.name or tuple(g.entry.shape) != e.shape:
            return None
        if not 0 < math.prod(e.shape) <= self.chunk_elems or not g.entry.dtype.is_floating_point:
            return None
        return self.plan.source.span(e)

    def _units(self, limit: int) -> list[_Item | _Run]:
        """The share's items with runs of adjacent bulk items (:meth:`_bulk_span`, one file,
        one dtype, within ``limit`` bytes as the budget counts them) made :class:`_Run`\\ s."""
        units: list[_Item | _Run] = []
        cur: list[_Item] = []
        spans: list[tuple[str, int, int]] = []

        def flush() -> None:
            if len(cur) > 1:
                units.append(self._make_run(list(cur), [b for _, b, _ in spans]))
            else:
                units.extend(cur)
            cur.clear()
            spans.clear()

        host = out = 0
        for it in self.items:
            sp = self._bulk_span(it)
            if sp is None:
                flush()
                units.append(it)
                continue
            if cur and (
                sp[0] != spans[-1][0]
                or sp[1] != spans[-1][2]
                or it.entry.dtype != cur[-1].entry.dtype
                or self._costs(host + it.host_bytes, out + it.out_bytes) > limit
            ):
                flush()
            if not cur:
                host = out = 0
            cur.append(it)
            spans.append(sp)
            host += it.host_bytes
            out += it.out_bytes
        flush()
        return units

    def _make_run(self, items: list[_Item], begins: list[int]) -> _Run:
        dtype = items[0].entry.torch_dtype
        offsets = [b - begins[0] for b in begins]
        shapes = [tuple(it.entry.shape) for it in items]
        return _Run(
            items=items,
            dtype=dtype,
            stacks=_stacks([it.entry.name for it in items], shapes, offsets, dtype.itemsize),
            host_bytes=sum(it.host_bytes for it in items),
            out_bytes=sum(it.out_bytes for it in items),
        )

    def _costs(self, host: int, out: int) -> int:
        """A run's bytes as the host budget counts them: on a GPU its read buffer and its
        block of outputs are pinned, at the power of two torch's pinned allocator rounds to."""
        if self.device.type != "cuda":
            return host + out
        return sum(1 << (n - 1).bit_length() if n > 1 else n for n in (host, out))

    def _run_read_cost(self, run: _Run) -> int:
        return self._costs(run.host_bytes, run.out_bytes) - self._run_out_cost(run)

    def _run_out_cost(self, run: _Run) -> int:
        return self._costs(0, run.out_bytes)

    def _read_run(self, run: _Run) -> torch.Tensor:
        t0 = time.perf_counter()
        entries = [it.entry for it in run.items]
        buf = self.plan.source.read_span(entries, pinned=self.device.type == "cuda")
        with self.lock:
            self.stats.read_seconds += time.perf_counter() - t0
            self.stats.bytes_read += sum(e.nbytes for e in entries)
            self.stats.sources += len(entries)
            self.stats.runs += 1
            self.stats.run_sources += len(entries)
        self.sampler.sample()
        return buf

    def _runs_on_device(self) -> bool:
        """Runs are quantized on a device (a GPU): copied there, and back with one wait."""
        return self.device.type != "cpu"

    def _run_job(self, run: _Run, fut: cf.Future) -> None:
        on_dev = self._runs_on_device()
        cost = run.host_bytes + run.out_bytes
        if on_dev:
            cf.wait([fut])  # the read first: the device budget is not idle
            self.dev_budget.take(cost)
        try:
            with (self._stream() if on_dev else None) or contextlib.nullcontext():
                self._process_run(run, fut)
        finally:
            if on_dev:
                self.dev_budget.give(cost)
        self.finished.extend(it.entry.name for it in run.items)

    def _process_run(self, run: _Run, fut: cf.Future) -> None:
        """A run: its bytes to the device (one copy), then per stack the source-weight guard (one
        reduction) and the quantization (one set of kernels); one wait for the device
        (:meth:`_run_to_host`); the first refused weight's one-line error, or the writes."""
        t0 = time.perf_counter()
        read = _Hold(self.budget, self._run_read_cost(run))
        buf = fut.result()
        src = buf.to(self.device, non_blocking=True) if self._runs_on_device() else buf
        del buf
        typed = src.view(run.dtype)
        isz = run.dtype.itemsize
        plan = self.plan
        views, outs, bads, cals = [], [], [], []
        for st in run.stacks:
            (rows, cols), k = st.shape, len(st.index)
            w = typed.as_strided((k, rows, cols), (st.stride // isz, cols, 1), st.offset // isz)
            modules = [run.items[i].groups[0].module for i in st.index]
            cal = [plan.cal_amax[f"{m}.weight_amax"] for m in modules]
            bads.append(check_source_stack(w, cal, self.chunk_elems))
            outs.append(plan.layout.quantize_stack(modules, w, plan.amax, self.chunk_elems))
            views.append(w)
            cals.append(cal)
        verdicts = self._run_to_host(bads, outs)
        where = [(s, j) for s, st in enumerate(run.stacks) for j in range(len(st.index))]
        bad = [run.stacks[s].index[j] for (s, j), b in zip(where, verdicts, strict=True) if b]
        if bad:  # the one-line message of the first refused weight, in the items' order
            s, j = next((s, j) for s, j in where if run.stacks[s].index[j] == min(bad))
            module = run.items[run.stacks[s].index[j]].groups[0].module
            read.unref()  # its budget back first: the pipeline may go on
            self.budget.give(self._run_out_cost(run))
            self._refuse(self.pos[id(run)], module, views[s][j], cals[s][j])
        del views, typed, src
        read.unref()
        self._write_run(run, outs)
        self._busy(time.perf_counter() - t0)
        self.sampler.sample()

    def _run_to_host(self, bads: list[torch.Tensor], outs: list[list[torch.Tensor]]) -> list:
        """The verdicts as booleans; on a device every stack's quantized weights and the
        verdicts copied into one host block (pinned on a GPU) with one wait for the stream, the
        weights in ``outs`` replaced by their host views."""
        verdicts = bads[0] if len(bads) == 1 else torch.cat(bads)
        if not self._runs_on_device():
            return verdicts.tolist()
        tensors = [o[0] for o in outs] + [verdicts]
        host = _copy_back(tensors, self.device)
        del tensors
        for o, h in zip(outs, host, strict=False):
            o[0] = h
        return host[-1].tolist()

    def _write_run(self, run: _Run, outs: list[list[torch.Tensor]]) -> None:
        """Each item's outputs as byte views of its stacks' outputs, written with one
        :meth:`~qckpt.checkpoint.safetensors_io.ShardFile.write_span` per file; the run's
        output bytes come back when the last is written."""
        per_item: list[list[memoryview]] = [[] for _ in run.items]
        for st, o in zip(run.stacks, outs, strict=True):
            specs = run.items[st.index[0]].groups[0].specs
            k = len(st.index)
            if len(o) != len(specs) or any(
                t.dtype != sp.dtype or tuple(t.shape) != (k, *sp.shape)
                for t, sp in zip(o, specs, strict=False)
            ):  # the layout and the plan disagree: a bug
                raise AssertionError(
                    f"stacked outputs {[tuple(t.shape) for t in o]}, planned {specs}"
                )
            for t in o:
                mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                n = mv.nbytes // k
                for j, i in enumerate(st.index):
                    per_item[i].append(mv[j * n : (j + 1) * n])
        hold = _Hold(self.budget, self._run_out_cost(run))
        seg: list[int] = []
        for i, it in enumerate(run.items):
            if seg and it.file_of[0] != run.items[seg[0]].file_of[0]:
                self._submit_span(run, seg, per_item, hold)
                seg = []
            seg.append(i)
        self._submit_span(run, seg, per_item, hold)
        hold.unref()

    def _submit_span(self, run: _Run, seg: list[int], per_item: list, hold: _Hold) -> None:
        f = self.out[run.items[seg[0]].file_of[0]]
        names = [sp.name for i in seg for sp in run.items[i].groups[0].specs]
        views = [v for i in seg for v in per_item[i]]
        hold.ref()
        with self.lock:
            self.pending = _unfinished(self.pending)
            self.pending.append(self.write_pool.submit(self._write_span, f, names, views, hold))

    def _write_span(self, f: ShardFile, names: list[str], views: list, hold: _Hold) -> None:
        t0 = time.perf_counter()
        try:
            n = f.write_span(names, views)
        finally:
            del views
            hold.unref()
        with self.lock:
            self.stats.write_seconds += time.perf_counter() - t0
            self.stats.bytes_written += n
            self.stats.tensors_written += len(names)
        self.sampler.sample()

    # -- the whole -----------------------------------------------------------------------------
    def run(self, progress: ProgressFn | None, should_stop: Callable[[], None] | None) -> None:
        feeder = threading.Thread(
            target=_in_context(), args=(self._feed,), name="qckpt-feed", daemon=True
        )
        feeder.start()
        n = sum(1 for it in self.items if it.entry is not None)
        try:
            while (got := self._next_ready()) is not None:
                if isinstance(got, BaseException):
                    raise got
                batch = self._batch(got)
                del got
                if should_stop is not None:
                    should_stop()
                self._report(progress, n)
                self._reap()
                self.jobs.append(self.quant_pool.submit(_in_context(), self._job, batch))
                del batch
            while self.jobs:
                cf.wait(self.jobs, timeout=0.1, return_when=cf.FIRST_COMPLETED)
                self._reap()
                self._report(progress, n)
            with self.lock:
                writes = list(self.pending)
            if self.failed is not None:  # every unit before it ran: the first in plan order
                # the writes under way end first (the teardown would cancel those queued,
                # whose bytes then never come back to the budget); the refusal still wins
                cf.wait(writes)
                raise self.failed.error
            self._report(progress, n)
            for w in writes:
                w.result()
            for f in self.out.values():
                f.close()
                self.stats.slots[f.path.name] = f.written()
        finally:
            self._shutdown(feeder)
        self.sampler.sample(force=True)
        self.stats.inflight_peak_bytes = self.budget.peak
        self.stats.rss_anon_peak_bytes = self.sampler.peak

    def _next_ready(self) -> Any:
        """The feeder's next item, watching the quantize jobs while it waits: a job that failed
        never gives its bytes back, so the feeder may wait on the budget for ever (measured: a
        rank whose share held no embedding, a weight failing its amax guard followed by one as
        large, hung until the test harness gave up)."""
        if self.back:
            return self.back.pop()
        while True:
            try:
                return self.ready.get(timeout=0.05)
            except queue.Empty:
                self._reap()
                if self.failed is None or self.jobs:
                    continue
                with self.lock:
                    self.pending = _unfinished(self.pending)
                    writing = bool(self.pending)
                # in this order: with no job and no write left nothing but this thread gives
                # bytes back, so a feeder seen blocked stays blocked, and what it queued before
                # blocking is in ready (a write that ended between a stuck() and the writes'
                # look had freed the bytes the feeder waited for: raised before the units
                # ahead of the refusal ran)
                if not writing and self.budget.stuck() and self.ready.empty():
                    raise self.failed.error from None  # nothing could give bytes back

    def _reap(self) -> None:
        """Drop the finished quantize jobs: a failure raises, but a refusal (:class:`_Refused`)
        is kept if it is the first in plan order so far, and the units after it are not
        started (the cut); the pipeline goes on with those before it."""
        keep = []
        for fut in self.jobs:
            if not fut.done():
                keep.append(fut)
                continue
            exc = fut.exception()
            if exc is None:
                continue
            if not isinstance(exc, _Refused):
                raise exc
            exc.__traceback__ = None  # its frames hold the job's tensors
            if self.failed is None or exc.pos < self.failed.pos:
                self.failed, self.cut = exc, exc.pos
                self.budget.poke()
        self.jobs = keep

    def _batch(self, first: tuple[_Item, cf.Future]) -> list[tuple[_Item, cf.Future]]:
        """``first`` and the items queued right behind it, while all go to the device and
        their bytes stay within ``BATCH_BYTES`` and half the device budget (two jobs on the
        device at once: one launches while the other waits); the first that does not fit is
        put back. While every quantize thread is busy the batch waits for more items (they
        would only queue behind the busy threads one by one: measured, every job then held
        one item); when a thread is free it goes with what is queued."""
        batch = [first]
        if isinstance(first[0], _Run) or not self._on_device(first[0]):
            return batch
        limit = min(BATCH_BYTES, self.dev_budget.cap // 2)
        size = first[0].host_bytes + first[0].out_bytes
        while size < limit:
            full = self._pool_full()
            try:
                got = self.ready.get(timeout=0.002) if full else self.ready.get_nowait()
            except queue.Empty:
                if full:
                    continue
                break
            cost = 0 if not isinstance(got, tuple) else got[0].host_bytes + got[0].out_bytes
            if (
                not isinstance(got, tuple)
                or isinstance(got[0], _Run)
                or not self._on_device(got[0])
                or size + cost > limit
            ):
                self.back.append(got)  # the end, an error or another kind of item: next
                break
            batch.append(got)
            size += cost
        return batch

    def _pool_full(self) -> bool:
        """Every quantize thread has a job (a failed job is done: the caller then raises)."""
        return sum(1 for j in self.jobs if not j.done()) >= self.quantizers

    def _shutdown(self, feeder: threading.Thread) -> None:
        self.budget.stop()
        while feeder.is_alive():  # drain, so that a feeder blocked on put can finish
            try:
                self.ready.get(timeout=0.05)
            except queue.Empty:
                pass
        self.dev_budget.stop()
        self.read_pool.shutdown(wait=True, cancel_futures=True)
        self.quant_pool.shutdown(wait=True, cancel_futures=True)
        self.write_pool.shutdown(wait=True, cancel_futures=True)
        for f in self.out.values():
            f.abort()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if self.device.type == "cuda" and empty is not None:
            empty()  # the pinned blocks torch keeps for reuse: host memory the export is done with


def _copy_back(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (on ``device``) copied into one host block, pinned on a GPU so the copies
    queue on the current stream, then one wait for that stream: their host views, in order.
    A wait per tensor was most of a small tensor's time."""
    sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors]  # every dtype's alignment
    offsets = list(itertools.accumulate(sizes, initial=0))
    block = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    host = []
    for t, off in zip(tensors, offsets, strict=False):
        h = block[off : off + t.nbytes].view(t.dtype).view(t.shape)
        h.copy_(t, non_blocking=True)
        host.append(h)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return host


def _in_context() -> Callable[..., Any]:
    """``run`` of a copy of the caller's context: a worker thread then sees the caller's
    context variables (the kernel policy the CLI scoped, ``qckpt.kernel_policy``), which a
    thread does not inherit. One copy per task: a context cannot be entered twice at once."""
    return contextvars.copy_context().run


def _unfinished(futures: list[cf.Future]) -> list[cf.Future]:
    """The futures still running; raises the first finished one's error."""
    keep = []
    for fut in futures:
        if not fut.done():
            keep.append(fut)
        elif fut.exception() is not None:
            raise fut.exception()
    return keep


def write_share(
    plan: ExportPlan,
    tmp: str | Path,
    share: Share,
    *,
    device: torch.device | str = "cpu",
    readers: int = 2,
    writers: int = 4,
    quantizers: int | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], None] | None = None,
    bulk: bool | None = None,
    lanes: int | None = None,
) -> WriteStats:
    """Write ``share`` (one of :func:`assign_items`) of ``plan`` into the shard files in ``tmp``,
    which :func:`create_files` made: each tensor at its planned offset, other ranks' tensors
    left to them.

    ``quantizers``: threads that quantize (default: 1 on the CPU, whose kernels are threaded
    already; 4 on a GPU, each on its own stream). ``should_stop()`` is called before each
    source tensor and may raise to stop the write (a
    peer rank failed). ``bulk``: take runs of adjacent small weights together (:class:`_Run`;
    default: yes, unless the environment sets ``QCKPT_EXPORT_BULK=0``, the A/B switch of the
    benchmarks); the files are the same either way. ``lanes``: how many shard files to write at
    once (:func:`lane_order`; default ``LANES``, or the environment's ``QCKPT_EXPORT_LANES``, the
    benchmarks' A/B switch); the files are the same for any number. Nothing else is written (no index, config or marker). Raises what a
    stage raised; the files may then be partly written (the caller discards the directory).
    """
    dev = torch.device(device)
    if quantizers is None:  # a GPU: overlap one tensor's copies with the next one's kernels
        quantizers = 1 if dev.type == "cpu" else 4
    if bulk is None:
        bulk = os.environ.get("QCKPT_EXPORT_BULK", "1") != "0"
    if lanes is None:
        lanes = _env_lanes()
    pipe = _Pipeline(plan, Path(tmp), share, dev, readers, writers, quantizers, bulk, lanes)
    pipe.run(progress, should_stop)
    return pipe.stats


def _env_lanes() -> int:
    """``QCKPT_EXPORT_LANES`` (1 .. 64), else ``LANES``."""
    raw = os.environ.get("QCKPT_EXPORT_LANES", "").strip()
    if not raw:
        return LANES
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise ExportError(f"QCKPT_EXPORT_LANES: must be a whole number 1 .. 64, got {raw!r}")
    return n
