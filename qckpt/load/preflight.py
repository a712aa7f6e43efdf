"""Before a load reads a byte: the reader for the model's shapes, and the checkpoint checked.

``model_reader`` opens the storage reader for the model's (sharded) shapes; ``destinations``
gives the model's state dict as load destinations; ``check_fit`` refuses, from metadata alone,
a checkpoint that cannot fill them (a missing tensor, a shape, a dtype, a tensor only partly
covered) with a one-line ``CheckpointError`` naming it. ``preflight`` runs the three in order:
what ``load_checkpoint`` does first, and what layer-by-layer calibration does before its first
layer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from qckpt.errors import CheckpointError
from qckpt.load.destination import prepended_axes
from qckpt.parallel.shard import model_shards
from qckpt.read.detect import resolve_format
from qckpt.read.readers import open_reader


def destinations(model: nn.Module | dict[str, Any], md: Metadata) -> dict[str, Any]:
    """The model's state dict as load destinations: the Parameter objects themselves
    (``keep_vars``), tied names collapsed onto the one the checkpoint holds."""
    sd = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else dict(model)
    by_id: dict[int, list[str]] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            by_id.setdefault(id(v), []).append(k)
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if k.endswith("._extra_state") and k not in md.state_dict_metadata:
            # Transformer Engine's per-module recipe metadata: a checkpoint written from a plain
            # model has none, and the recipe the model was built with is the one to keep
            continue
        names = by_id.get(id(v), [k]) if isinstance(v, torch.Tensor) else [k]
        if len(names) > 1:
            present = [n for n in names if n in md.state_dict_metadata]
            keep = present[0] if present else names[0]
            if k != keep:
                continue
        out[k] = v
    return out


def expert_shards(
    model: nn.Module | dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Local blocks of EP-sharded fused experts (``qckpt.parallel.expert.shard_experts``):
    param name -> (global shape, offsets of this rank's experts)."""
    if not isinstance(model, nn.Module):
        return {}
    return {n: (s.global_shape, s.offsets) for n, s in model_shards(model, "expert").items()}


def tensor_shards(
    model: nn.Module | dict[str, Any],
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Local blocks of TP-sharded linears (``qckpt.parallel.tensor.shard_tensor_parallel``):
    param name -> (global shape, offsets of this rank's rows (column-parallel) or columns
    (row-parallel)). A row-parallel bias is whole on every rank and not listed."""
    if not isinstance(model, nn.Module):
        return {}
    return {n: (s.global_shape, s.offsets) for n, s in model_shards(model, "tp").items()}


def _loadable(src: torch.dtype, dst: torch.dtype) -> bool:
    if src == dst:
        return True
    return src.is_floating_point and dst.is_floating_point


def check_fit(
    state: dict[str, Any],
    md: Metadata,
    path: str | os.PathLike,
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
) -> None:
    """Raise a one-line CheckpointError for the first tensor the checkpoint cannot fill."""
    where = f"checkpoint {path}"
    shards = shards or {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        m = md.state_dict_metadata.get(name)
        if m is None:
            raise CheckpointError(f"{name}: missing from {where}")
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"{name}: {where} holds a non-tensor value under this name")
        shape = tuple(shards[name][0]) if name in shards else tuple(t.shape)
        if tuple(m.size) != shape and (name in shards or prepended_axes(m.size, shape, name) == 0):
            raise CheckpointError(f"{name}: shape {tuple(m.size)} in {where}, {shape} in the model")
        if not _loadable(m.properties.dtype, t.dtype):
            raise CheckpointError(
                f"{name}: dtype {m.properties.dtype} in {where} cannot load into {t.dtype}"
            )
        covered = sum(math.prod(c.sizes) for c in m.chunks)
        if covered != math.prod(m.size):
            raise CheckpointError(
                f"{name}: {where} holds {covered} of its {math.prod(m.size)} elements"
            )


def model_reader(
    model: nn.Module,
    path: str | os.PathLike,
    fmt: str,
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    kind: str = "fast",
    max_inflight: int = 1,
    threads: int | None = None,
) -> Any:
    """The storage reader (``kind``: fast | plain) for the model's (sharded) shapes; it can be
    passed to :func:`load_checkpoint` again and again (an HF dir's index is built once)."""
    expected = {k: torch.Size(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    expected.update({k: torch.Size(g) for k, (g, _) in shards.items()})
    reader = open_reader(
        path,
        fmt,
        model=model,
        expected=expected,
        reader=kind,
        max_inflight=max_inflight,
        threads=threads,
    )
    reader.kind = kind  # what a load through it reports
    return reader


@dataclass
class Preflight:
    """What a load knows before it reads a byte: the checkpoint's format, the model's shards
    (name -> (global shape, offsets of this rank's block)), the reader, the checkpoint's DCP
    metadata and the destinations it fills (checked against it)."""

    format: str
    shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    reader: Any
    metadata: Metadata
    state: dict[str, Any]


def preflight(
    model: nn.Module,
    path: str | os.PathLike,
    format: str = "auto",
    *,
    reader: Any = "fast",
    max_inflight: int = 1,
    threads: int | None = None,
    only: Collection[str] | None = None,
) -> Preflight:
    """The reader for ``model``'s (sharded) shapes (``reader``: fast | plain, or one already
    open, reused and its byte count restarted) and the checkpoint at ``path`` checked against
    the destinations (``only``: the state-dict names to fill) from metadata alone; a one-line
    CheckpointError for the first tensor it cannot fill."""
    fmt = resolve_format(path, format)
    shards = {**expert_shards(model), **tensor_shards(model)}
    if isinstance(reader, str):
        reader = model_reader(model, path, fmt, shards, reader, max_inflight, threads)
    else:
        reader.bytes_read = 0  # this load's
    md = reader.read_metadata()
    state = destinations(model, md)
    if only is not None:
        state = {k: v for k, v in state.items() if k in only}
    check_fit(state, md, path, shards)
    return Preflight(fmt, shards, reader, md, state)
