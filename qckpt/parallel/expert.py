"""Expert parallelism for transformers' fused MoE experts: experts sharded over the EP group.

``shard_experts(model, mesh)`` keeps experts ``[ep_rank * n, (ep_rank + 1) * n)`` of every fused
experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) and drops the rest. The
router and the dense parts stay replicated; each EP rank runs its own tokens through them. Both
fused parameters get a :class:`qckpt.parallel.shard.ShardSpec` (kind ``expert``, dim 0: this
rank's experts of the global count), which the loader and the calibrator read.

Dispatch and combine go through a forward pre-hook and a forward hook on the experts module, so
whatever ``forward`` the module runs (transformers' own, or calibration's instrumented loop) is
left alone:

1. pre-hook: all-gather every EP rank's tokens and routing (padded to the largest rank). Each
   (slot j, token t) pair routed to a local expert becomes one row for the local forward, with
   that expert alone (as a local index) and its routing weight, so each row's output is one
   expert's weighted output.
2. hook: those rows go back to their places ``j * T + t`` of a zero buffer, all-reduced (SUM) over
   the EP group. Each (slot, token) has exactly one owner and every other rank adds an exact
   zero, so the sum is exact. Each rank then takes its
   own tokens and adds their slots in ascending expert order, the order transformers' eager loop
   uses, so the result is the single-process result bit for bit (given a batch-invariant matmul).

This is all-gather plus all-reduce, not all-to-all: correctness first; the traffic is
``k * sum(T) * H`` per layer, fine for calibration batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qckpt.errors import UsageError
from qckpt.models.naming import is_fused_experts
from qckpt.parallel.deadline import collective
from qckpt.parallel.mesh import Mesh
from qckpt.parallel.shard import ShardSpec, set_shard


def _fused_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, mod in model.named_modules():
        if is_fused_experts(mod):
            out.append((name, mod))
    return out


def local_expert_range(num_experts: int, ep: int, ep_rank: int, where: str = "") -> range:
    if num_experts % ep:
        raise UsageError(
            f"parallel.ep: {ep} does not divide the {num_experts} experts{' of ' + where if where else ''}"
        )
    n = num_experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)


_WHAT = "the expert-parallel exchange in the forward"


class _Exchange:
    """Per-module state between the pre-hook and the hook of one forward call."""

    def __init__(self, group: dist.ProcessGroup, ep: int, n_local: int, start: int):
        self.group, self.ep, self.n_local, self.start = group, ep, n_local, start
        self.pending: tuple | None = None

    def pre(self, _mod: nn.Module, args: tuple):
        hidden, top_k_index, top_k_weights = args[:3]
        t_local, k = top_k_index.shape
        dev = hidden.device
        sizes = torch.zeros(self.ep, dtype=torch.int64, device=dev)
        sizes_in = torch.tensor([t_local], dtype=torch.int64, device=dev)
        _gather = dist.all_gather_into_tensor
        collective(_WHAT, _gather, sizes, sizes_in, group=self.group)
        sizes_l = sizes.tolist()
        t_max = max(sizes_l)

        def gather(x: torch.Tensor, fill: float | int) -> torch.Tensor:
            pad = torch.full((t_max - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype, device=dev)
            buf = torch.empty((self.ep * t_max, *x.shape[1:]), dtype=x.dtype, device=dev)
            send = torch.cat([x, pad]).contiguous()
            collective(_WHAT, _gather, buf, send, group=self.group)
            return buf

        h_all = gather(hidden, 0)
        idx_all = gather(top_k_index, -1)  # -1 marks padding rows: never routed
        w_all = gather(top_k_weights, 0)
        t_all = h_all.shape[0]
        # rows ordered (slot, token); only the (slot, token) pairs routed to a local expert are
        # run, so no sentinel index is needed (older transformers have none)
        flat_idx = idx_all.t().reshape(k * t_all)
        sel = torch.nonzero((flat_idx >= self.start) & (flat_idx < self.start + self.n_local))
        sel = sel.squeeze(1)
        rows_idx = (flat_idx[sel] - self.start).unsqueeze(1)
        rows_w = w_all.t().reshape(k * t_all)[sel].unsqueeze(1)
        rows_h = h_all[sel % t_all]
        self.pending = (t_local, k, t_max, t_all, top_k_index, sel)
        return (rows_h, rows_idx, rows_w, *args[3:])

    def post(self, _mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        t_local, k, t_max, t_all, top_k_index, sel = self.pending
        self.pending = None
        full = torch.zeros((k * t_all, out.shape[-1]), dtype=out.dtype, device=out.device)
        full[sel] = out
        collective(_WHAT, dist.all_reduce, full, op=dist.ReduceOp.SUM, group=self.group)
        out = full
        me = dist.get_rank(self.group)
        per_slot = out.view(k, t_all, -1)[:, me * t_max : me * t_max + t_local]
        # add each token's slots in ascending expert order, as the eager single-process loop does
        order = top_k_index.argsort(dim=1, stable=True)
        final = torch.zeros_like(per_slot[0])
        tok = torch.arange(t_local, device=out.device)
        for j in range(k):
            final.add_(per_slot[order[:, j], tok])
        return final


def shard_experts(model: nn.Module, mesh: Mesh) -> list[str]:
    """Keep only this EP rank's experts in every fused experts module and route tokens to them.

    Returns the names of the sharded modules. A no-op (empty list) when ``mesh.ep == 1``.
    """
    if mesh.ep <= 1:
        return []
    if mesh.ep_group is None:
        raise UsageError("parallel.ep: > 1 needs a torchrun world with an EP group")
    found = _fused_experts(model)
    if not found:
        raise UsageError("parallel.ep: > 1 but the model has no fused MoE experts to shard")
    # the eager loop keeps each token's experts in ascending order, which the combine reproduces
    if getattr(model, "config", None) is not None and hasattr(
        model.config, "_experts_implementation"
    ):
        model.config._experts_implementation = "eager"
    names = []
    for name, mod in found:
        n_global = mod.gate_up_proj.shape[0]
        rng = local_expert_range(n_global, mesh.ep, mesh.ep_rank, name)
        with torch.no_grad():
            for attr in ("gate_up_proj", "down_proj"):
                full = getattr(mod, attr)
                local = full.detach()[rng.start : rng.stop].clone()
                setattr(mod, attr, nn.Parameter(local, requires_grad=full.requires_grad))
        if hasattr(mod, "num_experts"):
            mod.num_experts = len(rng)
        for attr in ("gate_up_proj", "down_proj"):
            local_shape = tuple(getattr(mod, attr).shape)
            spec = ShardSpec.block(
                "expert", (n_global, *local_shape[1:]), 0, mesh.ep_rank, mesh.ep, rng.start
            )
            set_shard(mod, attr, spec)
        ex = _Exchange(mesh.ep_group, mesh.ep, len(rng), rng.start)
        mod.register_forward_pre_hook(ex.pre)
        mod.register_forward_hook(ex.post)
        names.append(name)
    return names
