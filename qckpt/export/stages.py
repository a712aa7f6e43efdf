"""Writing an export plan's shard files: reads, quantization and writes overlapped.

**Who writes what** is :mod:`qckpt.export.shares` (each rank's byte-balanced run of the plan's
items, the shard files made first and shared); one process is the same with one share holding
every item.

One rank writes its share (:func:`write_share`) in three stages:

* **read**: a feeder thread walks this rank's source tensors in lane order (:func:`~qckpt.export.shares.lane_order`:
  the share cut into ``lanes`` contiguous lanes, taken by turns, each in plan order, so that
  that many shard files are written at once); for each it first takes its host bytes from a
  :class:`~qckpt.export.budget.HostBudget` (the stored value plus every output made from it), then hands the read
  to a small pool (``readers`` threads; one for a DCP source, whose reader is not thread-safe).
  Results are consumed in that order.
* **quantize**: a pool of threads (one on the CPU; on a GPU four, each on its own CUDA stream)
  moves each source tensor to ``device`` (a GPU when there is one: one host-to-device copy,
  after which its host bytes are given back), checks it against its calibrated amax (the
  source-weight guard) and quantizes it with the layout. On a GPU consecutive small items are
  one job (:meth:`Pipeline._batch`, up to ``BATCH_BYTES``), nothing waits for the device per
  tensor (the guard's verdicts stay on the device), and the job's outputs and verdicts come
  back into one pinned host block with one wait for the stream; then a refused tensor raises
  the guard's one-line error, or the outputs go to the writers.
* **write**: a pool of ``writers`` threads writes each output at its planned offset in its
  file (:class:`~qckpt.storage.shards.ShardFile`, ``pwrite``), so several files (and
  several tensors of one file) are written at once; each write gives its bytes back. A buffered
  write holds its file's lock while it copies, so the writes into one file take turns: the
  lanes are what lets one rank write several files at once.

**A refused tensor** (the source-weight guard) stops the feeder at it (no later unit in plan
order is started) while the units before it still run, so the error raised is the first
refused tensor in plan order whatever order the lanes and the quantize threads took them in.

**The bulk path** (:mod:`qckpt.export.bulk`): adjacent small weights of one file and dtype (the
experts of a MoE layer) go as one :class:`~qckpt.export.shares.Run`: one read, one copy, one
guard reduction and one quantize per stack, one ``pwritev`` per file; the per-item Python (~3.5
ms per tensor on the GPU, measured) is paid per run. Layouts whose weights do not stack
(:meth:`~qckpt.layouts.export_layout.ExportLayout.stacks`: per-block scales, NVFP4, ModelOpt's
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

import collections
import concurrent.futures as cf
import contextlib
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from qckpt.errors import ExportError
from qckpt.export.budget import Hold, HostBudget, Refused, Stopped
from qckpt.export.bulk import BulkRuns, copy_back, unfinished
from qckpt.export.guard import check_source_weight, refuse_source_weight
from qckpt.export.plan import ExportPlan
from qckpt.export.shares import Item, Run, Share, aliases, lane_order, unit_cost, unit_file
from qckpt.layouts.export_layout import CHUNK_ELEMS
from qckpt.memory import AnonPeak
from qckpt.storage.shards import ShardFile

ProgressFn = Callable[[int, int, str], None]


MiB = 2**20


# what the export may hold on the host beyond its tensors in flight (kernel chunk temporaries,
# allocator slack): the "+ 256 MiB" of the documented bound
HOST_SLACK_BYTES = 256 * MiB


# a GPU quantize job takes consecutive small items up to this many bytes (read plus written)
# together: a 3 MB expert weight cost ~5 ms of launches, copies and waits on its own, so their
# Python work, launches and the one wait for their outputs are paid per batch
BATCH_BYTES = 32 * MiB


# the bulk path (:class:`Run`): adjacent small weights read, checked, quantized and written
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


@dataclass
class WriteStats:
    """What one rank's writer did (busy seconds summed over each stage's threads)."""

    files: list[str] = field(default_factory=list)  # every shard file it wrote a tensor into
    tensors_written: int = 0
    sources: int = 0  # stored tensors read
    lanes: int = 1  # shard files written at once (lane_order)
    runs: int = 0  # runs of the bulk path (Run) ...
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


class Pipeline(BulkRuns):
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
        self.units: list[Item | Run] = list(self.items)
        if self.bulk:
            self.units = self._units(min(RUN_BYTES, (largest + RUN_SLACK_BYTES) // 2))
        runs = [u.host_bytes + u.out_bytes for u in self.units if isinstance(u, Run)]
        files = [unit_file(u) for u in self.units]
        self.order = lane_order([unit_cost(u) for u in self.units], files, lanes)
        self.pos = {id(u): i for i, u in enumerate(self.units)}  # place in plan order
        # a refusal: (its unit's place, the error) of the first in plan order seen so far; the
        # units after it are not started (the cut), the ones before it still run to the end,
        # so that the error named is the first in plan order whatever the order units ran in
        self.failed: Refused | None = None
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
        self.sampler = AnonPeak()
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
    def _read(self, it: Item) -> list:
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

                if isinstance(u, Run):
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
    def _write(self, f: ShardFile, name: str, t: torch.Tensor, give: int, hold: Hold | None):
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
            self.pending = unfinished(self.pending)
            self.pending.append(self.write_pool.submit(self._write, *args))

    # -- quantize ------------------------------------------------------------------------------
    def _outputs(
        self, it: Item, box: list, checks: list
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
                yield f, g.entry.name, v.to(g.specs[0].dtype), aliases(g)
                continue
            cal = plan.layout.guard_amax(g.module, plan.cal_amax[f"{g.module}.weight_amax"])
            checks.append((g.module, v, cal, check_source_weight(g.module, v, cal)))
            for name, q in plan.layout.quantize_linear(g.module, v, plan.amax):
                yield f, name, q, False
            del v

    def _on_device(self, it: Item) -> bool:
        return it.quantized_only and self.device.type != "cpu"

    def _pinned(self, it: Item) -> bool:
        """Read into page-locked memory: an item for a GPU, whose copy is then a DMA queued on
        the quantize thread's stream (from pageable memory the driver first copies every byte
        on the CPU into its staging buffer, on the quantize thread: the profiled H200 export
        spent much of its quantize threads' time in that copy)."""
        return self.device.type == "cuda" and self._on_device(it)

    def _host_cost(self, it: Item) -> int:
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

    def _job(self, batch: list[tuple[Item, cf.Future]]) -> None:
        """One quantize job: one item, or consecutive small items that all go to the device
        (:meth:`_batch`), on this thread's own CUDA stream there; or one run (:class:`Run`)."""
        if isinstance(batch[0][0], Run):
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

    def _process(self, batch: list[tuple[Item, cf.Future]]) -> None:
        """Quantize a job's items; then, after one wait for the device (:meth:`_to_host`), look
        at their source-weight verdicts and hand their outputs to the writers."""
        t0 = time.perf_counter()
        staged: list[tuple[Item, Hold | None, list]] = []
        checks: list = []
        marks: list[int] = []  # per check, its item's place in plan order
        copied: list[Hold] = []  # host bytes of sources copied to the device
        for it, fut in batch:
            box = fut.result()
            hold: Hold | None = Hold(self.budget, self._host_cost(it))
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
        host = copy_back(tensors, self.device)
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
            block = Hold(self.budget, min(block_bytes, out_left))
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
        plain check, made on it alone) as a :class:`Refused` of the unit at ``pos``."""
        try:
            refuse_source_weight(module, v, cal)
        except ExportError as exc:
            exc.__traceback__ = None  # its frames hold the job's tensors
            raise Refused(pos, exc) from None
        raise AssertionError(f"{module}: the source-weight verdict and its check differ")

    def _busy(self, seconds: float) -> None:
        with self.lock:
            self.stats.quantize_seconds += seconds

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
                    self.pending = unfinished(self.pending)
                    writing = bool(self.pending)
                # in this order: with no job and no write left nothing but this thread gives
                # bytes back, so a feeder seen blocked stays blocked, and what it queued before
                # blocking is in ready (a write that ended between a stuck() and the writes'
                # look had freed the bytes the feeder waited for: raised before the units
                # ahead of the refusal ran)
                if not writing and self.budget.stuck() and self.ready.empty():
                    raise self.failed.error from None  # nothing could give bytes back

    def _reap(self) -> None:
        """Drop the finished quantize jobs: a failure raises, but a refusal (:class:`Refused`)
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
            if not isinstance(exc, Refused):
                raise exc
            exc.__traceback__ = None  # its frames hold the job's tensors
            if self.failed is None or exc.pos < self.failed.pos:
                self.failed, self.cut = exc, exc.pos
                self.budget.poke()
        self.jobs = keep

    def _batch(self, first: tuple[Item, cf.Future]) -> list[tuple[Item, cf.Future]]:
        """``first`` and the items queued right behind it, while all go to the device and
        their bytes stay within ``BATCH_BYTES`` and half the device budget (two jobs on the
        device at once: one launches while the other waits); the first that does not fit is
        put back. While every quantize thread is busy the batch waits for more items (they
        would only queue behind the busy threads one by one: measured, every job then held
        one item); when a thread is free it goes with what is queued."""
        batch = [first]
        if isinstance(first[0], Run) or not self._on_device(first[0]):
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
                or isinstance(got[0], Run)
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


def _in_context() -> Callable[..., Any]:
    """``run`` of a copy of the caller's context: a worker thread then sees the caller's
    context variables (the kernel policy the CLI scoped, ``qckpt.kernel_policy``), which a
    thread does not inherit. One copy per task: a context cannot be entered twice at once."""
    return contextvars.copy_context().run


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
    peer rank failed). ``bulk``: take runs of adjacent small weights together (:class:`Run`;
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
    pipe = Pipeline(plan, Path(tmp), share, dev, readers, writers, quantizers, bulk, lanes)
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
