"""Safetensors files read: the dtype table, headers, and which files hold an HF dir.

* the dtype table (safetensors code <-> byte size <-> torch dtype);
* ``read_header``: the 8-byte length + JSON header, parsed and validated here (an object; every
  entry with a known dtype, a shape, offsets inside the file whose length matches the shape);
* ``read_index`` / ``list_files``: which files of an HF dir hold the tensors, with one
  precedence everywhere: the index's files, else ``model.safetensors``, else every
  ``*.safetensors`` of the dir.

Writing is :mod:`qckpt.storage.shards`. Importing this module does not import torch: ``qckpt
inspect`` of an HF dir and ``qckpt check`` read headers only. Every failure is a one-line
:class:`CheckpointError` that names the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qckpt.errors import CheckpointError
from qckpt.storage.files import json_type, open_regular, read_json, require_regular

if TYPE_CHECKING:
    import torch


INDEX_NAME = "model.safetensors.index.json"


SINGLE_NAME = "model.safetensors"


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


# safetensors dtype code -> (bytes per element, torch dtype attribute)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U64": (8, "uint64"),
    "U32": (4, "uint32"),
    "U16": (2, "uint16"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
}


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors code (or of a ``torch.xxx`` name a DCP source gives)."""
    import torch

    attr = DTYPES[code][1] if code in DTYPES else code.removeprefix("torch.")
    dt = getattr(torch, attr, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"dtype {code} has no torch equivalent here")
    return dt


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype; ``torch.xxx`` for one safetensors cannot store."""
    attr = str(dtype).removeprefix("torch.")
    for code, (_, a) in DTYPES.items():
        if a == attr:
            return code
    return str(dtype)


def itemsize(code: str) -> int:
    if code in DTYPES:
        return DTYPES[code][0]
    return torch_dtype(code).itemsize


def _quote(name: object) -> str:
    """A tensor or file name as it appears in a message: one line, bounded length."""
    s = json.dumps(name) if not isinstance(name, str) else json.dumps(name)[1:-1]
    return s if len(s) <= 120 else s[:117] + "..."


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: list[TensorInfo]  # in file order (by data offset)
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the header of one safetensors file without reading tensor data."""
    p = Path(path)
    with open_regular(p) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{p}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{p}: safetensors header of {n} bytes is not plausible")
        if n > size - 8:
            raise CheckpointError(
                f"{p}: truncated: its header claims {n} bytes, the file has {size - 8} after "
                "the length"
            )
        text = f.read(n)
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{p}: corrupt safetensors header (not JSON)") from None
    except RecursionError:
        raise CheckpointError(f"{p}: corrupt safetensors header (nested too deeply)") from None
    return parse_header(obj, p, data_start=8 + n, file_size=size)


def parse_header(obj: object, path: Path, *, data_start: int, file_size: int) -> Header:
    """Validate a decoded header against the file it came from."""
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{path}: safetensors header is a JSON {json_type(obj)}, not an object"
        )
    meta = obj.get("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ is not a map of strings")
    tensors = [
        _tensor_info(name, info, path, data_start, file_size)
        for name, info in obj.items()
        if name != "__metadata__"
    ]
    tensors.sort(key=lambda t: (t.begin, t.end))
    for a, b in zip(tensors, tensors[1:], strict=False):
        if b.begin < a.end:
            raise CheckpointError(
                f"{path}: tensors {_quote(a.name)} and {_quote(b.name)} overlap in the file"
            )
    return Header(path, tensors, dict(meta), data_start, file_size)


def shape_fits(shape: Sequence[int]) -> bool:
    """torch multiplies every dim (zeros only at the end), so even an empty tensor's other
    dims must multiply to less than 2**63."""
    return math.prod(max(int(s), 1) for s in shape) < 2**63


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_info(
    name: str, info: object, path: Path, data_start: int, file_size: int
) -> TensorInfo:
    # the common case in as few Python steps as possible (a large MoE's header lists tens of
    # thousands of tensors, each validated here); any doubt goes to _bad_info for the message
    try:
        code, shape, offs = info["dtype"], info["shape"], info["data_offsets"]  # type: ignore[index]
        if type(shape) is not list or type(offs) is not list:
            raise TypeError
        b, e = offs
        size = DTYPES[code][0]
        for d in shape:
            if type(d) is not int or d < 0:
                raise TypeError
            size *= d
        if type(b) is not int or type(e) is not int or not 0 <= b <= e:
            raise TypeError
    except (TypeError, KeyError, ValueError):
        _bad_info(name, info, path)
        raise AssertionError("unreachable") from None
    begin, end = data_start + b, data_start + e
    if end > file_size or end - begin != size or (size == 0 and not shape_fits(shape)):
        _bad_info(name, info, path, data_start, file_size)
    return TensorInfo(name, code, tuple(shape), begin, end)


def _bad_info(
    name: str, info: object, path: Path, data_start: int = 0, file_size: int | None = None
) -> None:
    """Raise the one-line error for a header entry that failed _tensor_info's quick test."""
    where = f"{path}: tensor {_quote(name)}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    code, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {_quote(code)}")
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: shape {_quote(shape)} is not a list of sizes")
    if not shape_fits(shape):
        raise CheckpointError(f"{where}: shape {_quote(shape)} is too large for a tensor")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(_is_int(o) for o in offs)
        or not 0 <= offs[0] <= offs[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {_quote(offs)} are not [begin, end]")
    begin, end = data_start + offs[0], data_start + offs[1]
    if file_size is not None and end > file_size:
        raise CheckpointError(
            f"{where}: data ends at byte {end}, past the end of the file ({file_size} bytes)"
        )
    want = math.prod(shape) * DTYPES[code][0]
    raise CheckpointError(
        f"{where}: {end - begin} bytes of data for shape {shape} {code} ({want} bytes)"
    )


def read_index(path: str | os.PathLike) -> dict[str, str]:
    """The validated ``weight_map`` (tensor name -> file name) of an index file."""
    p = Path(path)
    index = read_json(p, what="safetensors index")
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{p}: not a safetensors index (no weight_map of file names)")
    for f in set(wm.values()):
        if not f or f != Path(f).name or f in (".", ".."):
            raise CheckpointError(f"{p}: names file {_quote(f)}, which is not in its directory")
    return wm


def list_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files (names inside ``path``) that hold an HF dir's tensors.

    The index's files when ``model.safetensors.index.json`` exists, else ``model.safetensors``,
    else every ``*.safetensors`` of the dir. Each must be a regular file.
    """
    p = Path(path)
    if (p / INDEX_NAME).exists() or (p / INDEX_NAME).is_symlink():
        files = sorted(set(read_index(p / INDEX_NAME).values()))
        for f in files:
            if not (p / f).exists():
                raise CheckpointError(f"{p / INDEX_NAME}: lists {f}, which does not exist")
    elif (p / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{p}: no safetensors files")
    for f in files:
        require_regular(p / f)
    return files


def has_safetensors(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / INDEX_NAME).exists() or any(p.glob("*.safetensors"))
