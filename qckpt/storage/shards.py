"""Safetensors shards written from a plan: every offset known before a byte is written.

* ``plan_shards``: which tensors go to which file (a group, e.g. a weight and its scales, never
  straddles two files), ``model-0000i-of-0000n.safetensors`` plus an index past one file;
* ``shard_header`` / ``shard_layout``: a file's header bytes and each tensor's offset, from the
  plan alone;
* ``ShardWriter`` / ``write_shards``: one file front to back (the header, then one tensor at a
  time); ``create_shard_file`` + ``ShardFile``: a file made whole first, then its tensors
  written at their offsets from several threads and processes (a distributed export);
* ``write_index``: ``model.safetensors.index.json``.

They write into the directory they are given; making that directory appear atomically is the
caller's business. Torch is imported only to take a tensor's bytes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json's quoting of a str (C)
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qckpt.errors import CheckpointError
from qckpt.storage.files import write_text
from qckpt.storage.safetensors import DTYPES, INDEX_NAME, SINGLE_NAME, dtype_code, itemsize

if TYPE_CHECKING:
    import torch


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
    write_text(Path(out_dir) / INDEX_NAME, index_text(plan.total_size, plan.weight_map))


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
