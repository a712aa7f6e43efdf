"""Checkpoint sources: a DCP dir or an HF safetensors dir, behind one abstraction.

A :class:`CheckpointSource` lists its tensors from metadata alone (``entries()``: name, dtype,
shape, file; no tensor data read) and reads them one at a time (``read(entry)``,
``iter_tensors()``), so that export, convert and inspect plan first and then stream with host
memory near the largest tensor. ``open_source(path, format)`` picks the class;
``resolve_format`` is the one place that says what a path holds (``CheckpointError`` otherwise).

Names are the stored ones: a DCP dir's state-dict names (fused experts as one tensor), an HF
dir's checkpoint names (per expert). ``hf_entries`` / ``iter_hf_tensors`` give any source in
HF checkpoint naming; ``open_reader`` / ``iter_checkpoint_tensors`` give it in state-dict naming
(an HF dir's per-expert tensors fused) through a DCP ``StorageReader``, which is what ``load``
plans against.

Quantized sources (FP8 blockwise, compressed-tensors, ModelOpt) plug in as sources too: an
:class:`Entry` can say what its value's ``dtype`` is, what is ``stored`` on disk and which
companion ``scales`` entries a reader needs with it, and ``read`` is the one place a subclass or
wrapper turns stored bytes into values.

Importing this module does not import torch (``qckpt inspect`` of an HF dir stays fast).
"""

from __future__ import annotations

import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.checkpoint import safetensors_io as stio
from qckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from qckpt.checkpoint.dcp_reader import OrderedFileSystemReader
    from qckpt.checkpoint.hf_reader import HFSafetensorsReader

FORMATS = ("auto", "dcp", "safetensors", "megatron", "torchtitan")
TRAINING_FORMATS = ("megatron", "torchtitan")  # DCP dirs in a training framework's names


def is_dcp_dir(path: str | os.PathLike) -> bool:
    """A dir with a ``.metadata`` entry (checked as a file only when it is read)."""
    return os.path.lexists(Path(path) / ".metadata")


