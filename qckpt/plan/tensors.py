"""What one rank's model holds, tensor by tensor, read off a sharded model on the meta device.

The model is the one a command builds (``pipeline.model``'s order: built on meta, EP then TP
sharding); which weights become quantized parameters is asked of
``models.quantize_params.quantizable_params``, the function the commands use. Every rank of a
group holds an equal block (the sharders refuse uneven splits), so the tensors of rank ``r`` are
rank 0's with each :class:`ShardSpec` moved to ``r``'s block (:func:`for_rank`), through the
same ``ShardSpec.block`` rule the sharders use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from qckpt.parallel.shard import ShardSpec
from qckpt.plan.fields import plain_nbytes, quantized_nbytes

if TYPE_CHECKING:
    from torch import nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, kw_only=True)
class Held:
    """One tensor a rank holds: its local shape, nominal dtype, format and bytes."""

    name: str  # state-dict name (the one the checkpoint holds, for tied weights)
    shape: tuple[int, ...]  # this rank's block
    dtype: Any  # nominal (high-precision) dtype: a torch dtype, or a plan.spec.DType
    fmt: str | None = None  # quantized format, None for a plain tensor
    opts: tuple[tuple[str, Any], ...] = ()  # the format's options
    shard: ShardSpec | None = None
    persistent: bool = True  # in the state dict: a checkpoint fills it
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)
    layer: int | None = None  # decoder layer index, None outside the layers

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nominal_bytes(self) -> int:
        """Bytes of its high-precision value (a load's scratch for a quantized destination)."""
        return plain_nbytes(self.shape, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes it holds: codes and scales for a quantized parameter."""
        if self.fmt is None:
            return self.nominal_bytes
        return quantized_nbytes(self.fmt, self.shape, dict(self.opts))

    def as_format(self, fmt: str | None, opts: dict[str, Any] | None = None) -> Held:
        return replace(self, fmt=fmt, opts=tuple(sorted((opts or {}).items())))


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def rank_tensors(
    model: nn.Module,
    *,
    params: str = "none",
    ignore: Iterable[str] = (),
    opts: dict[str, Any] | None = None,
) -> list[Held]:
    """Every tensor ``model`` (sharded, on meta) holds, with ``params`` as the format of the
    weights ``quantize_model_params`` would replace (``"none"``: all plain)."""
    import torch

    from qckpt.models.quantize_params import plain_params, quantizable_params
    from qckpt.parallel.shard import model_shards

    quantized = set() if plain_params(params) else set(quantizable_params(model, ignore=ignore))
    shards = model_shards(model)
    names_of: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            names_of.setdefault(id(v), []).append(k)
    out: list[Held] = []
    seen: set[int] = set()
    for k, v in state.items():
        if not isinstance(v, torch.Tensor) or id(v) in seen:
            continue
        seen.add(id(v))
        names = names_of[id(v)]
        fmt = params if any(n in quantized for n in names) else None
        out.append(
            Held(
                name=k,
                shape=tuple(int(s) for s in v.shape),
                dtype=v.dtype,
                fmt=fmt,
                opts=tuple(sorted((opts or {}).items())) if fmt else (),
                shard=shards.get(k),
                aliases=tuple(n for n in names if n != k),
                layer=layer_of(k),
            )
        )
    for k, b in model.named_buffers():
        if id(b) not in seen:  # non-persistent (rotary tables): allocated, never read
            seen.add(id(b))
            held = Held(name=k, shape=tuple(b.shape), dtype=b.dtype, persistent=False)
            out.append(replace(held, layer=layer_of(k)))
    return out


def for_rank(tensors: list[Held], ep_rank: int, tp_rank: int) -> list[Held]:
    """Rank 0's tensors as the rank at (``ep_rank``, ``tp_rank``) of its groups holds them."""
    out = []
    for t in tensors:
        s = t.shard
        if s is None:
            out.append(t)
            continue
        r = ep_rank if s.kind == "expert" else tp_rank
        moved = ShardSpec.block(s.kind, s.global_shape, s.dim, r, s.world)
        out.append(replace(t, shard=moved))
    return out


def region(t: Held) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the rank's block in the whole tensor."""
    if t.shard is None:
        return (0,) * len(t.shape), t.shape
    return t.shard.offsets, t.shape


def global_shape(t: Held) -> tuple[int, ...]:
    return t.shard.global_shape if t.shard is not None else t.shape
