"""The two plain sources: an HF safetensors dir (plain or quantized) and a DCP dir.

:class:`SafetensorsSource` reads an HF dir in its stored names; a quantized dir (its layout from
:mod:`qckpt.layouts.registry`) lists each quantized weight under its logical name and reads it
dequantized. :class:`DCPSource` reads a DCP dir in its state-dict names. Importing this module
does not import torch (``qckpt inspect`` of an HF dir stays fast).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.errors import CheckpointError
from qckpt.layouts.names import (  # torch-free: a plain dir is told apart without torch
    GPT_OSS_BLOCKS,
    PARAM_SUFFIXES,
)
from qckpt.read.source import CheckpointSource, Entry
from qckpt.storage import safetensors as stio
from qckpt.storage.files import open_regular, read_json

if TYPE_CHECKING:
    import torch

    from qckpt.read.dcp_reader import OrderedFileSystemReader


class SafetensorsSource(CheckpointSource):
    """An HF safetensors dir (one file or sharded with an index), in its stored names.

    Headers are parsed by :mod:`qckpt.storage.safetensors`; each tensor is read with ``readinto`` into its
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
        """The dir's ``qckpt.layouts.source_layout.SourceLayout``; None when nothing in it can be quantized
        (no float8 or packed tensor, no scale, no quantization config): then torch stays
        unimported."""
        if not _maybe_quantized(self.path, self.stored()):
            return None
        from qckpt.layouts.registry import source_layout

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
        claimed = {k for w in layout.weights.values() for k in w.aux_keys}
        out: list[Entry] = []
        for e in stored:
            w = by_codes.get(e.name)
            if w is not None:
                scales = w.aux_keys
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

        from qckpt.layouts.dequantize import dequantize

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
        with open_regular(file) as f:
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
        with open_regular(entry.file) as f:
            f.seek(begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != end - begin:
            raise CheckpointError(f"{entry.file}: truncated data for tensor {entry.name}")
        return buf.view(entry.torch_dtype).reshape(entry.shape)


def _maybe_quantized(path: Path, stored: list[Entry]) -> bool:
    """Whether a dir could hold a quantized layout (``qckpt.layouts.registry`` then says which, or
    refuses it): a quantization config, a float8 tensor, or a quantization parameter's name.
    A plain BF16 dir answers False from names and headers alone."""
    if (path / "hf_quant_config.json").exists():
        return True
    if (path / "config.json").exists():
        if "quantization_config" in read_json(path / "config.json", what="model config"):
            return True
    return any(
        e.dtype.startswith("F8_")
        or e.name.rpartition(".")[2].endswith(PARAM_SUFFIXES)
        or (e.dtype == "U8" and e.name.endswith(GPT_OSS_BLOCKS))  # gpt-oss's MXFP4 codes
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
            from qckpt.read.dcp_reader import OrderedFileSystemReader

            self._reader = OrderedFileSystemReader(self.path)
        return self._reader

    def dcp_metadata(self) -> Any:
        """DCP's ``Metadata`` (allow-list unpickler; data files checked)."""
        return self.reader().read_metadata()

    def _list(self) -> list[Entry]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from qckpt.read.dcp_reader import refuse_quantized_metadata

        md = self.dcp_metadata()
        refuse_quantized_metadata(md, self.path)
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
