"""A checkpoint as a source of tensors: entries from metadata alone, then one tensor at a time.

A :class:`CheckpointSource` lists its tensors from metadata alone (``entries()``: name, dtype,
shape, file; no tensor data read) and reads them one at a time (``read(entry)``,
``iter_tensors()``), so that export, convert and inspect plan first and then stream with host
memory near the largest tensor. Names are the stored ones: a DCP dir's state-dict names (fused
experts as one tensor), an HF dir's checkpoint names (per expert).

Quantized sources (FP8 blockwise, compressed-tensors, ModelOpt) plug in as sources too: an
:class:`Entry` can say what its value's ``dtype`` is, what is ``stored`` on disk and which
companion ``scales`` entries a reader needs with it, and ``read`` is the one place a subclass or
wrapper turns stored bytes into values. The sources are :mod:`qckpt.read.sources`,
:mod:`qckpt.read.training_sources` and :mod:`qckpt.read.gptq_source`; ``open_source``
(:mod:`qckpt.read.readers`) picks one. Torch-free.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.errors import CheckpointError
from qckpt.storage import safetensors as stio

if TYPE_CHECKING:
    import torch


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
