"""The plan's reference path: the whole model built on the meta device (torch, transformers).

:class:`MetaWhole` answers what ``qckpt.pipeline.plan`` asks of a model (the questions
``qckpt.plan.whole.SpecWhole`` answers from the config alone) off the model
``models.build.build_model`` makes on meta, each layout sharded by
:func:`qckpt.pipeline.model.shard` (the commands' own EP-then-TP order) on a mesh that names
rank 0's place and has no process groups (nothing runs a forward). The plan takes it where
the config cannot be sized alone (``plan.spec.model_spec``'s reason) or a training
checkpoint's reader needs the transformers config; the tests hold the two paths equal.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.model import shard
from qckpt.plan.schemes import Linear, checkpoint_linears
from qckpt.plan.tensors import Held, rank_tensors

_PLANNED = object()  # stands in for a process group: sharding records it, no forward runs
_BUILT: dict[tuple, nn.Module] = {}


def _mesh(world: int, ep: int, tp: int) -> Mesh:
    return Mesh(
        world_size=world,
        dp=world // (ep * tp),
        ep=ep,
        tp=tp,
        device=torch.device("meta"),
        ep_group=_PLANNED if ep > 1 else None,  # type: ignore[arg-type]
        tp_group=_PLANNED if tp > 1 else None,  # type: ignore[arg-type]
    )


def _whole(source: str, dtype: str) -> nn.Module:
    """The whole model on meta. Kept for the next plan of the same config in this process (a
    large model takes seconds to build); nothing here changes it: layouts shard copies."""
    from qckpt.models.build import build_model

    cfg = Path(source) / "config.json"
    key = (source, dtype, cfg.stat().st_mtime_ns if cfg.is_file() else None)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = build_model(source, dtype=dtype, device="meta")
    return _BUILT[key]


class MetaWhole:
    """A model's plan questions answered off its meta build (see the module doc)."""

    sized_by = "meta model"

    def __init__(self, source: str, dtype: str, world: int):
        from qckpt.models.build import model_type
        from qckpt.term import quiet_torch_logs

        quiet_torch_logs()
        self.model = _whole(source, dtype)
        self.world = world
        self.model_type = model_type(self.model)
        self.itemsize = self.model.dtype.itemsize
        cfg = self.model.config
        self.config = cfg  # a training checkpoint's reader names its tensors by it
        self._text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        out_emb = self.model.get_output_embeddings()
        self.output_embedding = next(
            (n for n, m in self.model.named_modules() if m is out_emb), None
        )

    def attr(self, key: str, default: Any = None) -> Any:
        return getattr(self._text, key, default)

    def summary(self) -> dict[str, int]:
        sd = self.model.state_dict()
        return {
            "parameters": sum(v.numel() for v in sd.values()),
            "bytes": sum(v.numel() * v.element_size() for v in sd.values()),
            "largest_tensor_numel": max((v.numel() for v in sd.values()), default=0),
        }

    def expected(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in self.model.state_dict(keep_vars=True).items()}

    def hf_value_sizes(self) -> list[int]:
        from qckpt.models.naming import hf_tensors

        sd = self.model.state_dict()
        views = [v for k, t in sd.items() for _, v in hf_tensors(k, t, self.model_type)]
        return [v.numel() * v.dtype.itemsize for v in views]

    def linears(self) -> dict[str, Linear]:
        return checkpoint_linears(self.model, self.model_type)

    def tp_linears(self) -> int:
        from qckpt.parallel.tensor import tp_plan

        return len(tp_plan(self.model))

    def sharded(self, ep: int, tp: int) -> nn.Module:
        """A copy of the model sharded for rank 0 (a UsageError naming why it cannot be)."""
        model = copy.deepcopy(self.model)
        shard(model, _mesh(self.world, ep, tp))
        return model

    def held(self, shards: nn.Module, params: str, ignore: Iterable[str]) -> list[Held]:
        return rank_tensors(shards, params=params, ignore=ignore)


def block_refusal(held: list[Held]) -> str | None:
    """The sharded load's refusal of a split inside a scale block of ``params``
    (``qckpt.load.shard_scales.check_blocks``, asked with meta tensors), or None."""
    from qckpt import formats
    from qckpt.errors import UsageError
    from qckpt.load.shard_scales import check_blocks

    split = [t for t in held if t.fmt is not None and t.shard is not None]
    state = {
        t.name: formats.empty(t.shape, t.fmt, nominal_dtype=t.dtype, device="meta", **dict(t.opts))
        for t in split
    }
    try:
        check_blocks(state, {t.name: t.shard for t in split})
    except UsageError as exc:
        return str(exc)
    return None
