"""Safetensors on disk: the one module that reads and writes the format.

* the dtype table (safetensors code <-> byte size <-> torch dtype);
* ``open_regular`` / ``read_json``: files of a checkpoint dir are opened only when they are
  regular files (a FIFO named ``model.safetensors`` would otherwise block ``open`` forever);
* ``read_header``: the 8-byte length + JSON header, parsed and validated here (an object; every
  entry with a known dtype, a shape, offsets inside the file whose length matches the shape);
* ``read_index`` / ``list_files``: which files of an HF dir hold the tensors, with one
  precedence everywhere: the index's files, else ``model.safetensors``, else every
  ``*.safetensors`` of the dir;
* ``plan_shards`` / ``write_shards``: shards written front to back from a plan (the header
  first, then one tensor at a time) plus ``model.safetensors.index.json``. They write into the
  directory they are given; making that directory appear atomically is the caller's business.

Importing this module does not import torch: ``qckpt inspect`` of an HF dir reads headers only.
Every failure is a one-line :class:`CheckpointError` that names the file and what is wrong.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json's quoting of a str (C)
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from qckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
MAX_JSON_BYTES = 256 * 2**20  # an index of a very large model is a few MB

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


# --------------------------------------------------------------------------------------------
# files


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """Open ``path`` for reading only if it is a regular file (never blocks on a FIFO).

    ``O_NONBLOCK`` makes the open of a FIFO or a device return at once; ``fstat`` on the open
    descriptor then says what it is, with no window between the check and the open.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{p}: is a directory, not a file") from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot open ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{p}: not a regular file ({_kind(mode)}); refusing to read it")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def is_regular(path: str | os.PathLike) -> bool:
    """True for a regular file (following symlinks); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def require_regular(path: str | os.PathLike) -> int:
    """The size of ``path``, or a CheckpointError when it is missing or not a regular file."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CheckpointError(f"{p}: no such file") from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{p}: not a regular file ({_kind(st.st_mode)}); refusing to read it")
    return st.st_size


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> dict[str, Any]:
    """A JSON object from a regular file; one-line CheckpointError for anything else."""
    p = Path(path)
    with open_regular(p) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{p}: {what} larger than {MAX_JSON_BYTES} bytes; refusing it")
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise CheckpointError(f"{p}: corrupt {what} (not UTF-8 text)") from None
    except ValueError as exc:
        msg = getattr(exc, "msg", "not JSON")
        where = f" at line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
        raise CheckpointError(f"{p}: corrupt {what} ({msg}{where})") from None
    except RecursionError:
        raise CheckpointError(f"{p}: corrupt {what} (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p}: {what} is a JSON {_json_type(obj)}, not an object")
    return obj


def _json_type(obj: object) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(obj), "number"
    )


# --------------------------------------------------------------------------------------------
# headers


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
            f"{path}: safetensors header is a JSON {_json_type(obj)}, not an object"
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


# --------------------------------------------------------------------------------------------
# HF dirs


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


# --------------------------------------------------------------------------------------------
# writing


class TensorSpec(Protocol):
    """What a shard writer needs to know of a tensor before its data exist."""

    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * _dtype_kind(spec.dtype)[1]


@functools.lru_cache(maxsize=64)
def _dtype_kind(dtype: Any) -> tuple[str, int]:
    """(safetensors code, bytes per element) of a torch dtype: a plan of 50k specs has a few
    dtypes, so each is looked up once."""
    code = dtype_code(dtype)
    return code, itemsize(code)


class ShardSpecs(list):
    """One shard file's specs, in write order, with the file's layout (header bytes, every
    tensor's offset) kept once made: the main rank makes the file and opens it for its own
    share, and each rank opens several files; a 50k-tensor header cost ~0.4 s each time."""

    def layout(self, path: Path, metadata: dict[str, str]) -> ShardLayout:
        key = json.dumps(metadata, sort_keys=True)
        got = self.__dict__.get("_layout")
        if got is None or got[0] != key or len(got[1].offsets) != len(self):
            got = (key, _make_layout(path, self, metadata))
            self.__dict__["_layout"] = got
        return got[1]


