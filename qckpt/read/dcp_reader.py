"""Reading a DCP dir through DCP: the safe metadata, items served in plan order.

:class:`OrderedFileSystemReader` is DCP's file-system reader with the allow-list unpickler and
the data-file checks of :mod:`qckpt.storage.dcp_metadata`, serving read items in the plan's
order; ``refuse_quantized_metadata`` refuses a DCP dir that holds FP8 codes or scales.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.errors import CheckpointError, QckptError
from qckpt.storage.dcp_metadata import SafeFileSystemReader
from qckpt.storage.dcp_structure import check_data_files


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


def refuse_quantized_metadata(md: Any, path: str | os.PathLike) -> None:
    """A DCP dir holding FP8 codes or scales: no layout says how to read them; refuse."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from qckpt.layouts.registry import refuse_quantized_dcp

    refuse_quantized_dcp(
        {
            k: v.properties.dtype
            for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        },
        str(path),
    )
