"""The fast read path: parallel positional reads of the stored bytes, overlapped with the
planner's work, in plan order.

DCP's plain reader handles one item at a time on one thread: ``torch.load`` of the whole
stored chunk (read, unpickle, allocate, copy), then a copy into the destination, then the
planner's commit (for a quantized destination at its last item: the quantize). Here:

* each item's source is a row-major tensor at a known byte offset of a file
  (``torch_save_layout.StoredTensor``: from the safetensors header, or from the ``torch.save``
  archive DCP wrote, found without ``torch.load``);
* the item's region is cut into pieces of at most ``chunk_bytes`` along its first axis longer
  than one, and a thread pool reads the pieces with ``os.preadv`` (no GIL held): straight into
  the destination when it is a contiguous host tensor of the stored dtype, else through a
  per-thread buffer (narrowed, cast) into it; for a CUDA destination through a bounded pool of
  pinned host buffers, each piece copied to the device on a copy stream
  (``non_blocking``), so host reads, host-to-device copies and the planner's quantize (on the
  current stream) overlap;
* ``max_inflight`` bounds how many quantized destinations (planner scratches) are live at
  once: the reads of the next destination go into its scratch while the previous one is
  quantized. The planner's transient is then at most ``max_inflight`` scratches
  (``max_inflight x 2*max(numel)`` for BF16), which the load report predicts.

THE ORDERING INVARIANT (relied on by the planner's ``_finish``, which may run collectives, such
as a group-reduced amax of a sharded parameter): every planner call (``resolve_tensor``,
``commit_tensor``, ``load_bytes``, hence ``_finish``) happens on the calling thread, and
``commit_tensor`` / ``load_bytes`` in exactly the plan's order (which ``finish_plan`` groups by
fqn), the same on every rank. Only the byte reads and host-to-device copies run ahead on other
threads; ``resolve_tensor`` runs ahead of commits (on the calling thread, in plan order too),
which is how a scratch is allocated before its bytes arrive. Quantization stays on the calling
thread, so the kernel policy (a context variable) applies to it as set by the caller.
``tests/unit/test_fast_read.py`` pins this down.

Items whose source cannot be described that way (a compressed or unusual archive, a quantized
source's codes and scales, a byte entry) run inline, on the calling thread at their turn, by
the plain code.
"""

from __future__ import annotations

import ctypes
import math
import operator
import os
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from qckpt import phases
from qckpt.checkpoint.safetensors_io import open_regular
from qckpt.checkpoint.torch_save_layout import StoredTensor
from qckpt.errors import CheckpointError

CHUNK_BYTES = 16 << 20  # one read piece: large enough for full-speed reads, small to overlap
DEFAULT_MAX_INFLIGHT = 1
WINDOW_ITEMS = 256
BATCH_PIECES = 32  # small pieces per pool task (their bytes stay under CHUNK_BYTES too)
# on an H200 host 4 threads read the 8-layer Qwen3-30B-A3B shape faster than 16 (1.54 vs 1.78 s):
# past a few threads the readers' per-piece Python contends for the GIL
MAX_THREADS = 8
PACK_ALIGN = 64  # byte alignment of each piece packed into a shared pinned buffer


def default_threads() -> int:
    """Reader threads when none are asked for: the cores, at least 2, at most 8."""
    return max(2, min(MAX_THREADS, os.cpu_count() or 2))


@dataclass
class Job:
    """One read item: where its stored tensor lies (``locate``, called once when the item is
    admitted), or the plain code to run at its turn (``inline``: resolve, copy, commit)."""

    item: ReadItem
    locate: Callable[[], StoredTensor | None] | None = None
    inline: Callable[[], None] | None = None


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


# (file, file offset, byte offset in the destination buffer, bytes): one contiguous span each
Span = tuple[str, int, int, int]
MIN_TASK_BYTES = 1 << 20  # a run's pool task reads at least this much (unless it is smaller)
RUN_SPANS = 64  # spans per pool task at most (their bytes stay under CHUNK_BYTES too)


