"""A data-parallel model read once over the DP group, not once per rank.

Under pure data parallelism (``parallel.ep == tp == 1``) every rank holds the same whole model,
and each reading the whole checkpoint means N ranks pulling the same bytes out of the page cache
(or the disk) at once, all sharing the host's bandwidth. Instead each DP rank reads a share of
the tensors (:func:`read_shares`: whole tensors, balanced by bytes, the same deal on every rank)
and then every tensor is broadcast from the rank that read it (:func:`broadcast_shares`), over
the group's own fabric (NVLink between GPUs). The values are the bytes the reader put there,
so every rank ends with the model a whole read gives, bit for bit.

Only for plain (unquantized) destinations with no load tap: a quantized-resident model's
weight amaxes are taken from the checkpoint's values as they stream in
(:mod:`qckpt.calib.weight_amax`), on the rank that reads them.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist
from torch import nn

from qckpt.parallel.deadline import collective
from qckpt.parallel.mesh import group_device


def read_shares(model: nn.Module, world: int) -> list[list[tuple[list[str], torch.Tensor]]]:
    """Per DP index, the tensors it reads: (every state-dict name of the tensor, the tensor).

    Largest first onto the least-loaded rank (ties: the lower rank, then state-dict order), by
    bytes; tied names travel together so that the load finds whichever one it keeps.
    """
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if isinstance(v, torch.Tensor):
            names.setdefault(id(v), []).append(k)
            tensors.setdefault(id(v), v)
    order = sorted(tensors, key=lambda i: -tensors[i].numel() * tensors[i].element_size())
    loads = [(0, r) for r in range(world)]
    shares: list[list[tuple[list[str], torch.Tensor]]] = [[] for _ in range(world)]
    for i in order:
        load, r = heapq.heappop(loads)
        t = tensors[i]
        shares[r].append((names[i], t))
        heapq.heappush(loads, (load + t.numel() * t.element_size(), r))
    return shares


def broadcast_shares(
    shares: list[list[tuple[list[str], torch.Tensor]]], group: dist.ProcessGroup
) -> int:
    """Every tensor from the DP rank that read it to the others; returns the bytes moved."""
    moved = 0
    for src, share in enumerate(shares):
        root = dist.get_global_rank(group, src)
        for names, t in share:
            data = t.detach()
            what = f"sending {names[0]} over the DP group"
            collective(what, dist.broadcast, data, src=root, group=group)
            moved += data.numel() * data.element_size()
    return moved


def splittable(mesh, model: nn.Module, quantized: bool) -> bool:
    """Whether this load may be split over the DP ranks (see the module doc)."""
    if mesh.dp <= 1 or mesh.ep != 1 or mesh.tp != 1 or quantized or mesh.dp_group is None:
        return False
    # the broadcast moves the tensors where they are: they must be where the group's wire is
    wire = group_device(mesh.dp_group).type
    state = model.state_dict(keep_vars=True).values()
    return all(t.device.type == wire for t in state if isinstance(t, torch.Tensor))
