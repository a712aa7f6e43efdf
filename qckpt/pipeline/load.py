"""``qckpt load``'s body: build the model with quantized parameters, stream a checkpoint in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qckpt import phases
from qckpt.errors import UsageError
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.pipeline.model import Built, build
from qckpt.recipe import Recipe

# what each rank's row of the per-rank report says (the rest of its LoadReport stays local)
RANK_KEYS = (
    "rank",
    "holds",
    "param_bytes",
    "bytes_read",
    "transient_bytes",
    "peak_bytes",
    "host_peak_rss_bytes",
    "seconds",
    "whole_amax_reduced",
)


@dataclass(kw_only=True)
class LoadResult:
    """One ``LoadReport`` per run: the recipe's mode first, the other one with ``compare``.
    ``ranks``: per run, every rank's row (``RANK_KEYS``), gathered on every rank."""

    reports: list
    world_size: int
    ranks: list[list[dict[str, Any]]] = field(default_factory=list)

    def to_dict(self, recipe_path: str, params: str) -> dict:
        runs = []
        for i, rep in enumerate(self.reports):
            d = rep.to_dict()
            if i < len(self.ranks):
                d["ranks"] = self.ranks[i]
            runs.append(d)
        return {
            "recipe": recipe_path,
            "params": params,
            "world_size": self.world_size,
            "runs": runs,
        }


def load(recipe: Recipe, mesh: Mesh, *, compare: bool = False, hooks: Hooks = SILENT) -> LoadResult:
    """Load ``recipe.checkpoint`` into a model with ``recipe.load.params`` parameters.

    ``compare`` also runs the other mode (bulk vs stream) on a fresh model. Under
    ``parallel.ep`` / ``parallel.tp`` each rank builds, allocates and reads only its experts
    and TP blocks, exactly as ``calibrate`` does; its quantized parameters equal the matching
    slices of a one-rank load (``qckpt.load.shard_scales``), and its report says what it holds.
    Built on meta and allocated straight into its quantized parameters (no BF16 copy, no
    random init: the checkpoint fills it all).
    """
    from qckpt.load.loader import load_checkpoint

    lo = recipe.load
    if lo.backend == "te" and (mesh.ep > 1 or mesh.tp > 1):
        raise UsageError(
            "load.backend: te loads every tensor whole; use load.backend: native with "
            f"parallel.ep: {mesh.ep} / parallel.tp: {mesh.tp}, or parallel.ep = tp = 1"
        )
    reports, ranks = [], []
    for stream in [lo.stream] + ([not lo.stream] if compare else []):
        built = build_for_load(recipe, mesh)
        _say_sharding(built, mesh, hooks)
        with (
            phases.phase(phases.READ),
            hooks.progress("loading" + ("" if stream else " (bulk)"), None) as advance,
        ):
            rep = load_checkpoint(
                built.model,
                recipe.checkpoint.path,
                format=recipe.checkpoint.format,
                stream=stream,
                main_params=None if lo.main_params == "none" else lo.main_params,
                mesh=mesh,
                progress=advance,
                reader=lo.reader,
                max_inflight=lo.max_inflight,
            )
        reports.append(rep)
        ranks.append(gather_rank_rows(rep, mesh))
        del built
    return LoadResult(reports=reports, world_size=mesh.world_size, ranks=ranks)


def build_for_load(recipe: Recipe, mesh: Mesh, **param_opts: Any) -> Built:
    """The model a load fills: the recipe's model in the one order (``pipeline.model``:
    sharded over EP then TP like calibrate's), with ``load.params`` parameters
    (``param_opts``: format options such as ``block_size``, for library callers), built on
    meta and allocated straight in their format. A fp8_delayed scale that a build did make
    (a seeded build) is made the whole tensor's; a fresh one takes the load's whole amax."""
    from qckpt.load.shard_scales import agree_delayed_state

    lo = recipe.load
    built = build(
        recipe.model.source,
        mesh,
        dtype=recipe.model.dtype,
        seed=recipe.model.seed,
        params=lo.params,
        ignore=recipe.quant.ignore,
        backend=lo.backend,
        **param_opts,
    )
    agree_delayed_state(built.model, mesh)
    return built


def _say_sharding(built: Any, mesh: Mesh, hooks: Hooks) -> None:
    if built.ep_sharded:
        hooks.log(f"experts of {len(built.ep_sharded)} MoE blocks sharded over {mesh.ep} EP ranks")
    if built.tp_sharded:
        hooks.log(f"{len(built.tp_sharded)} linears split over {mesh.tp} TP ranks")


def gather_rank_rows(report: Any, mesh: Mesh) -> list[dict[str, Any]]:
    """Every rank's row of ``report`` (``RANK_KEYS``), in rank order, on every rank (one
    all_gather_object over the world, under the mesh's deadline)."""
    d = report.to_dict()
    row = {k: d.get(k) for k in RANK_KEYS}
    row.update(dp_rank=mesh.dp_rank, ep_rank=mesh.ep_rank, tp_rank=mesh.tp_rank)
    if mesh.world_size <= 1 or mesh.world_group is None:
        return [row]
    import torch.distributed as dist

    from qckpt.parallel.deadline import collective

    rows: list[Any] = [None] * mesh.world_size
    collective(
        "load: the per-rank report", dist.all_gather_object, rows, row, group=mesh.world_group
    )
    return rows
