"""Whole-tensor scales for a rank that holds one block of a tensor (sharded loads).

Under ``parallel.ep`` / ``parallel.tp`` a rank's parameter is one block of a checkpoint tensor
(its :class:`qckpt.parallel.shard.ShardSpec`). A quantized parameter must then hold exactly the
matching slice of what a one-rank load makes, which decides per format:

* scales that span the split are made from the whole tensor's amax, a MAX all-reduce of the
  local amaxes over the tensor's shard group (EP group for experts, TP group for linears),
  taken before the cast. ``fp8`` per tensor (a fused-experts ``[E, ...]`` tensor has ONE scale
  for all its experts, so every EP rank needs the max over all experts), ``fp8`` per channel
  when the split cuts the rows (row-parallel: one amax per row, reduced elementwise), and
  ``nvfp4``'s global scale. Max is exact, so the scale is bit for bit the unsharded one.
* ``fp8`` per channel split along dim 0 (column-parallel; experts, whose channels are whole
  experts) keeps whole rows: nothing to reduce.
* ``fp8_delayed`` quantizes with the ``quant_scale`` it was built with, not from the loaded
  value: :func:`agree_delayed_state` makes that state the whole tensor's at build time. The
  whole amax is reduced for it as well and passed to the quantize, for a tensor that has no
  scale yet and takes its first one from the value (the format decides which it is; every
  rank of a group holds the same state after the agreement, so they all decide alike).
* block scales (``fp8_block`` tiles over the last two dims, ``mxfp8`` 1x32 and ``nvfp4`` 1x16
  along the last dim) are the unsharded ones when every split falls on a block boundary;
  :func:`check_blocks` refuses, before anything is read, a split that cuts a block (one line
  naming the parameter, the split and the block): such a block's scale would span two ranks
  and no local layout can hold the slice of it.

Collective order (the invariant that keeps the ranks paired): the reductions run inside the
read loop, one per sharded destination, at its last read item (``planner._finish``). The
planner's ``finish_plan`` orders the items grouped by destination, in the order of the state
dict, which is the model's parameter order and the same on every rank; every rank of a group
holds the same parameter names, formats and specs, so every rank reduces the same tensors in
the same order. A reader may read in parallel but must commit (and so finish) destinations in
plan order, on one thread. Each reduction carries a hash of the tensor's name, so a broken
order fails with a line naming the tensor instead of pairing two tensors' amaxes.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qckpt.errors import CheckpointError, UsageError
from qckpt.formats import FORMATS
from qckpt.parallel.deadline import collective
from qckpt.parallel.shard import ShardSpec, model_shards

_PARALLEL_KEY = {"expert": "parallel.ep", "tp": "parallel.tp"}


def groups_of(mesh: Any) -> dict[str, Any]:
    """The shard group of each ShardSpec kind on ``mesh`` (None: one rank, nothing to reduce)."""
    if mesh is None:
        return {}
    return {"expert": getattr(mesh, "ep_group", None), "tp": getattr(mesh, "tp_group", None)}


def whole_amax_kind(target: Any, spec: ShardSpec) -> str | None:
    """What a sharded destination's scale needs from the whole tensor: ``"tensor"`` (one amax),
    ``"rows"`` (one per row), or None. A function of format, options and spec alone, so every
    rank of a group decides alike."""
    fmt = FORMATS.get(getattr(target, "fmt", None))
    whole = None if fmt is None else fmt.whole_scale(getattr(target, "opts", None) or {})
    # one scale per row: a split along dim 0 keeps whole rows, nothing to reduce
    return None if whole == "rows" and spec.dim == 0 else whole


def _block_along(target: Any, dim: int) -> int:
    """The block length of ``target``'s scales along ``dim`` (1: none spans it; 0: the dim is
    not blocked but the whole dim shares one scale, handled by the amax reduction)."""
    fmt = FORMATS.get(getattr(target, "fmt", None))
    if fmt is None:
        return 1
    return fmt.scale_block(getattr(target, "opts", None) or {}, dim, target.dim())


def check_blocks(state: dict[str, Any], specs: dict[str, ShardSpec]) -> None:
    """Refuse a split that cuts a scale block of a quantized destination (UsageError, one
    line); called before any byte is read."""
    from qckpt.load.destination import destination_of

    for name, spec in specs.items():
        t = state.get(name)
        dest = destination_of(t) if isinstance(t, torch.Tensor) else None
        if dest is None:
            continue
        b = _block_along(dest, spec.dim)
        inside = b > 1 and (spec.start % b or (spec.stop % b and spec.stop != spec.total))
        if inside:
            raise UsageError(
                f"{name}: {_PARALLEL_KEY[spec.kind]}={spec.world} splits dim {spec.dim} "
                f"(size {spec.total}) at [{spec.start}, {spec.stop}), inside a {b}-element "
                f"{dest.fmt} scale block; pick a split whose blocks are multiples of {b}, "
                "or another format"
            )


def _name_hash(fqn: str) -> float:
    # 24 bits: exact in float32, so a MAX reduce of (h, -h) gives back (h, -h) iff all agree
    return float(zlib.crc32(fqn.encode()) & 0xFFFFFF)


@dataclass
class WholeScales:
    """The group-amax hook of a sharded load: ``hook(fqn, target, src)`` returns the amax to
    quantize ``src`` with (the whole tensor's), or None where the format needs none."""

    specs: dict[str, ShardSpec]
    groups: dict[str, Any]
    reduced: list[str] = field(default_factory=list)  # fqns reduced, in order (the invariant)

    @classmethod
    def of(cls, model: nn.Module | dict, mesh: Any) -> WholeScales | None:
        """The hook for ``model``'s sharded parameters on ``mesh``; None when no group exists."""
        groups = {k: g for k, g in groups_of(mesh).items() if g is not None}
        if not groups or not isinstance(model, nn.Module):
            return None
        specs = {n: s for n, s in model_shards(model).items() if s.kind in groups}
        return cls(specs=specs, groups=groups) if specs else None

    def kind(self, fqn: str, target: Any) -> str | None:
        spec = self.specs.get(fqn)
        return None if spec is None else whole_amax_kind(target, spec)

    def __call__(self, fqn: str, target: Any, src: torch.Tensor) -> torch.Tensor | None:
        what = self.kind(fqn, target)
        if what is None:
            return None
        from qckpt.formats.fp8 import row_amax
        from qckpt.formats.kernels import tensor_amax
        from qckpt.parallel.mesh import group_device

        spec = self.specs[fqn]
        group = self.groups[spec.kind]
        local = (tensor_amax(src) if what == "tensor" else row_amax(src)).reshape(-1)
        bad = (~torch.isfinite(local)).any().to(torch.float32).reshape(1)
        h = _name_hash(fqn)
        tail = torch.tensor([h, -h], dtype=torch.float32, device=local.device)
        buf = torch.cat([torch.nan_to_num(local, nan=0.0), bad, tail]).to(group_device(group))
        key = _PARALLEL_KEY[spec.kind]
        collective(
            f"load: whole-tensor amax of {fqn} over its {key} group",
            dist.all_reduce,
            buf,
            op=dist.ReduceOp.MAX,
            group=group,
        )
        self.reduced.append(fqn)
        flag, hh, nh = (float(v) for v in buf[-3:].tolist())
        if hh != h or nh != -h:
            raise CheckpointError(
                f"{fqn}: the ranks of its {key} group reduced different tensors at this point "
                "(the load's collective order differs between ranks)"
            )
        if flag > 0:
            where = "this rank's block" if bool(bad.item()) else "another rank's block"
            raise CheckpointError(f"{fqn}: the checkpoint's value is NaN or Inf ({where})")
        amax = buf[:-3].to(src.device)
        return amax.reshape(()) if what == "tensor" else amax


def agree_delayed_state(model: nn.Module, mesh: Any, names: Iterable[str] | None = None) -> int:
    """Make every sharded ``fp8_delayed`` parameter's amax history and ``quant_scale`` the whole
    tensor's: the history is MAX-reduced over the shard group and the scale recomputed from it.

    A delayed scale comes from the state the parameter was built with, not from the value a
    load reads, so a block built from its own values would keep a block-local scale. Runs
    after the parameters are quantized and before the load; every rank walks the same names in
    model order (one collective per such parameter). Returns how many were reduced."""
    from qckpt.formats import is_quantized
    from qckpt.formats.fp8 import FP8_DELAYED
    from qckpt.parallel.mesh import group_device

    groups = {k: g for k, g in groups_of(mesh).items() if g is not None}
    if not groups:
        return 0
    params = dict(model.named_parameters())
    n = 0
    for name, spec in model_shards(model).items():
        if names is not None and name not in names:
            continue
        p = params.get(name)
        group = groups.get(spec.kind)
        if group is None or not is_quantized(p) or not FORMATS[p.fmt].delayed_state:
            continue
        with torch.no_grad():
            hist = p.amax_history.detach().to(group_device(group), torch.float32).clone()
            collective(
                f"load: fp8_delayed amax history of {name} over its {_PARALLEL_KEY[spec.kind]}"
                " group",
                dist.all_reduce,
                hist,
                op=dist.ReduceOp.MAX,
                group=group,
            )
            p.amax_history.copy_(hist.to(p.amax_history.device))
            # an all-zero history keeps the scale it has (the same on every rank then)
            qs = FP8_DELAYED.scale_from_history(p.amax_history, p.quant_scale, p.opts)
            p.quant_scale.copy_(qs.reshape(p.quant_scale.shape))
        n += 1
    return n