@dataclass(eq=False)
class _Run:
    """Consecutive plan items of one streamed destination whose stored bytes and whose places in
    its buffer are each one contiguous span of the same dtype (the per-expert tensors of a fused
    parameter): resolved in one planner call, read as byte spans by the pool (on CUDA: packed
    into pinned buffers, one copy per contiguous stretch of the destination), committed in one
    planner call. No tensor view per item on any thread."""

    fqn: str
    buf: torch.Tensor
    items: list[ReadItem]
    futures: list[Future] = field(default_factory=list)


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


def _byte_view(t: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous host tensor (the caller keeps ``t`` alive). Not
    ``numpy()``: that would mark a scratch's storage unresizable, and the planner frees a
    scratch by resizing its storage to 0."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class PinnedPool:
    """At most ``count`` pinned host buffers of ``nbytes``, each reused once its last
    host-to-device copy is done (the event recorded after it)."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[torch.Tensor, Any]] = []
        self._made = 0
        self._count = count
        self._cv = threading.Condition()

    def acquire(self) -> torch.Tensor:
        with self._cv:
            while not self._free and self._made >= self._count:
                self._cv.wait()
            if self._free:
                buf, ev = self._free.pop()
            else:
                self._made += 1
                buf, ev = None, None
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        if ev is not None:
            ev.synchronize()  # its previous copy has left the buffer
        return buf

    def release(self, buf: torch.Tensor, event: Any) -> None:
        with self._cv:
            self._free.append((buf, event))
            self._cv.notify()


@dataclass(frozen=True)
class _Piece:
    """Rows [a, b) along the split axis of an item's region."""

    pos: int  # file offset of the first byte
    nbytes: int
    src_shape: tuple[int, ...]  # the rows as stored (full trailing axes)
    narrow: tuple[tuple[int, int], ...]  # (offset, length) per trailing axis
    target: torch.Tensor  # where the rows go
    whole: bool  # the stored rows are the region's rows (trailing axes whole, same dtype)
    direct: bool  # ... and the target is a contiguous host tensor: read straight into it


def split_region(
    st: StoredTensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    target: torch.Tensor,
    chunk_bytes: int,
) -> list[_Piece]:
    """The region ``offsets``/``lengths`` of ``st`` as pieces of rows along its first axis
    longer than one (every axis before it has length 1, so each piece is one contiguous byte
    span of the file: the rows with their trailing axes whole, narrowed after the read)."""
    nd = len(st.shape)
    if math.prod(lengths) == 0:
        return []
    one = _whole_tensor_piece(st, offsets, lengths, target, chunk_bytes)
    if one is not None:
        return [one]
    k = next((i for i, n in enumerate(lengths) if n > 1), max(nd - 1, 0))
    strides = [math.prod(st.shape[i + 1 :]) for i in range(nd)]
    item = st.dtype.itemsize
    trail = tuple(st.shape[k + 1 :])
    row_src = math.prod(trail) * item
    row_dst = math.prod(lengths[k + 1 :]) * target.element_size()
    rows = lengths[k] if nd else 1
    step = max(1, chunk_bytes // max(row_src, row_dst, 1))
    tgt = target[(0,) * k] if k else target
    base = sum(offsets[i] * strides[i] for i in range(k))
    narrow = tuple(zip(offsets[k + 1 :], lengths[k + 1 :], strict=True))
    whole = tuple(lengths[k + 1 :]) == trail and st.dtype == target.dtype
    out = []
    for a in range(0, rows, step):
        b = min(rows, a + step)
        first = base + ((offsets[k] + a) * strides[k] if nd else 0)
        part = tgt.narrow(0, a, b - a) if nd else tgt
        direct = whole and part.device.type == "cpu" and part.is_contiguous()
        shape = ((b - a),) + trail if nd else ()
        pos = st.offset + first * item
        out.append(_Piece(pos, (b - a) * row_src, shape, narrow, part, whole, direct))
    return out


def _whole_tensor_piece(
    st: StoredTensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    target: torch.Tensor,
    chunk_bytes: int,
) -> _Piece | None:
    """The common item (a whole stored tensor, such as one expert of a fused parameter, into a
    destination of its dtype) as its one piece without the general path's narrows: a load of
    20k such items spends its time on the calling thread, per item."""
    if st.shape != lengths or any(offsets) or st.dtype != target.dtype:
        return None
    nbytes = math.prod(lengths) * st.dtype.itemsize
    if nbytes > chunk_bytes:
        return None
    k = next((i for i, n in enumerate(lengths) if n > 1), None)
    if k is None or not target.is_contiguous():
        return None  # a scalar or one element: the general path's shapes
    shape = lengths[k:]
    part = target.view(shape)
    direct = part.device.type == "cpu"
    return _Piece(st.offset, nbytes, shape, (), part, True, direct)


class FastReadEngine:
    """Runs a plan's jobs: reads ahead on a thread pool, planner calls in plan order here."""

    def __init__(
        self,
        *,
        files: Files,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        threads: int | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.files = files
        self.max_inflight = int(max_inflight)
        self.threads = int(threads or default_threads())
        self.chunk_bytes = int(chunk_bytes or CHUNK_BYTES)
        # items admitted ahead of the one committed: many, since small items (one expert of a
        # fused tensor) need many in flight to keep the threads busy; the memory they hold is
        # bounded elsewhere (max_inflight scratches, the pinned pool)
        self.window = WINDOW_ITEMS
        self.bytes_read = 0
        self._local = threading.local()
        self._pool: PinnedPool | None = None
        self._copy_stream: Any = None
        self._open: _Batch | None = None  # the batch being filled, not yet submitted
        self._ready: dict[str, Any] = {}  # fqn -> the event its copies wait for (CUDA)

    # ---- the calling thread ---------------------------------------------------------------

    def run(self, jobs: list[Job], planner: Any) -> None:
        """Every job's item read, resolved and committed, commits in the jobs' order.

        Python's cyclic collector is off meanwhile: the read allocates a few objects per item
        that live until their commit, so a 20k-item read set off several full collections,
        each a walk over the whole heap (the model, torch, transformers: ~0.3 s apiece on a
        loaded host), which grew the per-item cost with the number of items."""
        with phases.gc_paused():
            self._run(jobs, planner)

    def _run(self, jobs: list[Job], planner: Any) -> None:
        left = Counter(j.item.dest_index.fqn for j in jobs)
        streams = getattr(planner, "streams", None)
        runs = hasattr(planner, "resolve_run") and hasattr(planner, "commit_run")
        live: set[str] = set()  # destinations with a scratch admitted and not yet finished
        window: deque[_Pending | _Run] = deque()
        held = 0  # window slots taken: an item, or a whole run (its reads go through the pool)
        nxt = done = 0
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qckpt-read")
        try:
            while done < len(jobs):
                while nxt < len(jobs) and held < self.window:
                    fqn = jobs[nxt].item.dest_index.fqn
                    streamed = streams is not None and bool(streams(fqn))
                    new = streamed and fqn not in live
                    # an empty window admits anyway: a plan whose destinations are not grouped
                    # would otherwise wait for itself
                    if new and len(live) >= self.max_inflight and window:
                        break
                    if new:
                        live.add(fqn)
                    unit = self._start_run(jobs, nxt, planner, pool) if streamed and runs else None
                    if unit is None:
                        unit = self._start(jobs[nxt], planner, pool)
                    window.append(unit)
                    held += 1
                    nxt += len(unit.items) if isinstance(unit, _Run) else 1
                head = window[0]
                if isinstance(head, _Pending) and self._open is not None:
                    if self._open in head.batches:
                        self._flush(pool)  # the item waited for next is in it
                p = window.popleft()
                held -= 1
                if isinstance(p, _Run):
                    self._complete_run(p, planner)
                    fqn, n = p.fqn, len(p.items)
                else:
                    self._complete(p, planner)
                    fqn, n = p.job.item.dest_index.fqn, 1
                done += n
                left[fqn] -= n
                if left[fqn] <= 0:
                    live.discard(fqn)
                    self._ready.pop(fqn, None)
        finally:
            for p in window:
                for f in p.futures if isinstance(p, _Run) else (b.future for b in p.batches):
                    if f is not None:
                        f.cancel()
            self._open = None
            pool.shutdown(wait=True, cancel_futures=True)
            if self._copy_stream is not None:
                torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)

    def _start_run(
        self, jobs: list[Job], i: int, planner: Any, pool: ThreadPoolExecutor
    ) -> _Run | None:
        """Jobs ``i``, ``i+1``, ... of one streamed destination as a run, as far as each is one
        contiguous span on both sides (None when job ``i`` is not: it goes item by item)."""
        fqn = jobs[i].item.dest_index.fqn
        buf = planner.resolve_run(fqn)
        if buf is None or not buf.is_contiguous() or buf.numel() == 0:
            return None
        shape, size, dtype = tuple(buf.shape), buf.element_size(), buf.dtype
        geom = (shape, buf.stride(), buf.numel())
        items: list[ReadItem] = []
        spans: list[Span] = []
        j = i
        while j < len(jobs):  # by index: a slice of the rest per run is quadratic in items
            job = jobs[j]
            item = job.item
            if item.dest_index.fqn != fqn or job.locate is None:
                break
            st = job.locate()
            if st is None or st.dtype != dtype:
                break
            lengths = tuple(item.lengths)
            if st.shape == lengths and not any(item.storage_offsets):
                src = (0, math.prod(lengths))  # the whole stored tensor (an expert)
            elif _fits(st, item):
                src = _span(st.shape, tuple(item.storage_offsets), lengths)
            else:
                break
            dst = _span(shape, tuple(item.dest_offsets), lengths, geom)
            if src is None or dst is None:
                break
            items.append(item)
            j += 1
            n = src[1] * size
            if n:
                _add_span(spans, (st.path, st.offset + src[0] * size, dst[0] * size, n))
        if not items:
            return None
        ready = None
        if buf.device.type == "cuda":
            self._prepare_cuda(buf.device)
            ready = self._ready.get(fqn)
            if ready is None:  # see _start: the copies wait for the scratch's allocation
                ready = self._ready[fqn] = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(buf.device))
        run = _Run(fqn, buf, items)
        if spans:
            total = sum(sp[3] for sp in spans)
            self.bytes_read += total
            # a destination smaller than a piece per thread (an attention weight) is cut finer,
            # so that all threads read it: max_inflight keeps only a few destinations in flight
            chunk = min(self.chunk_bytes, max(MIN_TASK_BYTES, -(-total // self.threads)))
            dest = buf.view(-1).view(torch.uint8) if ready is not None else _byte_view(buf)
            for task in _tasks(spans, chunk):
                run.futures.append(pool.submit(self._read_spans, dest, task, ready))
        return run

    def _complete_run(self, r: _Run, planner: Any) -> None:
        for f in r.futures:
            ev = f.result()
            if ev is not None:
                torch.cuda.current_stream(r.buf.device).wait_event(ev)
        r.futures.clear()
        planner.commit_run(r.items)

    def _start(self, job: Job, planner: Any, pool: ThreadPoolExecutor) -> _Pending:
        st = job.locate() if job.locate is not None else None
        item = job.item
        if st is None or not _fits(st, item):
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

    def _complete(self, p: _Pending, planner: Any) -> None:
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

    # ---- reader threads -------------------------------------------------------------------

    def _read_spans(self, dest: Any, spans: list[Span], ready: Any) -> Any:
        """A run's spans read straight into the destination's bytes (host: ``dest`` is their
        memoryview), or packed into one pinned buffer and copied to the device (``dest``: the
        destination as flat bytes) with one copy per stretch contiguous in the destination."""
        if ready is None:
            for path, pos, off, n in spans:
                read_exact(self.files.fd(path), dest[off : off + n], pos, path)
            return None
        pool, stream = self._pinned(), self._copy_stream
        pinned, ev = pool.acquire(), None
        try:
            mv, at = _byte_view(pinned), 0
            for path, pos, _, n in spans:
                read_exact(self.files.fd(path), mv[at : at + n], pos, path)
                at += n
            with torch.cuda.device(dest.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                for off, at, n in _stretches(spans):
                    dest.narrow(0, off, n).copy_(pinned.narrow(0, at, n), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
        finally:
            # on a failure after some copies were queued, the buffer waits for them
            pool.release(pinned, ev if ev is not None else self._record(stream, dest.device))
        return ev

    def _raw(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def _rows(self, st: StoredTensor, p: _Piece) -> torch.Tensor:
        """The piece's rows read into this thread's buffer, narrowed to the region."""
        raw = self._raw(p.nbytes)
        read_exact(self.files.fd(st.path), _byte_view(raw), p.pos, st.path)
        blk = raw.view(st.dtype).view(p.src_shape) if p.nbytes else raw.view(st.dtype)
        for axis, (o, n) in enumerate(p.narrow, start=1):
            blk = blk.narrow(axis, o, n)
        return blk.view(p.target.shape) if blk.dim() != p.target.dim() else blk

    def _read_batch(self, work: list[tuple[StoredTensor, _Piece, Any]]) -> Any:
        if work and work[0][1].target.device.type == "cuda":
            return self._read_packed(work)
        ev = None
        for st, piece, ready in work:
            ev = self._read_piece(st, piece, ready)
        return ev

    def _read_packed(self, work: list[tuple[StoredTensor, _Piece, Any]]) -> Any:
        """A batch's whole pieces read one after another into shared pinned buffers, each
        copied to the device as soon as it is read: one buffer, one event for many small
        pieces (a buffer and an event per 3 MB expert cost more than its read). Every copy
        runs on the one copy stream, so the last event covers the whole batch. The Python
        per piece is kept short: the readers share the GIL with the calling thread."""
        pool, stream = self._pinned(), self._copy_stream
        device = work[0][1].target.device
        buf, mv, used, ev, waited = None, None, 0, None, set()
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for st, p, ready in work:
                    used = -(-used // PACK_ALIGN) * PACK_ALIGN  # each piece's view aligned
                    fits = p.whole and p.target.device == device and p.nbytes <= pool.nbytes
                    if buf is not None and (not fits or used + p.nbytes > pool.nbytes):
                        ev = self._record(stream, device)
                        pool.release(buf, ev)
                        buf = None
                    if not fits:  # a CPU piece gives no event: the batch's last one counts
                        ev = self._read_piece(st, p, ready) or ev
                        continue
                    if buf is None:
                        buf, used = pool.acquire(), 0
                        mv = _byte_view(buf)
                    read_exact(self.files.fd(st.path), mv[used : used + p.nbytes], p.pos, st.path)
                    host = buf[used : used + p.nbytes].view(st.dtype).view(p.target.shape)
                    used += p.nbytes
                    if id(ready) not in waited:
                        stream.wait_event(ready)
                        waited.add(id(ready))
                    p.target.copy_(host, non_blocking=True)
                if buf is not None:
                    ev = self._record(stream, device)
                    pool.release(buf, ev)
                    buf = None
        finally:
            if buf is not None:  # a read failed: the buffer waits for what was queued from it
                pool.release(buf, self._record(stream, device))
        return ev

    @staticmethod
    def _record(stream: Any, device: torch.device) -> Any:
        with torch.cuda.device(device):
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def _read_piece(self, st: StoredTensor, p: _Piece, ready: Any) -> Any:
        if p.target.device.type != "cuda":
            if p.direct:
                read_exact(self.files.fd(st.path), _byte_view(p.target), p.pos, st.path)
            else:
                p.target.copy_(self._rows(st, p))
            return None
        return self._read_to_device(st, p, ready)

    def _read_to_device(self, st: StoredTensor, p: _Piece, ready: Any) -> Any:
        pool = self._pinned()
        buf = pool.acquire()
        try:
            tbytes = p.target.numel() * p.target.element_size()
            if p.whole and p.nbytes <= pool.nbytes:
                host = buf[: p.nbytes]
                read_exact(self.files.fd(st.path), _byte_view(host), p.pos, st.path)
                src = host.view(st.dtype).view(p.target.shape)
            elif tbytes <= pool.nbytes:
                src = buf[:tbytes].view(p.target.dtype).view(p.target.shape)
                src.copy_(self._rows(st, p))
            else:  # one row larger than a pinned buffer: a synchronous copy from pageable memory
                src = self._rows(st, p)
            stream = self._copy_stream
            with torch.cuda.device(p.target.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                p.target.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
        except BaseException:
            pool.release(buf, None)
            raise
        pool.release(buf, ev)
        return ev

    def _pinned(self) -> PinnedPool:
        assert self._pool is not None
        return self._pool

    def _prepare_cuda(self, device: torch.device) -> None:
        """Pinned buffers (one per thread, two spare) and a copy stream, made at the first
        CUDA destination."""
        if self._pool is None:
            self._pool = PinnedPool(self.chunk_bytes, self.threads + 2)
            self._copy_stream = torch.cuda.Stream(device=device)


def _fits(st: StoredTensor, item: ReadItem) -> bool:
    offs, lens = tuple(item.storage_offsets), tuple(item.lengths)
    return len(st.shape) == len(offs) == len(lens) and all(
        o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(offs, lens, st.shape, strict=True)
    )


def _span(
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    geom: tuple[tuple[int, ...], tuple[int, ...], int] | None = None,
) -> tuple[int, int] | None:
    """(first element, elements) of the region ``offsets``/``lengths`` of a row-major tensor of
    ``shape`` when it is one contiguous run of elements (every axis after the first one longer
    than 1 taken whole), else None. ``geom``: (shape, strides, numel), precomputed by a caller
    that asks about many regions of one tensor."""
    nd = len(shape)
    if len(offsets) != nd or len(lengths) != nd:
        return None
    k = 0
    while k < nd and lengths[k] == 1:
        k += 1
    if lengths[k + 1 :] != shape[k + 1 :] or any(offsets[k + 1 :]):
        return None
    if geom is None:
        strides, total = [], 1
        for dim in reversed(shape):
            strides.append(total)
            total *= dim
        geom = (shape, tuple(reversed(strides)), total)
    first = sum(map(operator.mul, offsets, geom[1]))
    n = math.prod(lengths)
    return (first, n) if first + n <= geom[2] else None


def _add_span(spans: list[Span], sp: Span) -> None:
    """Append ``sp``, merged into the last span when it continues it in the file and in the
    destination (gate and up of one expert: adjacent in both)."""
    if spans:
        path, pos, off, n = spans[-1]
        if path == sp[0] and pos + n == sp[1] and off + n == sp[2]:
            spans[-1] = (path, pos, off, n + sp[3])
            return
    spans.append(sp)


def _tasks(spans: list[Span], chunk: int) -> list[list[Span]]:
    """The spans as pool tasks of at most ``chunk`` bytes (a pinned buffer) and ``RUN_SPANS``
    spans each, a span longer than ``chunk`` cut into pieces."""
    out: list[list[Span]] = []
    cur: list[Span] = []
    used = 0
    for path, pos, off, n in spans:
        while n > 0:
            if used >= chunk or len(cur) >= RUN_SPANS:
                out.append(cur)
                cur, used = [], 0
            take = min(n, chunk - used)
            cur.append((path, pos, off, take))
            used += take
            pos, off, n = pos + take, off + take, n - take
    if cur:
        out.append(cur)
    return out


def _stretches(spans: list[Span]) -> list[tuple[int, int, int]]:
    """(destination offset, offset in the packed buffer, bytes) of each stretch of ``spans``
    that is contiguous in the destination (the buffer holds the spans back to back)."""
    out: list[tuple[int, int, int]] = []
    at = 0
    for _, _, off, n in spans:
        if out and out[-1][0] + out[-1][2] == off:
            o, a, m = out[-1]
            out[-1] = (o, a, m + n)
        else:
            out.append((off, at, n))
        at += n
    return out
