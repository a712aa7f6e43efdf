"""What export needs to know of the model, kept in the calibration file by ``calibrate``.

Export must know which checkpoint tensors are linears (quantized), routers and embeddings (never
quantized); it learns that by building the model on the meta device, which means importing
transformers' modeling code: 2-3 s of every export's start-up on a CPU. ``calibrate`` has that
code loaded anyway, so it writes the three lists and the model's config into the calibration
file's metadata (``model``); an export of the same ``model.source`` (a model dir whose
config.json is unchanged, or the same built-in name) reads them back and imports no model code.
Anything else (an older file, another source) and export builds the meta model as before.

Torch-free: the CLI reads the record in its start-up to decide what to import.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from qckpt.errors import CheckpointError
from qckpt.storage.files import open_regular

META_KEY = "model"


_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def config_digest(source: str) -> str | None:
    """The sha256 of a model dir's config.json bytes; None for a built-in name."""
    p = Path(source) / "config.json"
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def make_record(source: str, config: dict, modules: tuple[set, set, list]) -> dict[str, Any]:
    linears, routers, embeddings = modules
    return {
        "source": source,
        "config_sha256": config_digest(source),
        "config": config,
        "linears": sorted(linears),
        "routers": sorted(routers),
        "embeddings": list(embeddings),
    }


def peek(path: str | Path) -> dict[str, Any] | None:
    """The record in the calibration file at ``path`` (its header only); None without one."""
    try:
        with open_regular(Path(path)) as f:  # a FIFO in its place is no record, not a wait
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                return None
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        rec = json.loads(meta[META_KEY])
    except (OSError, ValueError, KeyError, TypeError, struct.error, CheckpointError):
        return None
    return rec if isinstance(rec, dict) else None


def usable(rec: dict[str, Any] | None, source: str) -> bool:
    """Whether ``rec`` describes the model ``source`` names now."""
    if not rec or rec.get("source") != source:
        return False
    try:
        return rec.get("config_sha256") == config_digest(source)
    except OSError:
        return False


def modules_of(rec: dict[str, Any]) -> tuple[set[str], set[str], list[str]]:
    return set(rec["linears"]), set(rec["routers"]), list(rec["embeddings"])
