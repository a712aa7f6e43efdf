"""The fast read path: parallel positional reads of the stored bytes, overlapped with the
planner's work, in plan order.

DCP's plain reader handles one item at a time on one thread: ``torch.load`` of the whole
stored chunk (read, unpickle, allocate, copy), then a copy into the destination, then the
planner's commit (for a quantized destination at its last item: the quantize). Here:

* each item's source is a row-major tensor at a known byte offset of a file
  (``qckpt.storage.torch_save.StoredTensor``: from the safetensors header, or from the ``torch.save``
  archive DCP wrote, found without ``torch.load``);
* the item's region is cut into pieces of at most ``chunk_bytes`` along its first axis longer
  than one, and a thread pool reads the pieces with ``os.preadv`` (no GIL held): straight into
  the destination when it is a contiguous host tensor of the stored dtype, else through a
  per-thread buffer (narrowed, cast) into it; for a CUDA destination through a bounded pool of
  pinned host buffers, each piece copied to the device on a copy stream
  (``non_blocking``), so host reads, host-to-device copies and the planner's quantize (on the
  current stream) overlap;
* ``max_inflight`` bounds how many quantized destinations (planner scratches) are live at
  once. The planner's transient is then at most ``max_inflight`` scratches
  (``max_inflight x 2*max(numel)`` for BF16), which the load report predicts;
* read-ahead: the reads of the streamed destinations after the live ones do not wait for a
  scratch. Their runs are planned from the planner's ``run_layout`` (nothing allocated) and
  read into staging buffers, host memory (pinned on CUDA), at most ``READ_AHEAD_BYTES`` of them
  (``HOST_READ_AHEAD_BYTES`` for a host destination: 0, off); when a live destination finishes,
  the next one is admitted (``resolve_run``, in plan order) and its staged bytes copied in, its
  later reads go straight to the scratch. So the readers read on while a destination's last
  copies land and its quantize runs, and the device holds no more scratches than before.
  Host memory of the fast reader on CUDA: one pool of pinned buffers of ``CHUNK_BYTES``, at
  most ``threads + 2`` plus the read-ahead's budget (reported as ``read_ahead_bytes``), made
  only when none is free (pinning costs time: the staged bytes take the free buffers first),
  of which staging may keep at most the budget's. No deadlock: the pool takes tasks
  in order and every read before a read-ahead run in plan order is queued before its tasks
  (which may wait for a staging buffer that only an admission gives back); the head of the
  window is always admitted, its tasks waiting for staging then read straight into it, and a
  failing load wakes them (``_stop``).

THE ORDERING INVARIANT (relied on by the planner's ``_finish``, which may run collectives, such
as a group-reduced amax of a sharded parameter): every planner call (``resolve_tensor``,
``commit_tensor``, ``load_bytes``, hence ``_finish``) happens on the calling thread, and
``commit_tensor`` / ``load_bytes`` in exactly the plan's order (which ``finish_plan`` groups by
fqn), the same on every rank. Only the byte reads and host-to-device copies run ahead on other
threads; ``resolve_tensor`` / ``resolve_run`` run ahead of commits (on the calling thread; a
scratch is resolved in plan order among scratches, though a plain destination after a
read-ahead one may be resolved before it), which is how a scratch is allocated before its
bytes arrive. Quantization stays on the calling
thread, so the kernel policy (a context variable) applies to it as set by the caller.
The calls the engine makes of a planner are :mod:`qckpt.read.contract`'s protocols.
``tests/unit/test_fast_read.py`` pins this down.

Items whose source cannot be described that way (a compressed or unusual archive, a quantized
source's codes and scales, a byte entry) run inline, on the calling thread at their turn, by
the plain code.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from qckpt import phases
from qckpt.errors import CheckpointError
from qckpt.read.contract import ItemPlanner, RunPlanner
from qckpt.read.fast_io import Files, PinnedPool, byte_view
from qckpt.read.fast_spans import (
    MIN_TASK_BYTES,
    Job,
    SpanRun,
    fits,
    run_spans,
    span_tasks,
    split_region,
)
from qckpt.read.fast_tasks import PoolReads
from qckpt.read.read_sizes import CHUNK_BYTES, READ_AHEAD_BYTES, default_threads
from qckpt.storage.torch_save import StoredTensor

DEFAULT_MAX_INFLIGHT = 1


# read-ahead on the host (READ_AHEAD_BYTES, in read_sizes, is the device's): the staged bytes
# would cost a second copy into the scratch, and the readers share the cores with the quantize:
# off there (a CPU run with no quantize to overlap, 2 cores: 0.21-0.45 s with 64 MiB vs
# 0.10-0.33 without)
HOST_READ_AHEAD_BYTES = 0


WINDOW_ITEMS = 256


BATCH_PIECES = 32  # small pieces per pool task (their bytes stay under CHUNK_BYTES too)


@dataclass(eq=False)  # compared by identity
class _Batch:
    """Pieces one pool task reads, in order: small items share a task (a hand-off to a thread
    per few-KiB piece costs more than its read); a task returns its last CUDA event (its copies
    run in order on the one copy stream) or None."""

    work: list[tuple[StoredTensor, Any, Any]] = field(default_factory=list)
    nbytes: int = 0
    future: Future | None = None
    waited: bool = False  # the calling stream waits for its event already


@dataclass
class _Pending:
    job: Job
    target: torch.Tensor | None = None
    batches: list[_Batch] = field(default_factory=list)


@dataclass
class _Admission:
    """What the calling thread's loop knows about the destinations it has started."""

    streams: Callable[[str], Any] | None  # the planner's: which fqns go through a scratch
    runs: bool  # the planner takes runs (resolve_run / commit_run)
    ahead: bool  # ... and tells a run's layout before its scratch exists (run_layout)
    live: set[str] = field(default_factory=set)  # a scratch resolved, not yet finished
    waiting: dict[str, SpanRun] = field(default_factory=dict)  # read ahead, in plan order
    ahead_bytes: int = 0  # the staging the waiting runs may take (``SpanRun.staging``)
    budget: int | None = None  # the read-ahead bytes for the load's device, once known


