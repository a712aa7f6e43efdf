"""Where the bytes of a tensor saved with ``torch.save`` lie, found without ``torch.load``.

DCP's ``FileSystemWriter`` stores every tensor item as one ``torch.save`` archive (a zip
with stored, uncompressed records) at a byte range of a ``.distcp`` file. Its plain reader
``torch.load``s the whole item for every read item: an unpickle, an allocation and a copy of
the whole stored chunk, even when the read needs a few rows of it. Here the archive's central
directory (``zipfile``, over the item's byte range) and the local headers of its records give
where each record's data start (torch writes the sizes after the data, so the local headers
alone do not), and its ``data.pkl`` is parsed with an unpickler that admits only what a plain
tensor's pickle holds (``_rebuild_tensor_v2``, a storage class, an empty ``OrderedDict``), to
learn the dtype, shape, strides and the absolute file offset of element 0.

Anything else (a compressed record, a tensor subclass, non-contiguous strides, big-endian
data, a record that does not fit the item, a damaged archive) gives ``None``: the caller then
reads that item the plain way, which reports what is wrong with it. Nothing is ever executed:
unknown globals raise inside the unpickler.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

_LOCAL = b"PK\x03\x04"


_LOCAL_FIXED = 30


_MAX_RECORDS = 64  # a tensor archive has about 7; more is not what we know how to read


_MAX_PKL = 1 << 20


@dataclass(frozen=True)
class StoredTensor:
    """A row-major tensor's bytes: ``path`` at byte ``offset`` (element 0), dtype, shape."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Unsupported(Exception):
    pass


@dataclass(frozen=True)
class _Rebuilt:
    dtype: torch.dtype
    key: str
    numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage, storage_offset, size, stride, requires_grad, hooks, *rest):  # noqa: ANN001, ANN202
    dtype, key, numel = storage
    if rest and rest[0]:  # tensor metadata (a subclass's or a named tensor's): not plain
        raise _Unsupported
    return _Rebuilt(dtype, str(key), int(numel), int(storage_offset), tuple(size), tuple(stride))


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _TensorPickle(pickle.Unpickler):
    """Admits the three globals a plain tensor's ``data.pkl`` names; nothing is executed."""

    def find_class(self, module: str, name: str):  # noqa: ANN201
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            try:
                from torch.storage import _get_dtype_from_pickle_storage_type

                return _StorageType(_get_dtype_from_pickle_storage_type(name))
            except Exception:
                raise _Unsupported from None
        raise _Unsupported

    def persistent_load(self, pid):  # noqa: ANN001, ANN201
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Unsupported
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise _Unsupported
        return (stype.dtype, key, numel)


class _Window(io.RawIOBase):
    """The archive's byte range as a seekable file, for ``zipfile``'s central directory."""

    def __init__(self, read: Callable[[int, int], bytes], length: int) -> None:
        self._read, self._len, self._pos = read, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        out = self._read(self._pos, n) if n > 0 else b""
        self._pos += len(out)
        return out


def _records(read: Callable[[int, int], bytes], length: int) -> dict[str, tuple[int, int]]:
    """name -> (data start, size) of each stored record: the central directory (torch writes
    the sizes after the data, so the local headers alone do not give them), then each local
    header for where its data begins."""
    zf = zipfile.ZipFile(_Window(read, length))
    infos = zf.infolist()
    if len(infos) > _MAX_RECORDS:
        raise _Unsupported
    out: dict[str, tuple[int, int]] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _Unsupported
        if not (
            info.filename.endswith("data.pkl")
            or "/data/" in info.filename
            or info.filename.endswith("byteorder")
        ):
            continue
        head = read(info.header_offset, _LOCAL_FIXED)
        if len(head) != _LOCAL_FIXED or head[:4] != _LOCAL:
            raise _Unsupported
        nlen, elen = struct.unpack_from("<HH", head, 26)
        out[info.filename] = (info.header_offset + _LOCAL_FIXED + nlen + elen, info.file_size)
    return out


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    want = 1
    for s, st in zip(reversed(size), reversed(stride), strict=True):
        if s != 1 and st != want:
            return False
        want *= s
    return True


def locate_tensor(
    read: Callable[[int, int], bytes], length: int, path: str, base: int
) -> StoredTensor | None:
    """The tensor of the ``torch.save`` archive of ``length`` bytes at file offset ``base``.

    ``read(pos, n)`` returns ``n`` bytes at ``pos`` inside the archive (short only past its
    end). None when the archive is not one plain, contiguous, little-endian tensor.
    """
    try:
        recs = _records(read, length)
        pkl = [n for n in recs if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            return None
        root = pkl[0][: -len("data.pkl")]
        start, size = recs[pkl[0]]
        if size > _MAX_PKL or start + size > length:
            return None
        obj = _TensorPickle(io.BytesIO(read(start, size))).load()
        if not isinstance(obj, _Rebuilt) or not _contiguous(obj.size, obj.stride):
            return None
        order = recs.get(root + "byteorder")
        if order is not None and read(order[0], order[1]) != b"little":
            return None
        if sys.byteorder != "little":
            return None
        data = recs.get(f"{root}data/{obj.key}")
        item = obj.dtype.itemsize
        need = (obj.storage_offset + math.prod(obj.size)) * item
        if data is None or data[1] < need or data[0] + data[1] > length:
            return None
        off = base + data[0] + obj.storage_offset * item
        return StoredTensor(path, off, obj.dtype, tuple(int(s) for s in obj.size))
    except Exception:  # noqa: BLE001 - damaged or unusual archive: the plain reader decides
        return None
