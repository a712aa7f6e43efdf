"""Tensor parallelism for transformers decoder layers: attention and dense-MLP linears split over TP.

``shard_tensor_parallel(model, mesh)`` splits, in every decoder layer,

* ``self_attn.q_proj/k_proj/v_proj`` and a dense MLP's ``gate_proj/up_proj`` column-parallel: this
  rank keeps output rows ``[tp_rank * n, (tp_rank + 1) * n)`` of the weight (and of a bias);
* ``self_attn.o_proj`` and a dense MLP's ``down_proj`` row-parallel: this rank keeps the matching
  input columns, and a forward hook all-reduces (SUM) the partial outputs over ``mesh.tp_group``;
  a bias is added by TP rank 0 only, so it is added once.

Heads split evenly (``num_attention_heads`` and ``num_key_value_heads`` must both divide by tp),
so each rank holds whole heads: q heads ``[r * H/tp, ...)`` and their key/value heads
``[r * KV/tp, ...)``. transformers' attention reshapes with ``-1`` heads and reads
``num_key_value_groups`` (unchanged: (H/tp) / (KV/tp) = H/KV), so the module code runs as is on
local heads; head-count attributes some architectures keep on the module (``num_heads``,
``num_key_value_heads``, ``num_attention_heads``) are divided by tp. MoE experts and the router
stay replicated (expert parallelism shards experts; see :mod:`qckpt.parallel.expert`), as do
embeddings, norms and ``lm_head``.

Parameter names are unchanged. The weight of each sharded ``nn.Linear`` (and a column-parallel
bias) gets a :class:`qckpt.parallel.shard.ShardSpec` (kind ``tp``, dim 0 column / 1 row, the
whole weight's shape), which the loader (:func:`qckpt.load.preflight.tensor_shards`: read only this block of
the checkpoint's tensor) and the calibrator (:func:`qckpt.calib.tp_gather.gather_sharded_amax`) read. Works on the meta
device, so a rank allocates only its shards.

The row-parallel partial sums are reduced in float32 (for half-precision outputs) and rounded
once; the sum is in a different order than one process's matmul, so logits match a single
process to float tolerance, not bit for bit. Inference only: the all-reduce is not autograd-aware.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qckpt.errors import UsageError
from qckpt.parallel.deadline import collective
from qckpt.parallel.mesh import Mesh
from qckpt.parallel.shard import ShardSpec, set_shard, shard_of

ATTN_COLUMN = ("q_proj", "k_proj", "v_proj")
ATTN_ROW = ("o_proj",)
MLP_COLUMN = ("gate_proj", "up_proj")
MLP_ROW = ("down_proj",)
_HEAD_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads")


def _text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return cfg


def _linear(mod: nn.Module, attr: str) -> nn.Linear | None:
    m = getattr(mod, attr, None)
    return m if isinstance(m, nn.Linear) else None


def tp_plan(model: nn.Module) -> list[tuple[str, nn.Linear, int]]:
    """Every linear tensor parallelism splits: (module name, module, 0 column / 1 row)."""
    plan = []
    for name, mod in model.named_modules():
        attn = getattr(mod, "self_attn", None)
        if attn is None or _linear(attn, "q_proj") is None:
            continue  # not a decoder layer
        for attrs, dim in ((ATTN_COLUMN, 0), (ATTN_ROW, 1)):
            for a in attrs:
                lin = _linear(attn, a)
                if lin is not None:
                    plan.append((f"{name}.self_attn.{a}", lin, dim))
        mlp = getattr(mod, "mlp", None)
        # a dense MLP: all three projections are plain linears (a MoE block has experts instead)
        if mlp is not None and all(_linear(mlp, a) for a in MLP_COLUMN + MLP_ROW):
            for attrs, dim in ((MLP_COLUMN, 0), (MLP_ROW, 1)):
                for a in attrs:
                    plan.append((f"{name}.mlp.{a}", getattr(mlp, a), dim))
    return plan


class _RowParallel:
    """Forward hook of a row-parallel linear: SUM of the partial outputs over the TP group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, _mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        if out.dtype in (torch.float16, torch.bfloat16):
            acc = out.float()
            self._sum(acc)
            return acc.to(out.dtype)
        self._sum(out)
        return out

    def _sum(self, t: torch.Tensor) -> None:
        what = "the tensor-parallel all-reduce in the forward"
        collective(what, dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.group)


def _bias_once(mod: nn.Linear, tp_rank: int):
    """``forward`` of a row-parallel linear with a bias: only TP rank 0 adds it."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, mod.weight, mod.bias if tp_rank == 0 else None)

    return forward


def _keep(p: nn.Parameter, dim: int, start: int, n: int) -> nn.Parameter:
    local = p.detach().narrow(dim, start, n).clone()
    return nn.Parameter(local, requires_grad=p.requires_grad)


def shard_tensor_parallel(model: nn.Module, mesh: Mesh) -> list[str]:
    """Split the attention and dense-MLP linears of every decoder layer over ``mesh.tp_group``.

    Returns the names of the sharded linears; a no-op (empty list) when ``mesh.tp == 1``.
    """
    tp = mesh.tp
    if tp <= 1:
        return []
    if mesh.tp_group is None:
        raise UsageError("parallel.tp: > 1 needs a torchrun world with a TP group")
    plan = tp_plan(model)
    if any(shard_of(lin, "weight") is not None for _, lin, _ in plan):
        raise UsageError("parallel.tp: the model is already split over TP ranks")
    if not plan:
        raise UsageError("parallel.tp: > 1 but the model has no attention layers to split")
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is not None and (heads % tp or kv % tp):
        raise UsageError(
            f"parallel.tp: {tp} does not divide the {heads} attention heads and "
            f"{kv} key/value heads"
        )
    for name, lin, dim in plan:
        size = lin.weight.shape[dim]
        if size % tp:
            raise UsageError(f"parallel.tp: {tp} does not divide the {size} features of {name}")
    r = mesh.tp_rank
    names = []
    with torch.no_grad():
        for name, lin, dim in plan:
            full = tuple(int(s) for s in lin.weight.shape)
            n = full[dim] // tp
            lin.weight = _keep(lin.weight, dim, r * n, n)
            if dim == 0:
                if lin.bias is not None:
                    lin.bias = _keep(lin.bias, 0, r * n, n)
                lin.out_features = n
            else:
                lin.in_features = n
                lin.register_forward_hook(_RowParallel(mesh.tp_group))
                if lin.bias is not None:
                    lin.forward = _bias_once(lin, r)
            set_shard(lin, "weight", ShardSpec.block("tp", full, dim, r, tp))
            if dim == 0 and lin.bias is not None:
                set_shard(lin, "bias", ShardSpec.block("tp", full[:1], 0, r, tp))
            names.append(name)
    for _name, mod in model.named_modules():
        attn = getattr(mod, "self_attn", None)
        if attn is None or _linear(attn, "q_proj") is None:
            continue
        for a in _HEAD_ATTRS:
            v = getattr(attn, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(attn, a, v // tp)
    return names