class FastReadEngine(PoolReads):
    """Runs a plan's jobs: reads ahead on a thread pool, planner calls in plan order here."""

    def __init__(
        self,
        *,
        files: Files,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        read_ahead: int | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        if read_ahead is not None and read_ahead < 0:
            raise ValueError(f"read_ahead must be at least 0, got {read_ahead}")
        self.files = files
        self.max_inflight = int(max_inflight)
        self.threads = int(threads or default_threads())
        self.chunk_bytes = int(chunk_bytes or CHUNK_BYTES)
        # staging bytes for the destinations read ahead of their scratch (None: by device)
        self._ahead_budget = {
            "cuda": READ_AHEAD_BYTES if read_ahead is None else int(read_ahead),
            "cpu": HOST_READ_AHEAD_BYTES if read_ahead is None else int(read_ahead),
        }
        self.ahead_bytes = 0  # the staging pool's bound once made (host bytes)
        # items admitted ahead of the one committed: many, since small items (one expert of a
        # fused tensor) need many in flight to keep the threads busy; the memory they hold is
        # bounded elsewhere (max_inflight scratches, the pinned pool)
        self.window = WINDOW_ITEMS
        self.bytes_read = 0
        self._local = threading.local()
        self._pool: PinnedPool | None = None
        self._ahead: PinnedPool | None = None  # staging buffers of the runs read ahead
        self._closing = False  # the load is failing: staging waiters give up
        self._copy_stream: Any = None
        self._open: _Batch | None = None  # the batch being filled, not yet submitted
        self._ready: dict[str, Any] = {}  # fqn -> the event its copies wait for (CUDA)

    # ---- the calling thread ---------------------------------------------------------------

    def run(self, jobs: list[Job], planner: ItemPlanner) -> None:
        """Every job's item read, resolved and committed, commits in the jobs' order.

        Python's cyclic collector is off meanwhile: the read allocates a few objects per item
        that live until their commit, so a 20k-item read set off several full collections,
        each a walk over the whole heap (the model, torch, transformers: ~0.3 s apiece on a
        loaded host), which grew the per-item cost with the number of items."""
        with phases.gc_paused():
            self._run(jobs, planner)

    def _run(self, jobs: list[Job], planner: ItemPlanner) -> None:
        left = Counter(j.item.dest_index.fqn for j in jobs)
        runs = hasattr(planner, "resolve_run") and hasattr(planner, "commit_run")
        ahead = runs and hasattr(planner, "run_layout") and max(self._ahead_budget.values()) > 0
        st = _Admission(getattr(planner, "streams", None), runs, ahead)
        window: deque[_Pending | SpanRun] = deque()
        held = 0  # window slots taken: an item, or a whole run (its reads go through the pool)
        nxt = done = 0
        self._closing = False
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qckpt-read")
        try:
            while done < len(jobs):
                self._attach_waiting(st, window, planner)
                while nxt < len(jobs) and held < self.window:
                    unit = self._admit(jobs, nxt, planner, pool, st, bool(window))
                    if unit is None:
                        break
                    window.append(unit)
                    held += 1
                    nxt += len(unit.items) if isinstance(unit, SpanRun) else 1
                head = window[0]
                if isinstance(head, _Pending) and self._open is not None:
                    if self._open in head.batches:
                        self._flush(pool)  # the item waited for next is in it
                p = window.popleft()
                held -= 1
                if isinstance(p, SpanRun):
                    self._complete_run(p, planner)
                    fqn, n = p.fqn, len(p.items)
                else:
                    self._complete(p, planner)
                    fqn, n = p.job.item.dest_index.fqn, 1
                done += n
                left[fqn] -= n
                if left[fqn] <= 0:
                    st.live.discard(fqn)
                    self._ready.pop(fqn, None)
        finally:
            self._stop(window, pool)

    def _stop(self, window: deque[_Pending | SpanRun], pool: ThreadPoolExecutor) -> None:
        """The pool drained (after a failure: queued reads cancelled, staging waiters woken)."""
        for p in window:
            for f in p.futures if isinstance(p, SpanRun) else (b.future for b in p.batches):
                if f is not None:
                    f.cancel()
        self._open = None
        self._closing = True
        if self._ahead is not None:
            self._ahead.wake()
        pool.shutdown(wait=True, cancel_futures=True)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)

    def _admit(
        self,
        jobs: list[Job],
        i: int,
        planner: ItemPlanner,
        pool: ThreadPoolExecutor,
        st: _Admission,
        busy: bool,
    ) -> _Pending | SpanRun | None:
        """Job ``i`` (and, as a run, the ones after it) started, or None: it waits for a
        destination to finish. A streamed destination past the ``max_inflight`` live ones is
        read ahead as a run with no scratch yet, within the read-ahead budget."""
        fqn = jobs[i].item.dest_index.fqn
        if fqn in st.waiting:
            return None  # the rest of a destination read ahead waits for its scratch
        streamed = st.streams is not None and bool(st.streams(fqn))
        new = streamed and fqn not in st.live
        # an empty window admits anyway: a plan whose destinations are not grouped would
        # otherwise wait for itself
        if new and len(st.live) >= self.max_inflight and busy:
            run = None
            if st.ahead and (st.budget is None or st.ahead_bytes < st.budget):
                run = self._start_run(jobs, i, planner, pool, st)
            if run is not None:
                st.waiting[fqn] = run
                st.ahead_bytes += run.staging
            return run
        if new:
            st.live.add(fqn)
        # a plain destination goes as runs too, straight into its own tensor (the planner's
        # resolve_run says whether it can): per-item admission halved the read of a BF16 model
        unit = self._start_run(jobs, i, planner, pool) if st.runs else None
        return unit if unit is not None else self._start(jobs[i], planner, pool)

    def _attach_waiting(self, st: _Admission, window: deque, planner: RunPlanner) -> None:
        """Admit the runs read ahead, in plan order, while fewer than ``max_inflight`` scratches
        are live (or when the next one to complete is one of them: an ungrouped plan)."""
        while st.waiting:
            fqn, run = next(iter(st.waiting.items()))
            if len(st.live) >= self.max_inflight and not (window and window[0] is run):
                return
            del st.waiting[fqn]
            st.ahead_bytes -= run.staging
            st.live.add(fqn)
            self._attach(run, planner)

    def _attach(self, run: SpanRun, planner: RunPlanner) -> None:
        """A run read ahead gets its scratch (``resolve_run``, here, in plan order); the bytes
        staged so far are copied in, its later reads go straight to the scratch."""
        buf = planner.resolve_run(run.fqn)
        shape, dtype, device = run.layout
        if (
            buf is None
            or tuple(buf.shape) != shape
            or buf.dtype != dtype
            or buf.device.type != device.type
            or not buf.is_contiguous()
        ):
            got = None if buf is None else (tuple(buf.shape), buf.dtype, str(buf.device))
            raise CheckpointError(
                f"{run.fqn}: its reads were planned for a {shape} {dtype} buffer, got {got}"
            )
        to = self._target(run.fqn, buf)
        with run.lock:
            run.buf, run.to = buf, to
            staged, run.staged = run.staged, []
        staging = self._ahead
        assert staging is not None  # made with the run
        staging.wake()  # its tasks waiting for a staging buffer read into the scratch now
        if not staged:
            return
        ev = None
        try:  # every staged buffer's copies queued at once: one wait, one event
            ev = self._copy_out(to[1], to[2], staged)
        finally:
            for sbuf, _ in staged:
                self._settle(staging, sbuf, ev, to[1], held=True)
        if ev is not None:
            run.events.append(ev)

    def _target(self, fqn: str, buf: torch.Tensor) -> tuple[Any, torch.Tensor, Any]:
        """Where a run's bytes go in ``buf``: (what ``_read_spans`` writes, what ``_copy_out``
        copies into: the flat bytes on CUDA, ``buf`` itself on the host, where only its
        address counts; the event the device copies wait for, None on the host)."""
        if buf.device.type != "cuda":
            return byte_view(buf), buf, None
        flat = buf.view(-1).view(torch.uint8)
        self._prepare_cuda(buf.device)
        ready = self._ready.get(fqn)
        if ready is None:  # see _start: the copies wait for the scratch's allocation
            ready = self._ready[fqn] = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        return flat, flat, ready

    def _start_run(
        self,
        jobs: list[Job],
        i: int,
        planner: RunPlanner,
        pool: ThreadPoolExecutor,
        ahead: _Admission | None = None,
    ) -> SpanRun | None:
        """Jobs ``i``, ``i+1``, ... of one streamed destination as a run, as far as each is one
        contiguous span on both sides (None when job ``i`` is not: it goes item by item).

        ``ahead`` (the loop's state): the destination is not admitted; the run is planned from
        ``run_layout`` and read into staging buffers, or None when the read-ahead budget of its
        device is spent (it then waits, as without read-ahead)."""
        fqn = jobs[i].item.dest_index.fqn
        buf = None
        if ahead is None:
            buf = planner.resolve_run(fqn)
            if buf is None or not buf.is_contiguous() or buf.numel() == 0:
                return None
            layout = (tuple(buf.shape), buf.dtype, buf.device)
        else:
            got = planner.run_layout(fqn)
            if got is None or math.prod(got[0]) == 0:
                return None
            layout = (tuple(int(n) for n in got[0]), got[1], torch.device(got[2]))
            if ahead.budget is None:  # a host load (0 by default) stops asking here
                ahead.budget = self._ahead_budget.get(layout[2].type, 0)
            if ahead.ahead_bytes >= ahead.budget:
                return None
        items, spans = run_spans(jobs, i, fqn, layout)
        if not items:
            return None
        run = SpanRun(fqn, items, layout, nbytes=sum(sp[3] for sp in spans))
        if buf is not None:
            run.buf, run.to = buf, self._target(fqn, buf)
        else:
            self._staging(layout[2])
            # every read before it in plan order is queued before its tasks, which may wait
            # for staging buffers that only its admission gives back: the pool takes tasks in
            # order, so those reads never wait behind them (a deadlock otherwise)
            self._flush(pool)
        if spans:
            self.bytes_read += run.nbytes
            # a destination smaller than a piece per thread (an attention weight) is cut finer,
            # so that all threads read it: max_inflight keeps only a few destinations in flight.
            # Not when read ahead: its tasks fill whole staging buffers, and the threads have
            # the destinations after it to read meanwhile
            if buf is None:
                tasks = span_tasks(spans, self.chunk_bytes)
                # each task staged takes a whole buffer, however small it is
                run.staging = len(tasks) * self.chunk_bytes
            else:
                per_thread = -(-run.nbytes // self.threads)
                tasks = span_tasks(spans, min(self.chunk_bytes, max(MIN_TASK_BYTES, per_thread)))
            for task in tasks:
                run.futures.append(pool.submit(self._run_task, run, task))
        return run

    def _staging(self, device: torch.device) -> PinnedPool:
        """The pool the read-ahead stages in, made at the first run read ahead: on CUDA the
        pinned pool of the direct reads, grown by the budget in buffers of ``chunk_bytes`` (at
        least one) that only staging may keep (pinned when first needed, not before); on the
        host a pool of its own."""
        if self._ahead is None:
            n = max(1, self._ahead_budget.get(device.type, 0) // self.chunk_bytes)
            if device.type == "cuda":
                self._prepare_cuda(device)
                self._ahead = self._pinned()
            else:
                self._ahead = PinnedPool(self.chunk_bytes, 0, pin=False)
            self._ahead.add_holds(n)
            self.ahead_bytes = n * self.chunk_bytes
        return self._ahead

    def _complete_run(self, r: SpanRun, planner: RunPlanner) -> None:
        assert r.to is not None  # attached before it is completed
        events = [_result(f, r.fqn) for f in r.futures] + r.events
        if r.to[2] is not None:
            stream = torch.cuda.current_stream(r.to[1].device)
            for ev in events:
                if ev is not None:
                    stream.wait_event(ev)
        r.futures.clear()
        r.events.clear()
        planner.commit_run(r.items)

    def _start(self, job: Job, planner: ItemPlanner, pool: ThreadPoolExecutor) -> _Pending:
        st = job.locate() if job.locate is not None else None
        item = job.item
        if st is None or not fits(st, item):
            if job.inline is None:
                raise CheckpointError(f"{item.dest_index.fqn}: no way to read this item")
            return _Pending(job)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.size()) != tuple(item.lengths):
            raise CheckpointError(
                f"{item.dest_index.fqn}: read {tuple(item.lengths)} for a destination slice "
                f"of {tuple(target.size())}"
            )
        ready = None
        if target.device.type == "cuda":
            self._prepare_cuda(target.device)
            # the scratch may reuse memory that the current stream still quantizes from: the
            # copies into it wait for everything queued there until its first item started
            # (one event per destination: its scratch is allocated by then)
            fqn = item.dest_index.fqn
            ready = self._ready.get(fqn)
            if ready is None:
                ready = self._ready[fqn] = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(target.device))
        pieces = split_region(
            st, tuple(item.storage_offsets), tuple(item.lengths), target, self.chunk_bytes
        )
        self.bytes_read += sum(p.nbytes for p in pieces)
        pending = _Pending(job, target)
        for piece in pieces:
            if self._open is None:
                self._open = _Batch()
            b = self._open
            b.work.append((st, piece, ready))
            b.nbytes += piece.nbytes
            if not pending.batches or pending.batches[-1] is not b:
                pending.batches.append(b)
            if b.nbytes >= self.chunk_bytes or len(b.work) >= BATCH_PIECES:
                self._flush(pool)
        return pending

    def _flush(self, pool: ThreadPoolExecutor) -> None:
        if self._open is not None:
            self._open.future = pool.submit(self._read_batch, self._open.work)
            self._open = None

    def _complete(self, p: _Pending, planner: ItemPlanner) -> None:
        if p.target is None:
            assert p.job.inline is not None
            p.job.inline()
            return
        for b in p.batches:
            assert b.future is not None  # flushed before the window's head is waited for
            ev = b.future.result()
            if ev is not None and not b.waited:  # items sharing a batch: one wait is enough
                torch.cuda.current_stream(p.target.device).wait_event(ev)
                b.waited = True
        p.batches.clear()
        planner.commit_tensor(p.job.item, p.target)


def _result(f: Future, fqn: str) -> Any:
    """A read task's result; its failure (a short or unreadable file) names the tensor too."""
    try:
        return f.result()
    except CheckpointError as exc:
        raise CheckpointError(f"{fqn}: {exc}") from None
