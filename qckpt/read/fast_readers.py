"""The DCP and HF safetensors readers on the fast read path (``fast_read.FastReadEngine``).

Each is its plain reader (same metadata, same checks, same planning) with ``read_data``
replaced: every item becomes a ``fast_read.Job`` whose stored tensor is located from metadata
(a safetensors header's offsets; a DCP item's ``torch.save`` archive, parsed without
``torch.load``), and the engine reads them ahead in parallel while the planner's calls stay in
plan order on the calling thread. What cannot be located runs inline through the plain code:
DCP byte entries and unusual archives, a quantized source's codes and scales.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.errors import CheckpointError
from qckpt.read.dcp_reader import OrderedFileSystemReader
from qckpt.read.fast_io import Files
from qckpt.read.fast_read import DEFAULT_MAX_INFLIGHT, FastReadEngine
from qckpt.read.fast_spans import Job
from qckpt.read.hf_reader import HFPiece, HFSafetensorsReader
from qckpt.read.sources import SafetensorsSource
from qckpt.storage.slices import SafetensorsFetch
from qckpt.storage.torch_save import StoredTensor, locate_tensor


def _done() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


class FastReader:
    """What every fast reader adds to its plain twin: the read bounds, and one engine run of
    its jobs (``run_jobs``) that counts the bytes it read on the reader."""

    reader_kind = "fast"

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.max_inflight = max_inflight
        self.threads = threads
        self.inline_items = 0  # items the plain code read (no locatable tensor)
        self.read_ahead_bytes = 0  # the read-ahead's staging buffers (host bytes), if any

    def run_jobs(self, jobs: list[Job], planner: LoadPlanner, files: Files) -> None:
        """``jobs`` read by a fast read engine over ``files`` (closed after) within the
        reader's bounds; the bytes it read and its staging counted on the reader."""
        engine = FastReadEngine(files=files, max_inflight=self.max_inflight, threads=self.threads)
        try:
            engine.run(jobs, planner)
        finally:
            files.close()
            self.bytes_read += engine.bytes_read
            self.read_ahead_bytes = engine.ahead_bytes


class FastDCPReader(FastReader, OrderedFileSystemReader):
    """A DCP dir read on the fast path; ``OrderedFileSystemReader`` is its plain twin."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files = Files()
        located: dict[Any, StoredTensor | None] = {}
        self.run_jobs([self._job(i, planner, files, located) for i in plan.items], planner, files)
        return _done()

    def _job(self, item: Any, planner: LoadPlanner, files: Files, located: dict) -> Job:
        info = self.storage_data[item.storage_index]
        rel = info.relative_path

        def inline() -> None:
            self.inline_items += 1
            self.bytes_read += int(info.length)
            self._read_run([item], rel, planner)

        if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
            return Job(item, inline=inline)

        def locate() -> StoredTensor | None:
            key = item.storage_index
            if key not in located:
                path = str(self.root / rel)
                base, length = int(info.offset), int(info.length)
                read = functools.partial(_read_at, files, path, base, length)
                located[key] = locate_tensor(read, length, path, base)
            return located[key]

        return Job(item, locate=locate, inline=inline)


def _read_at(files: Files, path: str, base: int, length: int, pos: int, n: int) -> bytes:
    """``n`` bytes at ``pos`` of the item at ``base`` (clipped to the item)."""
    n = max(0, min(n, length - pos))
    return files.pread(path, base + pos, n) if n else b""


class FastHFReader(FastReader, HFSafetensorsReader):
    """An HF safetensors dir read on the fast path; ``HFSafetensorsReader`` is its plain twin."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._where: dict[str, tuple[str, int]] | None = None

    def _locations(self) -> dict[str, tuple[str, int]]:
        """Stored name -> (file, absolute offset of its data), from the headers."""
        if self._where is None:
            src = getattr(self, "stored_source", None) or SafetensorsSource(self.path)
            self._where = {e.name: (str(e.file), int(e.loc[0])) for e in src.stored()}
        return self._where

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files = Files()
        fetch = SafetensorsFetch(self.path, self.raw_index)
        try:
            jobs = [self._job(req, planner, fetch) for req in plan.items]
            self.run_jobs(jobs, planner, files)
        finally:
            files.close()
            self.bytes_read += fetch.bytes_read
            fetch.close()
        return _done()

    def _job(self, req: Any, planner: LoadPlanner, fetch: SafetensorsFetch) -> Job:
        if req.type == LoadItemType.BYTE_IO:
            raise CheckpointError(f"{req.dest_index.fqn}: safetensors hold no byte entries")
        piece: HFPiece = self.storage_data[req.storage_index]
        if piece.quant is not None:
            # codes and scales dequantized into the scratch by the plain code, at its turn
            self.inline_items += 1
            return Job(
                req, inline=functools.partial(self._inline_quant, req, piece, planner, fetch)
            )
        file, begin = self._locations()[piece.key]
        _, shape, dtype = self.raw_index[piece.key]
        # the item addresses the piece with its leading length-1 axes: same bytes
        st = StoredTensor(file, begin, dtype, (1,) * piece.lead + tuple(shape))
        return Job(req, locate=lambda: st)

    def _inline_quant(self, req: Any, piece: HFPiece, planner: Any, fetch: Any) -> None:
        self._read_quantized(req, piece, planner, fetch)
