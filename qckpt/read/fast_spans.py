"""How the fast read cuts its work: an item's region into pieces, a destination's items into spans.

* ``split_region``: the region of a stored tensor an item reads, as pieces of rows along its
  first axis longer than one (each piece one contiguous byte span of the file), at most
  ``chunk_bytes`` each;
* ``SpanRun`` / ``run_spans``: consecutive items of one streamed destination whose stored bytes
  and whose places in its buffer are each one contiguous span of the same dtype (the per-expert
  tensors of a fused parameter), as (file, position, buffer offset, bytes) spans, adjacent ones
  merged; ``span_tasks`` cuts them into pool tasks and ``stretches`` into the contiguous stretches
  of the buffer that one device copy each takes.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from qckpt.storage.torch_save import StoredTensor


@dataclass
class Job:
    """One read item: where its stored tensor lies (``locate``, called once when the item is
    admitted), or the plain code to run at its turn (``inline``: resolve, copy, commit)."""

    item: ReadItem
    locate: Callable[[], StoredTensor | None] | None = None
    inline: Callable[[], None] | None = None


# (file, file offset, byte offset in the destination buffer, bytes): one contiguous span each
Span = tuple[str, int, int, int]


MIN_TASK_BYTES = 1 << 20  # a run's pool task reads at least this much (unless it is smaller)


RUN_SPANS = 64  # spans per pool task at most (their bytes stay under CHUNK_BYTES too)


@dataclass(eq=False)
class SpanRun:
    """Consecutive plan items of one streamed destination whose stored bytes and whose places in
    its buffer are each one contiguous span of the same dtype (the per-expert tensors of a fused
    parameter): resolved in one planner call, read as byte spans by the pool (on CUDA: packed
    into pinned buffers, one copy per contiguous stretch of the destination), committed in one
    planner call. No tensor view per item on any thread.

    A run read ahead (its destination not yet admitted: ``max_inflight`` scratches are live) is
    planned from the planner's ``run_layout`` and has no buffer yet (``to`` is None): its tasks
    read into staging buffers (the engine's read-ahead pool, host memory) and leave them in
    ``staged``; when the calling thread admits it (``FastReadEngine._attach``: ``resolve_run``,
    in plan order) the staged bytes are copied into the scratch and the later tasks copy their
    own as before."""

    fqn: str
    items: list[ReadItem]
    layout: tuple[tuple[int, ...], torch.dtype, torch.device]
    nbytes: int = 0  # the bytes its spans read
    staging: int = 0  # read ahead: the staging it may take, a buffer per task (budget units)
    futures: list[Future] = field(default_factory=list)
    buf: torch.Tensor | None = None
    # where the bytes go once admitted: (what ``_read_spans`` writes into, the buffer as flat
    # bytes, the event its device copies wait for: None for a host buffer)
    to: tuple[Any, torch.Tensor, Any] | None = None
    staged: list[tuple[torch.Tensor, list[Span]]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)  # the staged bytes' copies (CUDA)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Piece:
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
) -> list[Piece]:
    """The region ``offsets``/``lengths`` of ``st`` as pieces of rows along its first axis
    longer than one (every axis before it has length 1, so each piece is one contiguous byte
    span of the file: the rows with their trailing axes whole, narrowed after the read)."""
    nd = len(st.shape)
    if math.prod(lengths) == 0:
        return []
    one = whole_tensor_piece(st, offsets, lengths, target, chunk_bytes)
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
        out.append(Piece(pos, (b - a) * row_src, shape, narrow, part, whole, direct))
    return out


def whole_tensor_piece(
    st: StoredTensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    target: torch.Tensor,
    chunk_bytes: int,
) -> Piece | None:
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
    return Piece(st.offset, nbytes, shape, (), part, True, direct)


def run_spans(
    jobs: list[Job], i: int, fqn: str, layout: tuple[tuple[int, ...], torch.dtype, Any]
) -> tuple[list[ReadItem], list[Span]]:
    """The run of jobs from ``i`` into a contiguous buffer of ``layout`` (shape, dtype): its
    items, and their (file, position, buffer offset, bytes) spans, adjacent ones merged."""
    shape, dtype = layout[0], layout[1]
    size = dtype.itemsize
    strides, total = [], 1
    for dim in reversed(shape):
        strides.append(total)
        total *= dim
    geom = (shape, tuple(reversed(strides)), total)
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
        elif fits(st, item):
            src = span(st.shape, tuple(item.storage_offsets), lengths)
        else:
            break
        dst = span(shape, tuple(item.dest_offsets), lengths, geom)
        if src is None or dst is None:
            break
        items.append(item)
        j += 1
        n = src[1] * size
        if n:
            add_span(spans, (st.path, st.offset + src[0] * size, dst[0] * size, n))
    return items, spans


def fits(st: StoredTensor, item: ReadItem) -> bool:
    offs, lens = tuple(item.storage_offsets), tuple(item.lengths)
    return len(st.shape) == len(offs) == len(lens) and all(
        o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(offs, lens, st.shape, strict=True)
    )


def span(
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


def add_span(spans: list[Span], sp: Span) -> None:
    """Append ``sp``, merged into the last span when it continues it in the file and in the
    destination (gate and up of one expert: adjacent in both)."""
    if spans:
        path, pos, off, n = spans[-1]
        if path == sp[0] and pos + n == sp[1] and off + n == sp[2]:
            spans[-1] = (path, pos, off, n + sp[3])
            return
    spans.append(sp)


def span_tasks(spans: list[Span], chunk: int) -> list[list[Span]]:
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


def stretches(spans: list[Span]) -> list[tuple[int, int, int]]:
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
