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
from qckpt.storage.files import open_regular, require_regular
from qckpt.storage.safetensors import shape_fits

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
    problem = _structure_problem(md)
    if problem:
        raise CheckpointError(f"{path}: corrupt DCP metadata ({problem})")
    return md


def _sizes(x: Any) -> bool:
    return isinstance(x, tuple | list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x
    )


def _tensor_problem(name: str, m: Any) -> str:
    """What is wrong with one unpickled TensorStorageMetadata ("" when nothing)."""
    dtype = getattr(getattr(m, "properties", None), "dtype", None)
    size = getattr(m, "size", None)
    if not isinstance(dtype, torch.dtype):
        return f"{name} has no dtype"
    if not _sizes(size) or not shape_fits(size):
        return f"{name} has no valid size"
    chunks = getattr(m, "chunks", None)
    if not isinstance(chunks, list):
        return f"{name} has no chunk list"
    for c in chunks:
        offs, lens = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if not (_sizes(offs) and _sizes(lens) and len(offs) == len(lens) == len(size)):
            return f"{name} has a chunk that does not match its shape"
        if any(o + n > s for o, n, s in zip(offs, lens, size, strict=True)):
            return f"{name} has a chunk outside its shape {list(size)}"
    return ""


def _structure_problem(md: dcp_md.Metadata) -> str:
    """The unpickled objects have the fields and types the readers rely on ("" if so).

    The allow-list guarantees only the classes; a corrupt file can still build them with
    missing or mistyped fields, which would fail much later as an AttributeError.
    """
    sd = getattr(md, "state_dict_metadata", None)
    if not isinstance(sd, dict):
        return "no state_dict_metadata"
    for name, m in sd.items():
        if not isinstance(name, str):
            return "a non-string tensor name"
        if isinstance(m, dcp_md.TensorStorageMetadata):
            problem = _tensor_problem(name, m)
            if problem:
                return problem
        elif not isinstance(m, dcp_md.BytesStorageMetadata):
            return f"{name} has entry type {type(m).__name__}"
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):  # a filesystem checkpoint always says where data lie
        return "no storage_data map"
    for idx, info in storage.items():
        if not isinstance(getattr(idx, "fqn", None), str):
            return "a storage entry without a tensor name"
        if idx.fqn not in sd:
            return f"storage for {idx.fqn}, which the metadata does not list"
        rel, off, n = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not isinstance(rel, str) or not _sizes((off, n)):
            return f"{idx.fqn} has no valid file range"
    return ""


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
