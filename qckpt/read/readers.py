"""The readers' factory, above every reader: a checkpoint path -> its source or its reader.

* ``open_source(path, format)``: the :class:`~qckpt.read.source.CheckpointSource` of a
  checkpoint (entries and tensors in its stored names; :mod:`qckpt.read.hf_names` for HF
  checkpoint naming), what export, convert and inspect read;
* ``open_reader(path, format, ...)``: a DCP ``StorageReader`` in the model's state-dict names
  (an HF dir's per-expert tensors fused), plain or fast, what ``load`` plans against;
  ``checkpoint_names_shapes`` / ``iter_checkpoint_tensors`` read through it.

Here rather than beside the base classes, so that no reader imports the module that chooses it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from qckpt.errors import CheckpointError
from qckpt.read.detect import TRAINING_FORMATS, is_dcp_dir, resolve_format
from qckpt.read.source import CheckpointSource
from qckpt.read.sources import DCPSource, SafetensorsSource
from qckpt.storage import safetensors as stio

if TYPE_CHECKING:
    import torch
    from torch import nn

    from qckpt.read.dcp_reader import OrderedFileSystemReader
    from qckpt.read.hf_reader import HFSafetensorsReader


def open_source(
    path: str | os.PathLike, format: str = "auto", *, config: Any = None
) -> CheckpointSource:
    """The source of the checkpoint at ``path`` (``format``: one of ``FORMATS``); a training
    checkpoint (megatron, torchtitan) needs ``config``, the HF config its tensors map onto."""
    fmt = resolve_format(path, format)
    if fmt in TRAINING_FORMATS:
        from qckpt.read.training_sources import TrainingSource

        return TrainingSource(path, fmt, config)
    return DCPSource(path) if fmt == "dcp" else SafetensorsSource(path)


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
    ``reader="fast"`` gives the fast-path twin (:mod:`qckpt.read.fast_readers`: parallel reads,
    at most ``max_inflight`` quantized destinations live, ``threads`` reader threads).
    """
    if reader not in ("fast", "plain"):
        raise CheckpointError(f"reader: must be fast or plain, got {reader!r}")
    fast = {"max_inflight": max_inflight, "threads": threads} if reader == "fast" else {}
    fmt = resolve_format(path, format)
    if fmt in TRAINING_FORMATS:
        return _training_reader(path, fmt, model, expected, fast)
    if fmt == "dcp":
        from qckpt.read.dcp_reader import OrderedFileSystemReader, refuse_quantized_metadata

        if not is_dcp_dir(path):
            raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata)")
        if fast:
            from qckpt.read.fast_readers import FastDCPReader

            dcp_reader: OrderedFileSystemReader = FastDCPReader(path, **fast)
        else:
            dcp_reader = OrderedFileSystemReader(path)
        refuse_quantized_metadata(dcp_reader.read_metadata(), path)
        return dcp_reader
    from qckpt.read.hf_reader import HFSafetensorsReader

    stio.list_files(path)  # a clear error for a dir without any
    model_type = None
    if model is not None:
        from qckpt.models.build import model_type as _mt

        model_type = _mt(model) or None
        if expected is None:
            expected = {k: v.shape for k, v in model.state_dict(keep_vars=True).items()}
    if fast:
        from qckpt.read.fast_readers import FastHFReader

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
    from qckpt.read.training_sources import FastTrainingReader, TrainingReader

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