def detect_format(path: str | os.PathLike) -> str:
    """``dcp`` for a dir with ``.metadata`` in HF names, ``megatron`` / ``torchtitan`` for one
    a training framework wrote (``training_sources.detect``), ``safetensors`` for one with
    safetensors files."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"{p}: a checkpoint is a directory (DCP or HF safetensors)")
    if (p / "latest_checkpointed_iteration.txt").is_file() and not is_dcp_dir(p):
        return "megatron"  # a Megatron save dir: its latest iter_* dir is read
    if is_dcp_dir(p):
        from qckpt.checkpoint.training_sources import detect

        return detect(p) or "dcp"
    if stio.has_safetensors(p):
        return "safetensors"
    raise CheckpointError(f"{p}: neither a DCP checkpoint (.metadata) nor an HF safetensors dir")


def resolve_format(path: str | os.PathLike, format: str = "auto") -> str:
    """``dcp`` or ``safetensors``: ``auto`` detected, an explicit format as given."""
    if format not in FORMATS:
        raise CheckpointError(
            f"{Path(path)}: unknown checkpoint format {format!r} (one of {', '.join(FORMATS)})"
        )
    return detect_format(path) if format == "auto" else format


@dataclass(frozen=True)
class Entry:
    """One stored tensor of a source, known from metadata alone."""

    name: str
    dtype: str  # safetensors code of the value ``read`` returns ("BF16"; "torch.x" if none)
    shape: tuple[int, ...]
    file: str  # the file holding its data (the first chunk's, for DCP)
    stored: str = ""  # dtype code on disk when a source converts on read ("" = ``dtype``)
    scales: tuple[str, ...] = ()  # names of companion entries (scales) a read needs with it
    loc: Any = field(default=None, compare=False, repr=False)  # source-private: where it lies
    stored_bytes: int = 0  # bytes on disk when not shape x dtype (codes and scales together)

    @property
    def stored_dtype(self) -> str:
        return self.stored or self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes stored (what reading it costs)."""
        return self.stored_bytes or math.prod(self.shape) * stio.itemsize(self.stored_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return stio.torch_dtype(self.dtype)


class CheckpointSource(ABC):
    """A checkpoint read as entries (metadata only) and then one tensor at a time."""

    format: str = ""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._entries: list[Entry] | None = None

    def entries(self) -> list[Entry]:
        """Every tensor, in read order (each file walked forward); reads no tensor data."""
        if self._entries is None:
            self._entries = self._list()
        return self._entries

    def entry(self, name: str) -> Entry:
        for e in self.entries():
            if e.name == name:
                return e
        raise CheckpointError(f"{name}: not in the checkpoint {self.path}")

    @abstractmethod
    def _list(self) -> list[Entry]: ...

    @abstractmethod
    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        """One entry's whole value as a fresh CPU tensor of ``entry.dtype`` and shape; with
        ``pinned``, in page-locked memory where the stored bytes are the value (a GPU then
        copies it without a CPU copy through the driver's staging buffer); else ignored."""

    def iter_tensors(
        self, entries: Iterable[Entry] | None = None
    ) -> Iterator[tuple[Entry, torch.Tensor]]:
        """(entry, tensor) for each entry (default: all), one tensor in flight."""
        for e in self.entries() if entries is None else entries:
            t = self.read(e)
            yield e, t
            del t


class SafetensorsSource(CheckpointSource):
    """An HF safetensors dir (one file or sharded with an index), in its stored names.

    Headers are parsed by :mod:`safetensors_io`; each tensor is read with ``readinto`` into its
    own buffer. (``safe_open`` would mmap the file, and every page it touches would count in
    RSS until the file is closed: a multi-GB shard would show as multi-GB resident.)
    """

    format = "safetensors"

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._headers: list[stio.Header] | None = None
        self._stored: list[Entry] | None = None

    def files(self) -> list[str]:
        return stio.list_files(self.path)

    def headers(self) -> list[stio.Header]:
        if self._headers is None:
            self._headers = [stio.read_header(self.path / f) for f in self.files()]
        return self._headers

    def metadata(self) -> dict[str, str]:
        """The files' ``__metadata__``, merged."""
        out: dict[str, str] = {}
        for h in self.headers():
            out.update(h.metadata)
        return out

    def stored(self) -> list[Entry]:
        """Every tensor as stored (codes and scales of a quantized dir included)."""
        if self._stored is None:
            self._stored = self._stored_entries()
        return self._stored

    def _stored_entries(self) -> list[Entry]:
        out: list[Entry] = []
        where: dict[str, Path] = {}
        for h in self.headers():
            for t in h.tensors:
                if t.name in where:
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name} is in both {where[t.name].name} "
                        f"and {h.path.name}"
                    )
                where[t.name] = h.path
                out.append(Entry(t.name, t.dtype, t.shape, str(h.path), loc=(t.begin, t.end)))
        index = self.path / stio.INDEX_NAME
        if index.exists():
            for name, f in stio.read_index(index).items():
                if where.get(name, Path()).name != f:
                    raise CheckpointError(f"{index}: maps {name} to {f}, which does not hold it")
        return out

    def layout(self) -> Any:
        """The dir's ``quantized_sources.SourceLayout``; None when nothing in it can be quantized
        (no float8 or packed tensor, no scale, no quantization config): then torch stays
        unimported."""
        if not _maybe_quantized(self.path, self.stored()):
            return None
        from qckpt.checkpoint.quantized_sources import source_layout

        index = {e.name: (Path(e.file).name, e.shape, e.torch_dtype) for e in self.stored()}
        return source_layout(self.path, index)

    def _list(self) -> list[Entry]:
        """A quantized dir as a BF16 dir would list it: each quantized weight under its logical
        name where its codes are (``dtype`` F32, ``stored`` the codes' dtype, ``scales`` its
        scale tensors; dequantized by ``read``); scales and activation scales gone."""
        stored = self.stored()
        layout = self.layout()
        if layout is None or not layout.quantized:
            return stored
        by_name = {e.name: e for e in stored}
        by_codes = {w.codes: w for w in layout.weights.values()}
        claimed = {k for w in layout.weights.values() for k in (w.scale, w.global_scale) if k}
        out: list[Entry] = []
        for e in stored:
            w = by_codes.get(e.name)
            if w is not None:
                scales = tuple(k for k in (w.scale, w.global_scale) if k)
                parts = tuple(by_name[k] for k in (w.codes, *scales))
                nbytes = sum(p.nbytes for p in parts)
                out.append(
                    Entry(
                        w.name, "F32", tuple(w.shape), e.file, e.dtype, scales, (w, parts), nbytes
                    )
                )
            elif e.name not in claimed and e.name not in layout.hidden:
                out.append(e)
        return out

    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        if entry.scales or (entry.stored and entry.stored != entry.dtype):
            return self._dequantize(entry)
        return self._read_stored(entry, pinned)

    def _dequantize(self, entry: Entry) -> torch.Tensor:
        import torch

        from qckpt.checkpoint.quantized_sources import dequantize

        w, parts = entry.loc
        stored = {p.name: self._read_stored(p) for p in parts}

        def fetch(key: str, rows: Any, cols: Any) -> torch.Tensor:
            t = stored[key]
            return t if rows is None else t[rows[0] : rows[1], cols[0] : cols[1]]

        return dequantize(w, fetch, torch.float32)

    def span(self, entry: Entry) -> tuple[str, int, int] | None:
        """(file, begin, end) of an entry whose stored bytes are its value (read as they lie):
        entries whose spans touch can be read together (:meth:`read_span`); None for one a read
        converts (a dequantized weight)."""
        if entry.scales or (entry.stored and entry.stored != entry.dtype):
            return None
        begin, end = entry.loc
        return entry.file, begin, end

    def read_span(self, entries: list[Entry], pinned: bool = False) -> torch.Tensor:
        """The stored bytes of ``entries``, which lie one after the other in one file
        (:meth:`span`), as one uint8 tensor read with one positional read (page-locked with
        ``pinned``): the export's bulk path reads a run of small tensors so."""
        import torch

        file, begin, _ = self.span(entries[0])
        end = self.span(entries[-1])[2]
        buf = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pinned)
        view = memoryview(buf.numpy())
        got = 0
        with stio.open_regular(file) as f:
            while got < end - begin:
                n = os.preadv(f.fileno(), [view[got:]], begin + got)
                if n <= 0:
                    break
                got += n
        if got != end - begin:
            short = next(e for e in entries if e.loc[1] > begin + got)
            raise CheckpointError(f"{file}: truncated data for tensor {short.name}")
        return buf

    def _read_stored(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        import torch

        begin, end = entry.loc
        buf = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pinned)
        with stio.open_regular(entry.file) as f:
            f.seek(begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != end - begin:
            raise CheckpointError(f"{entry.file}: truncated data for tensor {entry.name}")
        return buf.view(entry.torch_dtype).reshape(entry.shape)


# the names quantized_sources takes for quantization parameters (equal to its _PARAM_SUFFIXES,
# which a test checks): repeated here so that a plain dir is told apart without torch
_QUANT_PARAM_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_global_scale", "_zero_point",
                         "_g_idx", "weight_packed", "weight_shape")  # fmt: skip


