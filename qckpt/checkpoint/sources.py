"""Checkpoint sources: a DCP dir or an HF safetensors dir, behind one set of functions.

* ``detect_format(path)`` -> ``"dcp"`` | ``"safetensors"``.
* ``open_reader(path, format, model=...)`` -> a DCP ``StorageReader`` that serves items in plan
  order (what the streaming planner's memory bound needs) and counts ``bytes_read``.
* ``checkpoint_names_shapes(path)`` and ``iter_checkpoint_tensors(path)``: the state-dict view
  of a checkpoint, one whole tensor at a time (export, inspect, convert).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.checkpoint.hf_reader import HFSafetensorsReader, safetensors_files
from qckpt.checkpoint.safe_metadata import SafeFileSystemReader, is_dcp_dir
from qckpt.errors import CheckpointError, UsageError

FORMATS = ("auto", "dcp", "safetensors")


def detect_format(path: str | os.PathLike) -> str:
    """``dcp`` for a dir with ``.metadata``, ``safetensors`` for one with safetensors files."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"{p}: a checkpoint is a directory (DCP or HF safetensors)")
    if is_dcp_dir(p):
        return "dcp"
    if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file():
        return "safetensors"
    raise CheckpointError(f"{p}: neither a DCP checkpoint (.metadata) nor an HF safetensors dir")


def _resolve_format(path: str | os.PathLike, format: str) -> str:
    if format not in FORMATS:
        raise UsageError(f"checkpoint.format: must be one of {', '.join(FORMATS)}; got {format!r}")
    return detect_format(path) if format == "auto" else format


class OrderedFileSystemReader(SafeFileSystemReader):
    """DCP dir reader (safe metadata) that serves read items in the plan's order.

    The stock ``read_data`` groups items per file, so the pieces of a destination saved by
    several ranks arrive far apart and a streaming scratch would stay alive in between. Here
    the plan is cut into runs of consecutive items of one file and each run is read by the stock
    code (no copy of its internals), so the order is the planner's.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.bytes_read = 0
        self._md_cache: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._md_cache is None:
            self._md_cache = super().read_metadata()
        self._md_cache.storage_meta.load_id = self.load_id
        return self._md_cache

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        run: list[Any] = []
        run_file = None
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if run and info.relative_path != run_file:
                super().read_data(LoadPlan(run), planner).wait()
                run = []
            run_file = info.relative_path
            run.append(item)
            self.bytes_read += int(info.length)
        if run:
            super().read_data(LoadPlan(run), planner).wait()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def open_reader(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    model: nn.Module | None = None,
    expected: dict[str, torch.Size] | None = None,
) -> OrderedFileSystemReader | HFSafetensorsReader:
    """A plan-order storage reader for the checkpoint at ``path``.

    For HF dirs, ``model`` (or ``expected`` shapes) tells how per-expert tensors fuse.
    """
    fmt = _resolve_format(path, format)
    if fmt == "dcp":
        if not is_dcp_dir(path):
            raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata)")
        reader = OrderedFileSystemReader(path)
        _refuse_quantized_dcp(reader, path)
        return reader
    safetensors_files(path)  # a clear error for a dir without any
    model_type = None
    if model is not None:
        from qckpt.models.build import model_type as _mt

        model_type = _mt(model) or None
        if expected is None:
            expected = {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}
    return HFSafetensorsReader(path, model_type=model_type, expected=expected)


def _refuse_quantized_dcp(reader: OrderedFileSystemReader, path: str | os.PathLike) -> None:
    from qckpt.checkpoint.quantized_sources import refuse_quantized_dcp

    md = reader.read_metadata()
    refuse_quantized_dcp(
        {
            k: v.properties.dtype
            for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        },
        str(path),
    )


def checkpoint_names_shapes(
    path: str | os.PathLike, format: str = "auto"
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """State-dict name -> (shape, dtype) of every tensor of the checkpoint (metadata only)."""
    reader = open_reader(path, format)
    md = reader.read_metadata()
    return {
        k: (tuple(int(s) for s in v.size), v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def iter_checkpoint_tensors(
    path: str | os.PathLike, format: str = "auto", *, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, whole CPU tensor), one at a time, in checkpoint order.

    Each tensor is read through DCP on its own (one tensor in flight), so a checkpoint larger
    than RAM can be walked. Fused experts of an HF dir come assembled from their per-expert
    tensors. Non-tensor entries are skipped.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = open_reader(path, format)
    md = reader.read_metadata()
    wanted = None if names is None else set(names)
    for name, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata) or (
            wanted is not None and name not in wanted
        ):
            continue
        t = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_load(
                {name: t},
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        yield name, t
        del t
