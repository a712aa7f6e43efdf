"""The checks an unpickled DCP ``.metadata`` must pass before anything reads by it: the fields
and types the readers rely on, and data files that hold the bytes it names.

The allow-list unpickler guarantees only the classes; a corrupt file can still build them with
missing or mistyped fields, which would fail much later as an AttributeError. Torch-free, so
that the full reader (``storage.dcp_metadata``, torch's classes) and ``inspect``'s light reader
(inert stand-ins) run the same checks; each says how to recognise its own classes (``Kinds``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qckpt.errors import CheckpointError
from qckpt.storage.files import require_regular
from qckpt.storage.safetensors import shape_fits


@dataclass(frozen=True, kw_only=True)
class Kinds:
    """How a reader tells its unpickled entries apart."""

    is_tensor: Callable[[Any], bool]  # a TensorStorageMetadata
    is_bytes: Callable[[Any], bool]  # a BytesStorageMetadata
    is_dtype: Callable[[Any], bool]  # a tensor's dtype


def sizes(x: Any) -> bool:
    return isinstance(x, tuple | list) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x
    )


def tensor_problem(name: str, m: Any, kinds: Kinds) -> str:
    """What is wrong with one unpickled TensorStorageMetadata ("" when nothing)."""
    dtype = getattr(getattr(m, "properties", None), "dtype", None)
    size = getattr(m, "size", None)
    if not kinds.is_dtype(dtype):
        return f"{name} has no dtype"
    if not sizes(size) or not shape_fits(size):
        return f"{name} has no valid size"
    chunks = getattr(m, "chunks", None)
    if not isinstance(chunks, list):
        return f"{name} has no chunk list"
    for c in chunks:
        offs, lens = getattr(c, "offsets", None), getattr(c, "sizes", None)
        if not (sizes(offs) and sizes(lens) and len(offs) == len(lens) == len(size)):
            return f"{name} has a chunk that does not match its shape"
        if any(o + n > s for o, n, s in zip(offs, lens, size, strict=True)):
            return f"{name} has a chunk outside its shape {list(size)}"
    return ""


def structure_problem(md: Any, kinds: Kinds) -> str:
    """The unpickled ``md`` has the fields and types the readers rely on ("" if so)."""
    sd = getattr(md, "state_dict_metadata", None)
    if not isinstance(sd, dict):
        return "no state_dict_metadata"
    for name, m in sd.items():
        if not isinstance(name, str):
            return "a non-string tensor name"
        if kinds.is_tensor(m):
            problem = tensor_problem(name, m, kinds)
            if problem:
                return problem
        elif not kinds.is_bytes(m):
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
        if not isinstance(rel, str) or not sizes((off, n)):
            return f"{idx.fqn} has no valid file range"
    return ""


def check_data_files(root: str | Path, md: Any) -> None:
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
