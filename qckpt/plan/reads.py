"""Bytes a rank reads from a checkpoint, counted from its metadata as the readers count them.

* DCP dir: the plain reader reads every stored chunk that overlaps the rank's block whole
  (``info.length`` of ``.metadata``'s storage entry, the serialized chunk), which is what
  ``OrderedFileSystemReader.bytes_read`` adds up; the fast reader (``load.reader: fast``) reads
  the overlap's rows, trailing axes whole (:func:`fast_read_bytes`), in DCP and HF dirs alike.
* HF safetensors dir: each piece overlapping the block is sliced, so the bytes are the overlap's
  elements times the stored itemsize (``HFSafetensorsReader.bytes_read``); a quantized weight
  is read as codes plus the scales of the rows and columns it needs, row chunk by row chunk
  (``qckpt.layouts.dequantize.dequantize_into``'s pattern).
* No checkpoint yet: the block's elements at the model's dtype (the BF16 checkpoint it would be).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from qckpt.plan.tensors import Held, global_shape, region

if TYPE_CHECKING:  # torch only where a checkpoint's metadata is read (DCP / HF readers)
    import torch


def _overlap(
    a_off: tuple[int, ...], a_len: tuple[int, ...], b_off: tuple[int, ...], b_len: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes as (offsets, lengths), None when empty."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off, strict=True))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_len, b_off, b_len, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _lead(box: tuple[tuple[int, ...], tuple[int, ...]], ndim: int) -> tuple[tuple, tuple]:
    """A box with the checkpoint's prepended singleton axes in front."""
    off, size = box
    k = ndim - len(off)
    return (0,) * k + tuple(off), (1,) * k + tuple(size)


class Reads:
    """Bytes read per tensor for one checkpoint (or none: the BF16 size)."""

    def __init__(
        self,
        path: str | os.PathLike | None,
        fmt: str,
        md: Any = None,
        reader: Any = None,
        fast: bool = False,
    ):
        self.path, self.format, self._md, self._reader = path, fmt, md, reader
        self.fast = fast
        self.config: Any = None  # a training checkpoint's HF config (its names' source)

    def using(self, reader: str) -> Reads:
        """These reads as ``load.reader`` ``reader`` does them: ``fast`` reads only the
        overlap of a DCP chunk (positional reads of the stored bytes), ``plain`` the whole
        chunk (``torch.load``)."""
        out = Reads(self.path, self.format, self._md, self._reader, fast=reader == "fast")
        out.config = self.config
        return out

    @classmethod
    def open(
        cls,
        path: str | os.PathLike | None,
        format: str = "auto",
        *,
        model_type: str | None = None,
        expected: dict[str, torch.Size] | None = None,
        config: Any = None,
    ) -> Reads:
        """Metadata of the checkpoint at ``path``; a path that does not exist plans from the
        model's own size (a plan must work before the checkpoint is written). A training
        checkpoint (megatron, torchtitan) is read in the names of ``config``."""
        if path is None or not os.path.exists(path):
            return cls(None, "none")
        from qckpt.read.detect import TRAINING_FORMATS, resolve_format
        from qckpt.read.readers import open_reader

        fmt = resolve_format(path, format)
        if fmt in TRAINING_FORMATS:
            from qckpt.read.training_sources import TrainingReader

            reader = TrainingReader(path, fmt, config=config, expected=expected)
            out = cls(path, fmt, reader.read_metadata(), reader)
            out.config = config
            return out
        if fmt == "dcp":
            reader = open_reader(path, fmt)
            return cls(path, fmt, reader.read_metadata(), reader)
        from qckpt.read.hf_reader import HFSafetensorsReader

        reader = HFSafetensorsReader(path, model_type=model_type, expected=expected)
        return cls(path, fmt, reader.read_metadata(), reader)

    @property
    def describe(self) -> str:
        if self.path is None:
            return "no checkpoint: bytes read are the model's own size at its dtype"
        src = getattr(self._reader, "source", None)
        layout = src.describe() if src is not None else "plain"
        return f"{self.format} checkpoint {self.path} ({layout})"

    def source_sizes(self, whole: Any) -> tuple[int, int]:
        return source_sizes(self, whole)[:2]

    def source_stats(self, whole: Any) -> tuple[int, int, int]:
        """(largest value bytes, total bytes stored, how many tensors) of an export's reads."""
        return source_sizes(self, whole)

    def _name(self, t: Held) -> str:
        for n in (t.name, *t.aliases):
            if n in self._md.state_dict_metadata:
                return n
        return t.name

    def bytes_for(self, t: Held) -> int:
        """Bytes the rank holding ``t`` reads for it (0 for what no checkpoint fills)."""
        if not t.persistent:
            return 0
        if self._md is None:
            return t.numel * t.dtype.itemsize
        name = self._name(t)
        m = self._md.state_dict_metadata.get(name)
        if m is None or not hasattr(m, "chunks"):
            return 0
        box = _lead(region(t), len(m.size))
        if self.format == "dcp":
            return self._dcp(name, m, box)
        if self.format in ("megatron", "torchtitan"):
            return self._training(name, m, box)
        return self._hf(name, m, box)

    def _training(self, name: str, m: Any, box: tuple) -> int:
        """A training checkpoint's reads: each piece's overlap, read as it lies (both
        readers read a piece's rows, never its whole stored chunk)."""
        total = 0
        for c in m.chunks:
            hit = _overlap(tuple(c.offsets), tuple(c.sizes), *box)
            if hit is not None:
                total += math.prod(hit[1]) * m.properties.dtype.itemsize
        return total

    def _dcp(self, name: str, m: Any, box: tuple) -> int:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        total = 0
        for c in m.chunks:
            hit = _overlap(tuple(c.offsets), tuple(c.sizes), *box)
            if hit is None:
                continue
            if self.fast:
                total += fast_read_bytes(tuple(c.sizes), hit[1], m.properties.dtype.itemsize)
            else:  # DCP's reader loads the whole stored chunk
                info = self._md.storage_data[MetadataIndex(name, torch.Size(c.offsets))]
                total += int(info.length)
        return total

    def _hf(self, name: str, m: Any, box: tuple) -> int:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        total = 0
        raw = self._reader.raw_index
        for c in m.chunks:
            hit = _overlap(tuple(c.offsets), tuple(c.sizes), *box)
            if hit is None:
                continue
            piece = self._md.storage_data[MetadataIndex(name, torch.Size(c.offsets))]
            rel = tuple(o - co for o, co in zip(hit[0], c.offsets, strict=True))
            offs, lens = rel[piece.lead :], hit[1][piece.lead :]
            if piece.quant is not None:
                rows = (offs[0], offs[0] + lens[0])
                cols = (offs[1], offs[1] + lens[1])
                total += quantized_read_bytes(piece.quant, raw, rows, cols)
            elif self.fast:
                _, stored, dtype = raw[piece.key]
                total += fast_read_bytes(tuple(stored), tuple(lens), dtype.itemsize)
            else:  # safe_open slices: the overlap alone
                total += math.prod(lens) * raw[piece.key][2].itemsize
        return total


