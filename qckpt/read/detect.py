"""What a checkpoint path holds: ``dcp``, ``safetensors``, ``megatron`` or ``torchtitan``.

``resolve_format`` is the one place that says it (``CheckpointError`` otherwise), from the dir's
files alone: ``.metadata`` (a DCP dir; Megatron's ``metadata.json`` names its ``torch_dist``
backend, torchtitan's key names are its own), safetensors files (an HF dir), a Megatron save dir
(``latest_checkpointed_iteration.txt``: its latest ``iter_*`` dir is read). Torch-free but for a
DCP dir's ``.metadata``, read through the allow-list unpickler.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.errors import CheckpointError
from qckpt.storage import safetensors as stio
from qckpt.storage.files import read_json

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

FORMATS = ("auto", "dcp", "safetensors", "megatron", "torchtitan")
TRAINING_FORMATS = ("megatron", "torchtitan")  # DCP dirs in a training framework's names


def is_dcp_dir(path: str | os.PathLike) -> bool:
    """A dir with a ``.metadata`` entry (checked as a file only when it is read)."""
    return os.path.lexists(Path(path) / ".metadata")


def detect_format(path: str | os.PathLike) -> str:
    """``dcp`` for a dir with ``.metadata`` in HF names, ``megatron`` / ``torchtitan`` for one
    a training framework wrote (:func:`detect_training`), ``safetensors`` for one with
    safetensors files."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if not p.is_dir():
        raise CheckpointError(f"{p}: a checkpoint is a directory (DCP or HF safetensors)")
    if (p / "latest_checkpointed_iteration.txt").is_file() and not is_dcp_dir(p):
        return "megatron"  # a Megatron save dir: its latest iter_* dir is read
    if is_dcp_dir(p):
        return detect_training(p) or "dcp"
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


# torchtitan's key names, as its state-dict adapters write them (``inspect`` reads them too)
TITAN_KEY = re.compile(
    r"^(model\.)?(tok_embeddings\.weight|layers\.\d+\.(attention|feed_forward|moe)\.)"
)


def megatron_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The dir's ``metadata.json`` when it names the ``torch_dist`` backend, else None."""
    p = Path(path) / "metadata.json"
    if not p.is_file():
        return None
    cfg = read_json(p, what="Megatron checkpoint config")
    return cfg if cfg.get("sharded_backend") == "torch_dist" else None


def resolve_iteration(path: str | os.PathLike) -> Path:
    """A Megatron save dir (``latest_checkpointed_iteration.txt``) -> its latest ``iter_*`` dir."""
    p = Path(path)
    tracker = p / "latest_checkpointed_iteration.txt"
    if not (p / ".metadata").exists() and tracker.is_file():
        text = tracker.read_text().strip()
        if text.isdigit():
            return p / f"iter_{int(text):07d}"
    return p


def detect_training(path: str | os.PathLike, md: Metadata | None = None) -> str | None:
    """``megatron``, ``torchtitan`` or None (a plain DCP dir) for a dir with ``.metadata``."""
    if megatron_config(path) is not None:
        return "megatron"
    if md is None:
        from qckpt.storage.dcp_metadata import read_checked_metadata  # imports torch

        md = read_checked_metadata(path)
    if any(TITAN_KEY.match(k) for k in md.state_dict_metadata):
        return "torchtitan"
    return None
