"""Read a source checkpoint one tensor at a time, in the model's HF checkpoint naming.

Export needs two things from a checkpoint: the list of its tensors (name, dtype, shape) before
any data is read, so that the whole output can be planned and the calibration file checked up
front, and then the tensors themselves, one at a time, so that host memory stays near the
largest tensor. This module does both for a DCP dir and for an HF safetensors dir. It overlaps
with ``sources.iter_checkpoint_tensors`` (issue 4) and is kept separate so the two can be merged.

* DCP: the metadata is read with the allow-list unpickler; each tensor is loaded by a
  ``torch.distributed.checkpoint.load`` of a one-entry state dict (``no_dist=True``). Fused MoE
  experts (transformers 5 keeps them fused in the state dict) are split into per-expert views
  with :func:`qckpt.models.naming.hf_tensors`, so the names match what ``save_pretrained`` writes.
* safetensors: the header is parsed here and each tensor is read with ``readinto`` into its own
  buffer. ``safe_open`` would mmap the file, and every page it touches counts in RSS until the
  file is closed, so a multi-GB shard would show as multi-GB of resident memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qckpt.checkpoint.hf_reader import ST_DTYPES
from qckpt.checkpoint.safe_metadata import SafeFileSystemReader, read_metadata_file
from qckpt.checkpoint.sources import detect_format as _detect
from qckpt.errors import CheckpointError
from qckpt.models.naming import hf_tensors

SAFETENSORS_DTYPES: dict[str, torch.dtype] = ST_DTYPES
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class SourceEntry:
    """One stored tensor of the source (before the per-expert split)."""

    name: str  # the stored name (fused for DCP experts)
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str = ""  # safetensors: the shard file
    begin: int = 0  # safetensors: absolute byte offset of the data
    end: int = 0
    # a quantized source's weight: dequantized from these stored entries (quantized_sources)
    quant: Any = None
    parts: tuple[SourceEntry, ...] = ()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class HFEntry:
    """One tensor as the HF checkpoint names it, and the stored entry it comes from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: SourceEntry


def detect_format(path: str | os.PathLike, format: str = "auto") -> str:
    """The source's format: an explicit one as given, ``auto`` as the loader detects it."""
    if format not in ("auto", "dcp", "safetensors"):
        raise CheckpointError(f"{Path(path)}: unknown checkpoint format {format!r}")
    return _detect(path) if format == "auto" else format


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """(header dict, offset of the data section) of one safetensors file."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{file}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise CheckpointError(f"{file}: safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{file}: corrupt safetensors header") from None
    return header, 8 + n


def _safetensors_entries(root: Path) -> list[SourceEntry]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    entries: list[SourceEntry] = []
    for fname in files:
        file = root / fname
        header, data_start = read_safetensors_header(file)
        items = [(k, v) for k, v in header.items() if k != "__metadata__"]
        # file order = read order: the export then reads each shard front to back
        items.sort(key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in items:
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(
                    f"{file}: tensor {name} has unsupported dtype {info['dtype']}"
                )
            b, e = info["data_offsets"]
            entries.append(
                SourceEntry(
                    name, dtype, tuple(info["shape"]), str(file), data_start + b, data_start + e
                )
            )
    return _logical_entries(root, entries)


def _logical_entries(root: Path, entries: list[SourceEntry]) -> list[SourceEntry]:
    """A quantized dir's entries as a BF16 dir would list them: each quantized weight under its
    logical name (float32, dequantized when read) where its codes are; scales and activation
    scales gone. A plain dir's entries as they are."""
    from qckpt.checkpoint.quantized_sources import source_layout

    by_name = {e.name: e for e in entries}
    layout = source_layout(root, {e.name: (e.file, e.shape, e.dtype) for e in entries})
    if not layout.quantized:
        return entries
    by_codes = {w.codes: w for w in layout.weights.values()}
    claimed = {k for w in layout.weights.values() for k in (w.scale, w.global_scale) if k}
    out: list[SourceEntry] = []
    for e in entries:
        w = by_codes.get(e.name)
        if w is not None:
            parts = tuple(by_name[k] for k in (w.codes, w.scale, w.global_scale) if k)
            out.append(SourceEntry(w.name, torch.float32, w.shape, e.file, quant=w, parts=parts))
        elif e.name not in claimed and e.name not in layout.hidden:
            out.append(e)
    return out


