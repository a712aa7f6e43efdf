"""DCP's ``.metadata`` read without running code from the checkpoint, its data files checked.

``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a crafted checkpoint would run its
own code the moment we look at it. Ours unpickles with an allow-list of DCP's metadata classes
and the few builtins and torch types they hold; anything else is refused with a one-line error.

``check_data_files`` runs before any data is read: every file the metadata names must be a
regular file inside the checkpoint dir, long enough for the bytes the metadata says it holds.
That turns a truncated ``__0_0.distcp`` (which DCP reports as ``EOFError: EOFError``) into a
line that names the file, and keeps a FIFO in the dir from blocking the read forever.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.metadata import Metadata

from qckpt.errors import CheckpointError
from qckpt.storage.dcp_structure import Kinds, check_data_files, structure_problem
from qckpt.storage.files import open_regular

_ALLOWED: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        dcp_md.Metadata,
        dcp_md.MetadataIndex,
        dcp_md.TensorStorageMetadata,
        dcp_md.BytesStorageMetadata,
        dcp_md.ChunkStorageMetadata,
        dcp_md.TensorProperties,
        dcp_md.StorageMeta,
        dcp_md._MEM_FORMAT_ENCODING,
        torch.Size,
    )
}
for _name in ("Metadata", "MetadataIndex", "StorageMeta"):
    _ALLOWED[("torch.distributed.checkpoint.metadata", _name)] = getattr(dcp_md, _name)
_ALLOWED.update(
    {
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("torch", "Size"): torch.Size,
        # StorageMeta keeps the checkpoint_id, which DCP may pickle as a path (inert data)
        ("pathlib", "PosixPath"): __import__("pathlib").PosixPath,
        ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,  # filled below
        ("torch.distributed.checkpoint.planner", "LoadItemType"): None,
        ("torch.distributed.checkpoint.planner", "WriteItemType"): None,
    }
)


def _fill_lazy() -> None:
    from torch.distributed.checkpoint import filesystem, planner

    _ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    _ALLOWED[("torch.distributed.checkpoint.planner", "LoadItemType")] = planner.LoadItemType
    _ALLOWED[("torch.distributed.checkpoint.planner", "WriteItemType")] = planner.WriteItemType
    # Megatron-Core caches every rank's save plan in the metadata (``all_local_plans``: seen in
    # the .metadata megatron-core 0.16.1 writes): DCP's own plain dataclasses, inert data
    for name in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData"):
        if hasattr(planner, name):
            _ALLOWED[("torch.distributed.checkpoint.planner", name)] = getattr(planner, name)
    for name in dir(torch):
        obj = getattr(torch, name)
        if isinstance(obj, torch.dtype):
            _ALLOWED[("torch", name)] = obj
    # layouts pickle as a call of this lookup-by-name function, which only returns layouts
    _ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    _ALLOWED[("torch", "layout")] = torch.layout
    _ALLOWED[("torch", "memory_format")] = torch.memory_format
    for name in ("strided", "sparse_coo", "contiguous_format", "preserve_format", "channels_last"):
        if hasattr(torch, name):
            _ALLOWED[("torch", name)] = getattr(torch, name)


_fill_lazy()


class InertStub:
    """A stand-in for a training framework's class pickled into ``.metadata`` (Megatron-Core's
    ``MCoreMetadata`` / ``MCoreSavePlan``): it keeps whatever state the pickle gives it as data
    and runs nothing; Megatron itself is never imported. Its state is still unpickled by the
    same allow-list, so a payload inside it is refused like anywhere else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


# Megatron-Core's dist_checkpointing/strategies/torch.py keeps these two as "dummy" classes so
# that checkpoints holding them still unpickle (mcore v0.15 checkpoints with optimizer states)
for _name in ("MCoreMetadata", "MCoreSavePlan"):
    _ALLOWED[("megatron.core.dist_checkpointing.strategies.torch", _name)] = type(
        _name, (InertStub,), {"__module__": __name__}
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")
        return obj


def read_metadata_file(path: str | os.PathLike) -> dcp_md.Metadata:
    """Unpickle a ``.metadata`` file with the allow-list; one-line CheckpointError otherwise."""
    path = Path(path)
    try:
        with open_regular(path) as f:  # a FIFO named .metadata must not block us
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read DCP metadata ({exc.strerror})") from None
    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: unsafe or corrupt DCP metadata: {exc}") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: corrupt DCP metadata ({type(exc).__name__})") from None
    if not isinstance(md, dcp_md.Metadata):
        raise CheckpointError(f"{path}: not DCP metadata (got {type(md).__name__})")
    problem = structure_problem(md, _KINDS)
    if problem:
        raise CheckpointError(f"{path}: corrupt DCP metadata ({problem})")
    return md


# the full reader's classes, for the shared checks (``storage.dcp_structure``)
_KINDS = Kinds(
    is_tensor=lambda m: isinstance(m, dcp_md.TensorStorageMetadata),
    is_bytes=lambda m: isinstance(m, dcp_md.BytesStorageMetadata),
    is_dtype=lambda d: isinstance(d, torch.dtype),
)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read admits only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank) if rank is not None else self._get_metadata_path()
        md = read_metadata_file(path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def read_checked_metadata(root: str | os.PathLike) -> Metadata:
    """The dir's ``.metadata`` (allow-list unpickler), its data files checked."""
    md = read_metadata_file(Path(root) / ".metadata")
    check_data_files(root, md)
    return md
