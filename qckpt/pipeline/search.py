"""``qckpt search``'s body: the sharded model, the data and the weights as ``calibrate`` has
them, the search (:mod:`qckpt.search.run`), and the found recipe written by the main rank,
atomically (:func:`qckpt.atomic.write_text`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qckpt import phases
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.pipeline.model import build_for
from qckpt.recipe import Recipe


@dataclass(kw_only=True)
class SearchRun:
    result: object  # qckpt.search.run.SearchResult
    data: dict
    output: str
    world_size: int


def search(
    recipe: Recipe,
    raw: dict,
    mesh: Mesh,
    *,
    budget: str | None,
    output: str | Path,
    hooks: Hooks = SILENT,
) -> SearchRun:
    """Search ``recipe`` (``raw``: its mapping as written, overrides applied) for ``budget``
    (None: ``search.budget``) over ``mesh``; the main rank writes the found recipe to
    ``output``."""
    import torch

    from qckpt.calib.deal import dealable
    from qckpt.errors import UsageError
    from qckpt.models.build import load_config, model_type
    from qckpt.models.naming import refuse_experts_layout
    from qckpt.pipeline.calibrate import calibration_data, load_weights
    from qckpt.read.readers import checkpoint_names_shapes
    from qckpt.search.choose import parse_budget
    from qckpt.search.run import model_bytes, search_model

    refuse_experts_layout(model_type(load_config(recipe.model.source)), "search")
    if recipe.search is None:
        raise UsageError("search: the recipe has no search section (search.candidates: [...])")
    b = parse_budget(budget if budget is not None else recipe.search.budget)
    if recipe.calibrate.offload != "none":
        raise UsageError("calibrate.offload: qckpt search runs with the model resident (none)")
    built = build_for(recipe, mesh, params="none", backend="native")
    model = built.model
    if built.ep_sharded:
        hooks.log(f"experts of {len(built.ep_sharded)} MoE blocks sharded over {mesh.ep} EP ranks")
    dealt = dealable(mesh, False)
    batches, data_report = calibration_data(recipe, mesh, model.config.vocab_size, dealt, hooks)
    with phases.phase(phases.READ):
        load_weights(recipe, mesh, model, False, hooks)
    dtype = getattr(torch, recipe.model.dtype)
    names = checkpoint_names_shapes(recipe.checkpoint.path, recipe.checkpoint.format)
    hooks.log(f"measuring {len(recipe.search.candidates)} candidates on {len(batches)} batches")
    with phases.phase(phases.FORWARD), hooks.progress("searching", len(batches)) as advance:
        res = search_model(
            model, batches, recipe, raw, mesh, budget=b, model_bytes=model_bytes(names, dtype),
            progress=advance,
        )  # fmt: skip
    if mesh.is_main:
        with phases.phase(phases.WRITE):
            write_found(res.recipe, output)
    return SearchRun(result=res, data=data_report, output=str(output), world_size=mesh.world_size)


def write_found(found: dict, output: str | Path) -> None:
    """The found recipe as YAML, atomically (a crash leaves the old file or none)."""
    import yaml

    from qckpt.atomic import write_text

    head = "# written by qckpt search: quant.schemes is its choice; calibrate and export run it\n"
    write_text(output, head + yaml.safe_dump(found, sort_keys=False), key="-o")
