"""The TP amax gather: per-channel / per-block amaxes of TP-sharded linears made whole.

Per-tensor amaxes (weight, input, output; NVFP4's global) of a sharded linear are synced as a
MAX over the TP group by :func:`qckpt.calib.calibrate.calibrate_model` with every other
per-tensor amax. The static per-channel / per-block amaxes describe the local shard; here they
become the whole tensor's, so a TP run writes the calibration file one process writes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from qckpt.errors import SyncError, UsageError
from qckpt.formats.shapes import amax_shape, weight_block
from qckpt.parallel.deadline import Deadline, deadline_of
from qckpt.parallel.mesh import group_device
from qckpt.parallel.shard import ShardSpec, model_shards
from qckpt.phases import SYNC, timed

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def linear_shards(model: nn.Module) -> dict[str, ShardSpec]:
    """The weight specs of the TP-sharded linears, by module name."""
    return {
        name.removesuffix(".weight"): spec
        for name, spec in model_shards(model, "tp").items()
        if name.endswith(".weight")
    }


def _tp_action(q, spec: ShardSpec) -> tuple[str, int]:
    """How one static amax of a sharded linear becomes the whole tensor's: (op, axis).

    ``("cat", axis)``: each rank holds a slice along ``axis`` of the amax; ``("max", 0)``: each
    rank holds an amax over its slice of the reduced dims; ``("same", 0)``: identical on every
    rank (a column-parallel linear's input, replicated). Raises UsageError when blocks would
    straddle shards (the block size does not divide the shard).
    """
    dim, tp, local = spec.dim, spec.world, spec.local
    if q.kind == "weight":
        if q.granularity == "channel":
            return ("cat", 0) if (q.axis % 2) == dim else ("max", 0)
        b = weight_block(q.block_size)[dim]
        if local % b:
            raise UsageError(
                f"parallel.tp: {tp} splits {q.name}'s weight into shards of {local} "
                f"{'rows' if dim == 0 else 'columns'}, which the weight block size {b} does not "
                "divide (quant.weights.block_size)"
            )
        return ("cat", dim)
    # inputs: per-block over the last (feature) dim, split only by a row-parallel linear
    if dim == 0:
        return ("same", 0)
    b = q.block_size[-1]
    if local % b:
        raise UsageError(
            f"parallel.tp: {tp} splits {q.name}'s input into shards of {local} features, which "
            f"the input block size {b} does not divide (quant.inputs.block_size)"
        )
    return ("cat", 0)


def _full_shapes(q, spec: ShardSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The observed tensor's whole shape and the whole amax shape, as on one process."""
    full = spec.global_shape
    shape = full if q.kind == "weight" else (full[1],)
    return shape, amax_shape(q.granularity, q.kind, shape, q.block_size, q.axis)


def check_sharded_quantizers(quantizers, shards: dict[str, ShardSpec]) -> list:
    """The enabled static quantizers of TP-sharded linears; UsageError if one cannot be gathered.

    Call before calibrating: the check reads only the config, so every rank fails alike.
    """
    out = []
    for q in quantizers:
        spec = shards.get(q.name)
        if spec is None or q.is_scalar or not q.enabled or q.kind == "output":
            continue
        _tp_action(q, spec)
        out.append(q)
    return out


@timed(SYNC)
def gather_sharded_amax(
    quantizers, shards: dict[str, ShardSpec], group: dist.ProcessGroup | None
) -> int:
    """Whole-tensor per-channel / per-block amaxes of TP-sharded linears; collectives issued.

    One all-gather for all of them: every rank's local amaxes (float32) and a presence flag per
    quantizer. Column-parallel slices are concatenated in TP rank order, amaxes over split
    reduced dims take the MAX; each quantizer then has the shapes a one-process run has. A
    static amax some TP ranks hold and others lack raises SyncError on every rank (the decision
    reads gathered data only); one nobody holds stays None, with the whole shape.
    """
    qs = check_sharded_quantizers(quantizers, shards)
    if not qs:
        return 0
    world = 1 if group is None else dist.get_world_size(group)
    dev = group_device(group)
    sizes = [max(1, math.prod(q.amax_shape)) for q in qs]
    total = sum(sizes)
    local = torch.zeros(total + len(qs), dtype=torch.float32, device=dev)
    off = 0
    for i, (q, n) in enumerate(zip(qs, sizes, strict=True)):
        a = q.amax
        if a is not None:
            local[off : off + n] = a.reshape(-1).to(dev, torch.float32)
            local[total + i] = 1.0
        off += n
    collectives = 0
    if group is not None:
        allv = torch.empty(world * local.numel(), dtype=torch.float32, device=dev)
        # gloo/NCCL errors become one line; skipped at once if the command's deadline passed
        what = "amax gather over the tensor-parallel group"
        dl = deadline_of(group) or Deadline(None)
        dl.run(what, _gather, allv, local, group=group, error=SyncError)
        collectives = 1
        allv = allv.view(world, -1).cpu()
    else:
        allv = local.view(1, -1).cpu()
    present = allv[:, total:]
    some = [q.key for i, q in enumerate(qs) if 0 < int(present[:, i].sum()) < world]
    if some:
        raise SyncError(
            "amax gather over the tensor-parallel group: static amax calibrated on only some TP "
            f"ranks: {', '.join(some[:6])}{' and more' if len(some) > 6 else ''}"
        )
    off = 0
    for i, (q, n) in enumerate(zip(qs, sizes, strict=True)):
        spec = shards[q.name]
        op, axis = _tp_action(q, spec)
        shape, whole_shape = _full_shapes(q, spec)
        had = q.amax
        parts = [allv[r, off : off + n].view(q.amax_shape) for r in range(world)]
        off += n
        if op == "cat":
            whole = torch.cat(parts, dim=axis)
        elif op == "max":
            whole = torch.stack(parts).amax(dim=0)
        else:
            whole = parts[0]
        value = None
        if bool(present[0, i]):
            if tuple(whole.shape) != whole_shape:
                raise SyncError(
                    f"{q.key}: gathered amax of shape {tuple(whole.shape)}, expected {whole_shape}"
                )
            dt = had.dtype if had is not None else torch.float32
            value = whole.to(device=q.device, dtype=dt)
        q.make_whole(shape, value)
    return collectives
