"""``qckpt load``'s body: build the model with quantized parameters, stream a checkpoint in."""

from __future__ import annotations

from dataclasses import dataclass

from qckpt import phases
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.pipeline.model import build_for
from qckpt.recipe import Recipe


@dataclass(kw_only=True)
class LoadResult:
    """One ``LoadReport`` per run: the recipe's mode first, the other one with ``compare``."""

    reports: list
    world_size: int

    def to_dict(self, recipe_path: str, params: str) -> dict:
        return {
            "recipe": recipe_path,
            "params": params,
            "world_size": self.world_size,
            "runs": [rep.to_dict() for rep in self.reports],
        }


def load(recipe: Recipe, mesh: Mesh, *, compare: bool = False, hooks: Hooks = SILENT) -> LoadResult:
    """Load ``recipe.checkpoint`` into a model with ``recipe.load.params`` parameters.

    ``compare`` also runs the other mode (bulk vs stream) on a fresh model. Every rank holds
    the whole model (sharded loads are issue 17), built on meta and allocated straight into
    its quantized parameters (no BF16 copy, no random init: the checkpoint fills it all).
    """
    from qckpt.checkpoint.load import load_checkpoint

    lo = recipe.load
    reports = []
    for stream in [lo.stream] + ([not lo.stream] if compare else []):
        built = build_for(recipe, mesh, sharded=False, params=lo.params)
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
        del built
    return LoadResult(reports=reports, world_size=mesh.world_size)
