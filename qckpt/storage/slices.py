"""Rectangles of stored tensors read out of safetensors files, by stored name.

A quantized source's weight is read as its codes and scales, a rectangle at a time (a TP slice,
one expert, a row chunk): ``Fetch(key, rows, cols)`` is that read, ``SafetensorsFetch`` the one
over a dir's files (``safe_open`` slices: only the asked rows and columns leave the file).
``Index``: every stored tensor of a dir, name -> (file, shape, dtype), from its headers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# name -> (file, shape, dtype), what ``hf_reader.hf_index`` reads from the headers
Index = dict[str, tuple[str, tuple[int, ...], torch.dtype]]


# (stored key, row range, col range) -> CPU tensor; None ranges: the whole tensor
Fetch = Callable[[str, tuple[int, int] | None, tuple[int, int] | None], torch.Tensor]


class SafetensorsFetch:
    """A ``Fetch`` over a dir's safetensors files (``safe_open`` slices: only the asked rows
    and columns leave the file). ``bytes_read`` counts them."""

    def __init__(self, root: str | os.PathLike, index: Index) -> None:
        self.root = Path(root)
        self.index = index
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}

    def __call__(
        self, key: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None
    ) -> torch.Tensor:
        from safetensors import safe_open

        f = self.index[key][0]
        h = self._handles.get(f)
        if h is None:
            h = safe_open(str(self.root / f), framework="pt", device="cpu")
            self._handles[f] = h
        if rows is None:
            t = h.get_tensor(key)
        else:
            t = h.get_slice(key)[rows[0] : rows[1], cols[0] : cols[1]]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()
