"""Reading a DCP dir: the safe metadata, its data files checked, items served in plan order.

``check_data_files`` runs before any data is read: every file the metadata names must be a
regular file inside the checkpoint dir, long enough for the bytes the metadata says it holds.
That turns a truncated ``__0_0.distcp`` (which DCP reports as ``EOFError: EOFError``) into a
line that names the file, and keeps a FIFO in the dir from blocking the read forever.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.checkpoint.safe_metadata import SafeFileSystemReader, read_metadata_file
from qckpt.checkpoint.safetensors_io import require_regular
from qckpt.errors import CheckpointError, QckptError


def check_data_files(root: str | os.PathLike, md: Metadata) -> None:
    """Each data file of ``md`` is a regular file in ``root`` holding the bytes it should."""
    root = Path(root)
    need: dict[str, int] = {}
    for idx, info in (getattr(md, "storage_data", None) or {}).items():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", 0), getattr(info, "length", 0)
        if not isinstance(rel, str) or not rel or Path(rel).name != rel or rel in (".", ".."):
            raise CheckpointError(
                f"{root / '.metadata'}: {getattr(idx, 'fqn', idx)} is stored in {rel!r}, "
                "which is not a file of the checkpoint dir"
            )
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise CheckpointError(f"{root / '.metadata'}: bad storage range for {rel}")
        need[rel] = max(need.get(rel, 0), offset + length)
    for rel, end in sorted(need.items()):
        size = require_regular(root / rel)
        if size < end:
            raise CheckpointError(
                f"{root / rel}: truncated: the DCP metadata needs {end} bytes, the file has {size}"
            )


def read_checked_metadata(root: str | os.PathLike) -> Metadata:
    """The dir's ``.metadata`` (allow-list unpickler), its data files checked."""
    md = read_metadata_file(Path(root) / ".metadata")
    check_data_files(root, md)
    return md


class OrderedFileSystemReader(SafeFileSystemReader):
    """DCP dir reader (safe metadata) that serves read items in the plan's order.

    The stock ``read_data`` groups items per file, so the pieces of a destination saved by
    several ranks arrive far apart and a streaming scratch would stay alive in between. Here
    the plan is cut into runs of consecutive items of one file and each run is read by the stock
    code (no copy of its internals), so the order is the planner's.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.root = Path(path)
        self.bytes_read = 0
        self._md_cache: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._md_cache is None:
            md = super().read_metadata()
            check_data_files(self.root, md)
            self._md_cache = md
        self._md_cache.storage_meta.load_id = self.load_id
        return self._md_cache

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        run: list[Any] = []
        run_file = None
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if run and info.relative_path != run_file:
                self._read_run(run, run_file, planner)
                run = []
            run_file = info.relative_path
            run.append(item)
            self.bytes_read += int(info.length)
        if run:
            self._read_run(run, run_file, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_run(self, run: list[Any], rel: str | None, planner: LoadPlanner) -> None:
        try:
            super().read_data(LoadPlan(run), planner).wait()
        except QckptError:  # the planner's own errors (a NaN refused by a quantize, ...)
            raise
        except Exception as exc:  # torch.load / a short read inside DCP's reader
            what = str(exc).strip().splitlines()
            detail = f"{type(exc).__name__}: {what[0]}" if what else type(exc).__name__
            raise CheckpointError(f"{self.root / str(rel)}: cannot read ({detail})") from None