@dataclass(frozen=True)
class ShardLayout:
    """Everything about a shard file but its data, from the plan alone."""

    head: bytes  # the length prefix and the JSON header, padded
    offsets: list[int]  # each spec's absolute data offset in the file
    size: int  # the whole file's length
    slots: dict[str, tuple[Any, int]]  # name -> (spec, offset)
    order: dict[str, int]  # name -> its index in the file's specs


def shard_layout(path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]) -> ShardLayout:
    """The layout of a shard of ``specs``; kept on ``specs`` when it is a :class:`ShardSpecs`."""
    if isinstance(specs, ShardSpecs):
        return specs.layout(path, metadata)
    return _make_layout(path, specs, metadata)


def _make_layout(path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]) -> ShardLayout:
    head, offsets = shard_header(path, specs, metadata)
    size = offsets[-1] + spec_nbytes(specs[-1]) if specs else len(head)
    names = [s.name for s in specs]
    return ShardLayout(
        head=head,
        offsets=offsets,
        size=size,
        slots=dict(zip(names, zip(specs, offsets, strict=True), strict=True)),
        order={n: i for i, n in enumerate(names)},
    )


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file, decided before any byte is written."""

    files: list[str]
    specs: list[list[TensorSpec]]  # per file, in write order (ShardSpecs from plan_shards)
    index: bool  # write model.safetensors.index.json

    @property
    def weight_map(self) -> dict[str, str]:
        return {s.name: f for f, specs in zip(self.files, self.specs, strict=True) for s in specs}

    @property
    def total_size(self) -> int:
        return sum(spec_nbytes(s) for specs in self.specs for s in specs)


def plan_shards(
    groups: Iterable[Sequence[TensorSpec]],
    max_bytes: int | None,
    *,
    single_file_name: bool = False,
) -> ShardPlan:
    """Cut groups of tensors (a group, e.g. a weight and its scales, never straddles two files)
    into shards of at most ``max_bytes`` (a larger group gets a shard of its own).

    Shards are ``model-0000i-of-0000n.safetensors`` with an index; with ``single_file_name``
    a plan of one shard writes ``model.safetensors`` and no index, as ``save_pretrained`` does.
    """
    shards: list[list[TensorSpec]] = [ShardSpecs()]
    size = 0
    for g in groups:
        n = sum(spec_nbytes(s) for s in g)
        if max_bytes and shards[-1] and size + n > max_bytes:
            shards.append(ShardSpecs())
            size = 0
        shards[-1].extend(g)
        size += n
    if single_file_name and len(shards) == 1:
        return ShardPlan([SINGLE_NAME], shards, index=False)
    k = len(shards)
    return ShardPlan([f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)], shards, True)


def shard_header(
    path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]
) -> tuple[bytes, list[int]]:
    """The header bytes of a shard (length prefix included) and each spec's absolute data
    offset in the file: everything about the file but its data, from the plan alone.

    The JSON is made as text, one entry at a time (the same bytes ``json.dumps`` of the
    header dict with ``separators=(",", ":")`` gives, at a third of its cost on 50k tensors:
    no dict per entry)."""
    parts = []
    if metadata:
        parts.append('"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":")))
    off = 0
    offsets = []
    for s in specs:
        code, size = _dtype_kind(s.dtype)
        if code not in DTYPES:
            raise CheckpointError(f"{path}: tensor {s.name}: safetensors cannot store {code}")
        for d in s.shape:
            size *= d
        offsets.append(off)
        shape = ",".join(map(str, s.shape))
        parts.append(
            f'{_json_str(s.name)}:{{"dtype":"{code}","shape":[{shape}],'
            f'"data_offsets":[{off},{off + size}]}}'
        )
        off += size
    raw = ("{" + ",".join(parts) + "}").encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, [start + o for o in offsets]


def _check_spec(spec: TensorSpec, name: str, t: torch.Tensor) -> None:
    if name != spec.name or t.dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
        # the plan and the producer disagree: a bug, never a user error
        raise AssertionError(f"wrote {name} {t.dtype} {tuple(t.shape)}, planned {spec}")


def _host_bytes(t: torch.Tensor) -> memoryview:
    import torch

    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(data.numpy())


def _pwrite_all(fd: int, data: memoryview | bytes, pos: int) -> None:
    """All of ``data`` at ``pos`` (pwrite may write less than asked: a signal, a large write)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