def _dcp_entries(root: Path) -> list[SourceEntry]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata_file(root / ".metadata")
    first_chunk: dict[str, tuple[str, int]] = {}
    for idx, info in md.storage_data.items():
        key = (info.relative_path, info.offset)
        if idx.fqn not in first_chunk or key < first_chunk[idx.fqn]:
            first_chunk[idx.fqn] = key
    entries = [
        SourceEntry(fqn, meta.properties.dtype, tuple(meta.size))
        for fqn, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    ]
    # sorted by where the data lives, so that the reads walk each file forward
    entries.sort(key=lambda e: first_chunk.get(e.name, ("", 0)))
    from qckpt.checkpoint.quantized_sources import refuse_quantized_dcp

    refuse_quantized_dcp({e.name: e.dtype for e in entries}, str(root))
    return entries


def list_entries(path: str | os.PathLike, format: str = "auto") -> tuple[str, list[SourceEntry]]:
    """(format, stored entries in read order), without reading any tensor data."""
    root = Path(path)
    fmt = detect_format(root, format)
    entries = _dcp_entries(root) if fmt == "dcp" else _safetensors_entries(root)
    if not entries:
        raise CheckpointError(f"{root}: the checkpoint holds no tensors")
    return fmt, entries


def hf_entries(entries: list[SourceEntry], model_type: str) -> list[HFEntry]:
    """The HF checkpoint entries of the stored ones (fused experts split per expert)."""
    out: list[HFEntry] = []
    for e in entries:
        meta = torch.empty(e.shape, dtype=e.dtype, device="meta")
        for name, view in hf_tensors(e.name, meta, model_type):
            out.append(HFEntry(name, e.dtype, tuple(view.shape), e))
    return out


def read_entry(entry: SourceEntry, root: str | os.PathLike, fmt: str) -> torch.Tensor:
    """Read one stored tensor into a fresh CPU tensor (a quantized weight dequantized)."""
    if entry.quant is not None:
        from qckpt.checkpoint.quantized_sources import dequantize

        stored = {p.name: read_entry(p, root, fmt) for p in entry.parts}

        def fetch(key: str, rows: Any, cols: Any) -> torch.Tensor:
            t = stored[key]
            return t if rows is None else t[rows[0] : rows[1], cols[0] : cols[1]]

        return dequantize(entry.quant, fetch, torch.float32)
    if fmt == "safetensors":
        buf = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        with open(entry.file, "rb") as f:
            f.seek(entry.begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != entry.end - entry.begin:
            raise CheckpointError(f"{entry.file}: truncated data for tensor {entry.name}")
        if not entry.shape:
            return buf.view(entry.dtype).reshape(())
        return buf.view(entry.dtype).view(entry.shape)
    import warnings

    import torch.distributed.checkpoint as dcp

    dest = {entry.name: torch.empty(entry.shape, dtype=entry.dtype)}
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming a single process" is exactly our intent
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(dest, storage_reader=SafeFileSystemReader(str(root)), no_dist=True)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{root}: cannot read tensor {entry.name} ({exc})") from None
    return dest[entry.name]


def iter_hf_tensors(
    root: str | os.PathLike, fmt: str, entries: list[HFEntry], model_type: str
) -> Iterator[tuple[HFEntry, torch.Tensor]]:
    """(HF entry, tensor) for each entry, reading every stored tensor exactly once.

    Entries that come from one stored tensor (the experts of a fused parameter) must be
    adjacent, as :func:`hf_entries` makes them; the stored tensor is dropped after its last one.
    """
    current: SourceEntry | None = None
    views: dict[str, torch.Tensor] = {}
    for he in entries:
        if he.source is not current:
            views = {}  # drop the previous stored tensor before reading the next one
            current = he.source
            stored = read_entry(current, root, fmt)
            views = dict(hf_tensors(current.name, stored, model_type))
            del stored
        yield he, views.pop(he.name)
    views.clear()