def fast_read_bytes(stored: tuple[int, ...], lengths: tuple[int, ...], itemsize: int) -> int:
    """What the fast reader reads of a region of ``lengths`` in a row-major stored tensor of
    shape ``stored`` (``fast_read.split_region``): whole rows along the first axis the region
    is longer than one on, every trailing axis whole."""
    if math.prod(lengths) == 0:
        return 0
    nd = len(stored)
    k = next((i for i, n in enumerate(lengths) if n > 1), max(nd - 1, 0))
    rows = lengths[k] if nd else 1
    return rows * math.prod(stored[k + 1 :]) * itemsize


def quantized_read_bytes(w: Any, raw: dict, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """What ``dequantize_into`` fetches for rows x cols of a quantized source weight ``w``:
    codes chunk by chunk, and the scales each chunk multiplies by."""
    from qckpt.layouts.dequantize import CHUNK_ELEMS

    def nbytes(key: str, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * raw[key][2].itemsize

    nc = cols[1] - cols[0]
    step = max(1, CHUNK_ELEMS // max(nc, 1))
    if w.granularity == "block":
        step = max(w.block[0], step // w.block[0] * w.block[0])
    c0, c1 = cols
    total = 0
    for a in range(rows[0], rows[1], step):
        b = min(rows[1], a + step)
        if not (w.scheme.packed_fp4 or w.scheme.mx):
            total += nbytes(w.codes, (b - a, nc))
            if w.granularity == "block":
                b0, b1 = w.block
                total += nbytes(w.scale, (-(-b // b0) - a // b0, -(-c1 // b1) - c0 // b1))
            else:  # per tensor or per channel: the whole scale tensor, once per chunk
                total += nbytes(w.scale, raw[w.scale][1])
            if w.zero_point:  # asymmetric groups: their zero points, all rows' words
                total += nbytes(w.zero_point, raw[w.zero_point][1])
            continue
        total += nbytes(w.codes, (b - a, -(-c1 // 2) - c0 // 2))
        g = w.scheme.group
        total += nbytes(w.scale, (b - a, -(-c1 // g) - c0 // g))
        if w.global_scale:
            total += nbytes(w.global_scale, raw[w.global_scale][1])
    return total


def whole_bytes(t: Held) -> int:
    """The whole (unsharded) tensor at its nominal dtype."""
    return math.prod(global_shape(t)) * t.dtype.itemsize


def _value_bytes(shape: Any, dtype: Any) -> int:
    return math.prod(int(s) for s in shape) * dtype.itemsize


def source_sizes(reads: Reads, whole: Any) -> tuple[int, int, int]:
    """(largest tensor's value bytes, total bytes stored, tensor count) of what an export
    reads: the checkpoint's tensors (as its source lists them: a quantized weight's value in
    float32), or, with no checkpoint, the whole model's at its dtype (``whole``: a
    ``plan.whole.SpecWhole`` or ``pipeline.plan_meta.MetaWhole``)."""
    if reads.path is None:  # the HF BF16 checkpoint it would be: fused experts per expert
        sizes = whole.hf_value_sizes()
        return max(sizes, default=0), sum(sizes), len(sizes)
    from qckpt.read.readers import open_source

    entries = open_source(reads.path, reads.format, config=reads.config).entries()
    largest = max((_value_bytes(e.shape, e.torch_dtype) for e in entries), default=0)
    return largest, sum(e.nbytes for e in entries), len(entries)