# at most this many buffers per pwritev (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024


def _pwritev_all(fd: int, views: Sequence[memoryview], pos: int) -> None:
    """All of ``views`` (byte views), one after the other from ``pos``: ``pwritev`` calls of up
    to :data:`_IOV_MAX` buffers, resumed where a short write stopped."""
    pending = [memoryview(v).cast("B") for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        n = os.pwritev(fd, pending[i : i + _IOV_MAX], pos)
        pos += n
        while n and i < len(pending):
            if n >= pending[i].nbytes:
                n -= pending[i].nbytes
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0


def create_shard_file(path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]) -> None:
    """Make shard file ``path`` before any tensor is written: its header from the plan, its
    length set to the whole planned size (``ftruncate``: the data section is a hole until it is
    written), fsynced. Refuses a file that exists (``O_EXCL``): the caller's temp dir is new.
    One process makes every file, so that the ranks of a distributed export can then open the
    files they share without racing each other to create or truncate one (:class:`ShardFile`)."""
    lay = shard_layout(path, specs, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _pwrite_all(fd, lay.head, 0)
        os.ftruncate(fd, lay.size)
        # the header must be durable even when the process that made the file writes no tensor
        # into it (another rank's fsync covers only its own node's pages on a shared filesystem)
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardFile:
    """One safetensors file, made by :func:`create_shard_file`, whose tensors are written at
    their planned offsets, in any order and from several threads at once (``pwrite``); every
    offset is known from the plan. Several processes may each open the same file and write
    their own tensors (``names``: the ones this opener writes; default all): it is opened
    without ``O_CREAT``/``O_TRUNC``, so nobody's bytes are lost. ``close`` checks that every
    tensor of ``names`` came; that the whole file did is the caller's check (:meth:`written`)."""

    def __init__(
        self,
        path: Path,
        specs: Sequence[TensorSpec],
        metadata: dict[str, str],
        names: Iterable[str] | None = None,
    ) -> None:
        import threading

        lay = shard_layout(path, specs, metadata)  # shared, read only
        self.path = path
        self.slots = lay.slots
        self.order = lay.order
        self.expected = set(self.slots) if names is None else set(names)
        unknown = self.expected.difference(self.slots)
        if unknown:  # the assignment and the file's plan disagree: a bug
            raise AssertionError(f"{path}: no slot for {sorted(unknown)[:3]}")
        self.done: set[str] = set()
        self.synced = False
        self._lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, name: str, t: torch.Tensor) -> int:
        """Write tensor ``name`` at its place; thread-safe for distinct names."""
        if name not in self.expected:
            raise AssertionError(f"{self.path}: {name} is not this writer's to write")
        spec, off = self.slots[name]
        _check_spec(spec, name, t)
        data = _host_bytes(t)
        _pwrite_all(self.fd, data, off)
        with self._lock:
            self.done.add(name)
            last = len(self.done) == len(self.expected)
        if last:  # this writer's share is whole: flush it now, beside the other files' writes
            os.fsync(self.fd)
            self.synced = True
        return data.nbytes

    def write_span(self, names: Sequence[str], views: Sequence[memoryview]) -> int:
        """Write tensors ``names`` (their bytes: ``views``, each exactly its slot's size) in
        as few calls as their slots allow: a run of slots that follow each other in the file is
        one ``pwritev``. The export's bulk path writes a run of small tensors so; thread-safe
        for distinct names, like :meth:`write`. The caller checked dtypes and shapes."""
        spans: list[tuple[int, list[memoryview]]] = []
        end = -1
        total = 0
        for name, v in zip(names, views, strict=True):
            if name not in self.expected:
                raise AssertionError(f"{self.path}: {name} is not this writer's to write")
            spec, off = self.slots[name]
            if v.nbytes != spec_nbytes(spec):
                raise AssertionError(f"wrote {v.nbytes} bytes for {name}, planned {spec}")
            if off != end:
                spans.append((off, []))
            spans[-1][1].append(v)
            end = off + v.nbytes
            total += v.nbytes
        for off, vs in spans:
            _pwritev_all(self.fd, vs, off)
        with self._lock:
            self.done.update(names)
            last = len(self.done) == len(self.expected)
        if last:
            os.fsync(self.fd)
            self.synced = True
        return total

    def written(self) -> int:
        """The slots written through this object, as a bit mask over the file's tensors in
        plan order (compact enough to send to another rank for the whole-file check)."""
        bits = bytearray((len(self.slots) + 7) // 8)
        for n in self.done:
            i = self.order[n]
            bits[i >> 3] |= 1 << (i & 7)
        return int.from_bytes(bits, "little")

    def close(self) -> None:
        if self.done != self.expected:
            raise AssertionError(
                f"{self.path}: wrote {len(self.done)} of {len(self.expected)}"
                + (" (this writer's share)" if len(self.expected) != len(self.slots) else "")
            )
        if not self.synced:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShardWriter:
    """One safetensors file written front to back: the header from the specs, then the data."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str]) -> None:
        head, _ = shard_header(path, specs, metadata)
        self.path = path
        self.specs = list(specs)
        self.pos = 0
        self.f = open(path, "wb")
        self.f.write(head)

    def write(self, name: str, t: torch.Tensor) -> int:
        _check_spec(self.specs[self.pos], name, t)
        self.pos += 1
        data = _host_bytes(t)
        self.f.write(data)
        return data.nbytes

    def close(self) -> None:
        if self.pos != len(self.specs):
            raise AssertionError(f"{self.path}: wrote {self.pos} of {len(self.specs)} tensors")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        self.f.close()


def write_json(path: Path, obj: Any) -> None:
    """A JSON file, flushed to disk (the caller fsyncs the directory)."""
    _write_text(path, json.dumps(obj, indent=2) + "\n")


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_shards(
    out_dir: str | os.PathLike,
    plan: ShardPlan,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write the plan's shards (and its index) into ``out_dir``; returns the data bytes written.

    ``tensors`` yields (name, tensor) in the plan's order, one at a time: only the tensor being
    written is held, so the output can be larger than memory.
    """
    out = Path(out_dir)
    it = iter(tensors)
    written = 0
    for fname, specs in zip(plan.files, plan.specs, strict=True):
        w = ShardWriter(out / fname, specs, metadata or {})
        try:
            for _ in specs:
                item = next(it, None)
                if item is None:
                    raise AssertionError(f"write_shards: {fname} got fewer tensors than planned")
                written += w.write(*item)
                del item
        except BaseException:
            w.abort()
            raise
        w.close()
    if next(it, None) is not None:
        raise AssertionError("write_shards: more tensors than the plan holds")
    if plan.index:
        write_index(out, plan)
    return written


def write_index(out_dir: str | os.PathLike, plan: ShardPlan) -> None:
    """``model.safetensors.index.json`` of a plan that has one."""
    _write_text(Path(out_dir) / INDEX_NAME, index_text(plan.total_size, plan.weight_map))


def index_text(total_size: int, weight_map: dict[str, str]) -> str:
    """The index file's text: what ``json.dumps(index, indent=2)`` writes (json's indenting
    encoder is pure Python: ~0.1 s for a 50k-tensor index), made directly."""
    if not weight_map:
        return (
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": {}}, indent=2) + "\n"
        )
    rows = ",\n".join(f"    {_json_str(k)}: {_json_str(v)}" for k, v in weight_map.items())
    return (
        f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n'
        f'  "weight_map": {{\n{rows}\n  }}\n}}\n'
    )