def _maybe_quantized(path: Path, stored: list[Entry]) -> bool:
    """Whether a dir could hold a quantized layout (``quantized_sources`` then says which, or
    refuses it): a quantization config, a float8 tensor, or a quantization parameter's name.
    A plain BF16 dir answers False from names and headers alone."""
    if (path / "hf_quant_config.json").exists():
        return True
    if (path / "config.json").exists():
        if "quantization_config" in stio.read_json(path / "config.json", what="model config"):
            return True
    return any(
        e.dtype.startswith("F8_") or e.name.rpartition(".")[2].endswith(_QUANT_PARAM_SUFFIXES)
        for e in stored
    )


class DCPSource(CheckpointSource):
    """A DCP dir in its state-dict names; each tensor read by a one-entry ``dcp.load``."""

    format = "dcp"

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._reader: OrderedFileSystemReader | None = None

    def reader(self) -> OrderedFileSystemReader:
        if self._reader is None:
            from qckpt.checkpoint.dcp_reader import OrderedFileSystemReader

            self._reader = OrderedFileSystemReader(self.path)
        return self._reader

    def dcp_metadata(self) -> Any:
        """DCP's ``Metadata`` (allow-list unpickler; data files checked)."""
        return self.reader().read_metadata()

    def _list(self) -> list[Entry]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = self.dcp_metadata()
        _refuse_quantized_dcp(md, self.path)
        first: dict[str, tuple[str, int]] = {}
        for idx, info in md.storage_data.items():
            key = (info.relative_path, info.offset)
            if idx.fqn not in first or key < first[idx.fqn]:
                first[idx.fqn] = key
        entries = [
            Entry(
                fqn,
                stio.dtype_code(meta.properties.dtype),
                tuple(int(s) for s in meta.size),
                str(self.path / first.get(fqn, ("", 0))[0]),
            )
            for fqn, meta in md.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        ]
        # sorted by where the data lives, so that the reads walk each file forward
        entries.sort(key=lambda e: first.get(e.name, ("", 0)))
        return entries

    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        del pinned  # one thread reads a DCP source: its reads, not a staging copy, bound it
        import torch
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from qckpt.errors import unwrap_dcp

        t = torch.empty(entry.shape, dtype=entry.torch_dtype)
        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming a single process" is exactly our intent
            warnings.simplefilter("ignore")
            try:
                dcp_load(
                    {entry.name: t},
                    storage_reader=self.reader(),
                    planner=DefaultLoadPlanner(allow_partial_load=True),
                    no_dist=True,
                )
            except Exception as exc:
                inner = unwrap_dcp(exc)
                if isinstance(inner, CheckpointError):
                    raise inner from None
                raise CheckpointError(
                    f"{entry.file}: cannot read tensor {entry.name} ({type(inner).__name__})"
                ) from None
        return t


