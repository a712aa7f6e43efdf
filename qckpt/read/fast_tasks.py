"""The fast read's reader threads: what a pool task does with the byte spans it is given.

:class:`PoolReads` is the half of :class:`~qckpt.read.fast_read.FastReadEngine` that runs on
the pool's threads (the engine's loop, on the calling thread, is :mod:`qckpt.read.fast_read`):
a run's spans read straight into its buffer or, read ahead, into a staging buffer; an item's
pieces read with positional reads, on a GPU through the pinned pool and copied to the device on
the copy stream, each copy's event recorded for the calling stream to wait on. No planner call
happens here (the ordering invariant of :mod:`qckpt.read.fast_read`).

It keeps no state of its own: the engine's ``files``, ``chunk_bytes``, ``threads``, the pinned
pools (``_pool``, ``_ahead``), ``_copy_stream``, ``_local`` (per-thread buffers), ``_closing``
and ``_ready`` are the ones it reads.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from qckpt.errors import CheckpointError
from qckpt.read.fast_io import PinnedPool, byte_view, read_exact
from qckpt.read.fast_spans import (
    Piece,
    Span,
    SpanRun,
    stretches,
)
from qckpt.storage.torch_save import StoredTensor

PACK_ALIGN = 64  # byte alignment of each piece packed into a shared pinned buffer


class PoolReads:
    """The pool threads' side of the fast read engine (see the module doc)."""

    def _run_task(self, run: SpanRun, spans: list[Span]) -> Any:
        """One pool task of a run: straight into its scratch once it has one, else into a
        staging buffer (read ahead); a task that waited for a staging buffer while the run
        was admitted goes the direct way."""
        if run.to is None:
            staging = self._ahead
            assert staging is not None  # made with the run
            sbuf = staging.acquire(lambda: run.to is not None or self._closing, hold=True)
            if sbuf is not None:
                return self._stage(run, spans, sbuf)
            if run.to is None:
                raise CheckpointError(f"{run.fqn}: the load stopped before this read")
        dest, _, ready = run.to
        return self._read_spans(dest, spans, ready)

    def _stage(self, run: SpanRun, spans: list[Span], sbuf: torch.Tensor) -> Any:
        """``spans`` read back to back into ``sbuf``, left with the run for its admission, or
        copied out now when it was admitted meanwhile (its event returned)."""
        staging, ev, flat = self._ahead, None, None
        assert staging is not None
        try:
            self._read_back_to_back(sbuf, spans)
            with run.lock:
                if run.to is None:
                    run.staged.append((sbuf, spans))
                    sbuf = None  # the admission copies it out and gives it back
                    return None
                _, flat, ready = run.to
            ev = self._copy_out(flat, ready, [(sbuf, spans)])
            return ev
        finally:
            if sbuf is not None:
                self._settle(staging, sbuf, ev, flat, held=True)

    def _read_back_to_back(self, buf: torch.Tensor, spans: list[Span]) -> None:
        """``spans``' bytes read back to back into the host buffer ``buf``."""
        mv, at = byte_view(buf), 0
        for path, pos, _, n in spans:
            read_exact(self.files.fd(path), mv[at : at + n], pos, path)
            at += n

    def _read_spans(self, dest: Any, spans: list[Span], ready: Any) -> Any:
        """A run's spans read straight into the destination's bytes (host: ``dest`` is their
        memoryview), or packed into one pinned buffer and copied to the device (``dest``: the
        destination as flat bytes) with one copy per stretch contiguous in the destination."""
        if ready is None:
            for path, pos, off, n in spans:
                read_exact(self.files.fd(path), dest[off : off + n], pos, path)
            return None
        pool = self._pinned()
        pinned, ev = pool.acquire(), None
        assert pinned is not None
        try:
            self._read_back_to_back(pinned, spans)
            ev = self._copy_out(dest, ready, [(pinned, spans)])
        finally:
            self._settle(pool, pinned, ev, dest)
        return ev

    def _copy_out(
        self, flat: torch.Tensor, ready: Any, parts: list[tuple[torch.Tensor, list[Span]]]
    ) -> Any:
        """For each (buffer, spans) of ``parts``: the bytes of ``spans``, back to back in the
        buffer, copied to their places in ``flat`` (a buffer as flat bytes), one copy per
        stretch contiguous there; on CUDA queued on the copy stream after ``ready`` (the event
        after them returned), on the host (``flat``: any contiguous tensor over those bytes)
        done now."""
        if ready is None:
            # a plain memmove (ctypes lets go of the GIL): torch's copy_ spreads a few MiB over
            # its intra-op threads, which on a busy host wait for each other far longer
            dst = flat.data_ptr()
            for src, spans in parts:
                base = src.data_ptr()
                for off, at, n in stretches(spans):
                    ctypes.memmove(dst + off, base + at, n)
            return None
        stream = self._copy_stream
        with torch.cuda.device(flat.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            for src, spans in parts:
                for off, at, n in stretches(spans):
                    flat.narrow(0, off, n).copy_(src.narrow(0, at, n), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def _settle(
        self, pool: PinnedPool, buf: torch.Tensor, ev: Any, flat: Any, *, held: bool = False
    ) -> None:
        """``buf`` back to ``pool``; after a failure with copies from it possibly queued (a
        device destination), it waits for the copy stream's work so far."""
        if ev is None and isinstance(flat, torch.Tensor) and flat.device.type == "cuda":
            ev = self._record(self._copy_stream, flat.device)
        pool.release(buf, ev, held=held)

    def _raw(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def _rows(self, st: StoredTensor, p: Piece) -> torch.Tensor:
        """The piece's rows read into this thread's buffer, narrowed to the region."""
        raw = self._raw(p.nbytes)
        read_exact(self.files.fd(st.path), byte_view(raw), p.pos, st.path)
        blk = raw.view(st.dtype).view(p.src_shape) if p.nbytes else raw.view(st.dtype)
        for axis, (o, n) in enumerate(p.narrow, start=1):
            blk = blk.narrow(axis, o, n)
        return blk.view(p.target.shape) if blk.dim() != p.target.dim() else blk

    def _read_batch(self, work: list[tuple[StoredTensor, Piece, Any]]) -> Any:
        if work and work[0][1].target.device.type == "cuda":
            return self._read_packed(work)
        ev = None
        for st, piece, ready in work:
            ev = self._read_piece(st, piece, ready)
        return ev

    def _read_packed(self, work: list[tuple[StoredTensor, Piece, Any]]) -> Any:
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
                        mv = byte_view(buf)
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

    def _read_piece(self, st: StoredTensor, p: Piece, ready: Any) -> Any:
        if p.target.device.type != "cuda":
            if p.direct:
                read_exact(self.files.fd(st.path), byte_view(p.target), p.pos, st.path)
            else:
                p.target.copy_(self._rows(st, p))
            return None
        return self._read_to_device(st, p, ready)

    def _read_to_device(self, st: StoredTensor, p: Piece, ready: Any) -> Any:
        pool = self._pinned()
        buf = pool.acquire()
        try:
            tbytes = p.target.numel() * p.target.element_size()
            if p.whole and p.nbytes <= pool.nbytes:
                host = buf[: p.nbytes]
                read_exact(self.files.fd(st.path), byte_view(host), p.pos, st.path)
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
