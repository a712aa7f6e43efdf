"""Shards as values: which block of a whole checkpoint tensor a rank's parameter holds.

Expert and tensor parallelism (:mod:`qckpt.parallel.expert`, :mod:`qckpt.parallel.tensor`)
replace a parameter by one block of it and record a :class:`ShardSpec` for it on its module
(:func:`set_shard`). Everyone who needs the whole tensor's view reads the spec: the loader (which
block of the checkpoint tensor to read), the model fingerprint (the whole shapes), the
calibrator (the global expert ids; the TP amax gather) and the export. Nothing recomputes a
block from the mesh.

A spec is a contiguous block along one dim: ``offsets`` is zero except at ``dim``. Under EP the
dim is 0 of a fused experts parameter ``[E, ...]`` and the block is this rank's experts; under TP
it is a linear's output rows (``dim`` 0, column-parallel; its bias too) or input columns (``dim``
1, row-parallel; the bias stays whole and has no spec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch-free at import: qckpt plan makes specs without a model
    from torch import nn

_ATTR = "qckpt_shards"  # on a module: {parameter name in the module: ShardSpec}


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    kind: Literal["expert", "tp"]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    dim: int  # the sharded dim
    local: int  # this rank's length along ``dim``
    rank: int  # this rank's index in the EP / TP group
    world: int  # the group's size

    def __post_init__(self) -> None:
        if self.kind not in ("expert", "tp"):
            raise ValueError(f"ShardSpec.kind: expert or tp, got {self.kind!r}")
        if len(self.offsets) != len(self.global_shape) or not 0 <= self.dim < len(self.offsets):
            raise ValueError(f"ShardSpec: offsets {self.offsets} for shape {self.global_shape}")
        if any(o for i, o in enumerate(self.offsets) if i != self.dim):
            raise ValueError(f"ShardSpec: a block along dim {self.dim} only, got {self.offsets}")
        if self.start + self.local > self.global_shape[self.dim]:
            raise ValueError(f"ShardSpec: block past the end of {self.global_shape}")

    @property
    def start(self) -> int:
        return self.offsets[self.dim]

    @property
    def stop(self) -> int:
        return self.start + self.local

    @property
    def indices(self) -> range:
        """The global indices along ``dim`` this rank holds (its expert ids under EP)."""
        return range(self.start, self.stop)

    @property
    def total(self) -> int:
        """The whole tensor's length along ``dim`` (the global expert count under EP)."""
        return self.global_shape[self.dim]

    @classmethod
    def block(
        cls, kind: str, global_shape, dim: int, rank: int, world: int, start: int | None = None
    ) -> ShardSpec:
        """Rank ``rank``'s equal block of ``world`` along ``dim`` (or from ``start``)."""
        shape = tuple(int(s) for s in global_shape)
        local = shape[dim] // world
        begin = rank * local if start is None else start
        offsets = tuple(begin if i == dim else 0 for i in range(len(shape)))
        return cls(
            kind=kind, global_shape=shape, offsets=offsets, dim=dim, local=local, rank=rank,
            world=world,
        )  # fmt: skip


def set_shard(module: nn.Module, param: str, spec: ShardSpec) -> None:
    shards = dict(getattr(module, _ATTR, None) or {})
    shards[param] = spec
    setattr(module, _ATTR, shards)


def shards_of(module: nn.Module) -> dict[str, ShardSpec]:
    """The specs of ``module``'s own parameters, by parameter name."""
    return dict(getattr(module, _ATTR, None) or {})


def shard_of(module: nn.Module, param: str) -> ShardSpec | None:
    return (getattr(module, _ATTR, None) or {}).get(param)


def model_shards(model: nn.Module, kind: str | None = None) -> dict[str, ShardSpec]:
    """Every sharded parameter of ``model`` (of one ``kind``, or all), by its state-dict name."""
    out = {}
    for name, mod in model.named_modules():
        for param, spec in shards_of(mod).items():
            if kind is None or spec.kind == kind:
                out[f"{name}.{param}" if name else param] = spec
    return out