def open_source(
    path: str | os.PathLike, format: str = "auto", *, config: Any = None
) -> CheckpointSource:
    """The source of the checkpoint at ``path`` (``format``: one of ``FORMATS``); a training
    checkpoint (megatron, torchtitan) needs ``config``, the HF config its tensors map onto."""
    fmt = resolve_format(path, format)
    if fmt in TRAINING_FORMATS:
        from qckpt.checkpoint.training_sources import TrainingSource

        return TrainingSource(path, fmt, config)
    return DCPSource(path) if fmt == "dcp" else SafetensorsSource(path)


# --------------------------------------------------------------------------------------------
# HF checkpoint naming (what save_pretrained writes: fused experts split per expert)


@dataclass(frozen=True)
class HFEntry:
    """One tensor as the HF checkpoint names it, and the stored entry it comes from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Entry


def hf_entries(entries: Iterable[Entry], model_type: str) -> list[HFEntry]:
    """The HF checkpoint entries of stored ones (a fused parameter split per expert, adjacent)."""
    import torch

    from qckpt.models.naming import hf_tensors, is_fused_experts_param

    out: list[HFEntry] = []
    dtypes: dict[str, torch.dtype] = {}  # a large MoE lists tens of thousands of entries
    for e in entries:
        dt = dtypes.get(e.dtype)
        if dt is None:
            dt = dtypes[e.dtype] = e.torch_dtype
        if not is_fused_experts_param(e.name):  # passes through: no meta tensor to view
            out.append(HFEntry(e.name, dt, tuple(e.shape), e))
            continue
        meta = torch.empty(e.shape, dtype=dt, device="meta")
        for name, view in hf_tensors(e.name, meta, model_type):
            out.append(HFEntry(name, dt, tuple(view.shape), e))
    return out


def iter_hf_tensors(
    source: CheckpointSource, entries: Iterable[HFEntry], model_type: str
) -> Iterator[tuple[HFEntry, torch.Tensor]]:
    """(HF entry, tensor) for each entry, reading every stored tensor exactly once.

    Entries that come from one stored tensor must be adjacent, as :func:`hf_entries` makes
    them; the stored tensor is dropped after its last one.
    """
    from qckpt.models.naming import hf_tensors

    current: Entry | None = None
    views: dict[str, torch.Tensor] = {}
    for he in entries:
        if he.source is not current:
            views = {}  # drop the previous stored tensor before reading the next one
            current = he.source
            stored = source.read(current)
            views = dict(hf_tensors(current.name, stored, model_type))
            del stored
        yield he, views.pop(he.name)
    views.clear()


# --------------------------------------------------------------------------------------------
# state-dict naming, as DCP storage readers (what load plans against)


def open_reader(
    path: str | os.PathLike,
    format: str = "auto",
    *,
    model: nn.Module | None = None,
    expected: dict[str, torch.Size] | None = None,
    reader: str = "plain",
    max_inflight: int = 2,
    threads: int | None = None,
) -> OrderedFileSystemReader | HFSafetensorsReader:
    """A plan-order storage reader for the checkpoint at ``path``.

    For HF dirs, ``model`` (or ``expected`` shapes) tells how per-expert tensors fuse.
    ``reader="fast"`` gives the fast-path twin (``checkpoint.fast_readers``: parallel reads,
    at most ``max_inflight`` quantized destinations live, ``threads`` reader threads).
    """
    if reader not in ("fast", "plain"):
        raise CheckpointError(f"reader: must be fast or plain, got {reader!r}")
    fast = {"max_inflight": max_inflight, "threads": threads} if reader == "fast" else {}
    fmt = resolve_format(path, format)
    if fmt in TRAINING_FORMATS:
        return _training_reader(path, fmt, model, expected, fast)
    if fmt == "dcp":
        from qckpt.checkpoint.dcp_reader import OrderedFileSystemReader

        if not is_dcp_dir(path):
            raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata)")
        if fast:
            from qckpt.checkpoint.fast_readers import FastDCPReader

            dcp_reader: OrderedFileSystemReader = FastDCPReader(path, **fast)
        else:
            dcp_reader = OrderedFileSystemReader(path)
        _refuse_quantized_dcp(dcp_reader.read_metadata(), path)
        return dcp_reader
    from qckpt.checkpoint.hf_reader import HFSafetensorsReader

    stio.list_files(path)  # a clear error for a dir without any
    model_type = None
    if model is not None:
        from qckpt.models.build import model_type as _mt

        model_type = _mt(model) or None
        if expected is None:
            expected = {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}
    if fast:
        from qckpt.checkpoint.fast_readers import FastHFReader

        return FastHFReader(path, model_type=model_type, expected=expected, **fast)
    return HFSafetensorsReader(path, model_type=model_type, expected=expected)


def _training_reader(
    path: str | os.PathLike,
    fmt: str,
    model: nn.Module | None,
    expected: dict[str, torch.Size] | None,
    fast: dict[str, Any],
) -> Any:
    """A Megatron / torchtitan dir's reader in the model's state-dict names."""
    from qckpt.checkpoint.training_sources import FastTrainingReader, TrainingReader

    config = getattr(model, "config", None)
    if config is None:
        raise CheckpointError(
            f"{path}: a {fmt} checkpoint is read into a model (model.source names the HF "
            "config its tensors map onto)"
        )
    if expected is None:
        expected = {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}
    cls = FastTrainingReader if fast else TrainingReader
    return cls(path, fmt, config=config, expected=expected, **fast)


def _refuse_quantized_dcp(md: Any, path: str | os.PathLike) -> None:
    """A DCP dir holding FP8 codes or scales: no layout says how to read them; refuse."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from qckpt.checkpoint.quantized_sources import refuse_quantized_dcp

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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = open_reader(path, format).read_metadata()
    return {
        k: (tuple(int(s) for s in v.size), v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def iter_checkpoint_tensors(
    path: str | os.PathLike, format: str = "auto", *, names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, whole CPU tensor), one at a time, in checkpoint order.

    Fused experts of an HF dir come assembled from their per-expert tensors (one DCP read each,
    through the HF reader); a DCP dir is read through :class:`DCPSource`.
    """
    wanted = None if names is None else set(names)
    if resolve_format(path, format) == "dcp":
        src = DCPSource(path)
        todo = [e for e in src.entries() if wanted is None or e.name in wanted]
        for e, t in src.iter_tensors(todo):
            yield e.name, t
        return
    yield from _iter_fused_hf(path, wanted)


def _iter_fused_hf(path: str | os.PathLike, wanted: set[str] | None) -> Iterator[tuple[str, Any]]:
    import torch
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = open_reader(path, "safetensors")
    md = reader.read_metadata()
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
