"""A safetensors file written one tensor at a time, for files too large to build in memory
(GPTQ's sidecar of a whole model's weights under ``calibrate.offload``).

The format puts the header (JSON, after its u64 length) before the data, and the header holds
every tensor's offsets, so a writer that does not know the tensors up front reserves room for
the header, appends each tensor's bytes as it comes, and writes the header last into the room,
padded with spaces (which the format allows). The reservation comes from the names that may be
written: each entry's dtype, shape and offsets take at most ``ENTRY_BYTES`` besides its name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from typing import BinaryIO

import torch

from qckpt.storage.safetensors import dtype_code

ENTRY_BYTES = 256  # '"name":{"dtype":"BF16","shape":[...],"data_offsets":[a,b]},' less the name


class TooManyTensors(ValueError):
    """More header than the room reserved for it (a name not announced)."""


class StreamWriter:
    """``add(name, tensor)`` appends a tensor; ``finish(metadata)`` writes the header. The file
    ``f`` (opened ``wb``) is the caller's: on a failure the caller discards it."""

    def __init__(self, f: BinaryIO, names: Iterable[str]) -> None:
        room = 64 + sum(len(json.dumps(n)) + ENTRY_BYTES for n in names)
        self.room = -(-room // 8) * 8  # the data starts 8-aligned
        self.f = f
        self.entries: dict[str, dict] = {}
        self.at = 0
        f.seek(8 + self.room)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"{name}: written twice")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self.f.write(memoryview(raw))
        n = int(raw.nbytes)
        shape = list(t.shape)
        self.entries[name] = {
            "dtype": dtype_code(t.dtype), "shape": shape, "data_offsets": [self.at, self.at + n]
        }  # fmt: skip
        self.at += n

    def finish(self, metadata: dict[str, str] | None = None) -> None:
        head = {"__metadata__": metadata} if metadata else {}
        text = json.dumps({**head, **self.entries}, separators=(",", ":")).encode()
        if len(text) > self.room:
            raise TooManyTensors(f"the header needs {len(text)} bytes, {self.room} were reserved")
        self.f.seek(0)
        self.f.write(struct.pack("<Q", self.room) + text + b" " * (self.room - len(text)))
        self.f.flush()
