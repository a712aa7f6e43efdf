"""``qckpt search`` on a built, loaded model: the probe calibration with the sensitivity pass,
the units, their costs, the choice, the found recipe and the report. Every rank computes the
same result from the same reduced numbers; the caller's main rank writes it.

The probe: a ``quant.schemes`` recipe of one entry, ``search.targets`` with FP8 per-tensor
weights and static FP8 per-tensor inputs, ``quant.ignore`` as the recipe has it: its max
calibration gives every covered linear (every expert) a synced input amax, the grid of
:mod:`qckpt.search.sensitivity`; what it covers is what the search chooses for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qckpt.errors import UsageError
from qckpt.formats.scheme import scheme_of
from qckpt.recipe import QuantConfig, Recipe, SchemeConfig, TensorQuantConfig
from qckpt.search.choose import Budget, Choice, Unit, choose, units_of
from qckpt.search.found import found_recipe, report_of, schemes_of
from qckpt.search.sensitivity import Sensitivity, SensitivityPass
from qckpt.search.sizes import linear_bytes


@dataclass
class SearchResult:
    recipe: dict  # the found recipe's mapping
    report: dict
    sensitivity: Sensitivity
    choice: Choice


def probe_quant(recipe: Recipe) -> QuantConfig:
    """The probe calibration's quant (module doc)."""
    fp8 = TensorQuantConfig(format="fp8")
    entry = SchemeConfig(targets=list(recipe.search.targets), weights=fp8, inputs=fp8)
    return QuantConfig(schemes=[entry], ignore=list(recipe.quant.ignore))


def search_model(
    model: torch.nn.Module,
    batches: Any,
    recipe: Recipe,
    raw: dict,
    mesh: Any,
    *,
    budget: Budget,
    model_bytes: int,
    progress: Any = None,
) -> SearchResult:
    """The search of ``recipe`` on ``model`` (built and loaded over ``mesh``) with this rank's
    ``batches``; ``raw``: the recipe's mapping as written (the found recipe starts from it);
    ``model_bytes``: the export's bytes were nothing quantized (every tensor of the checkpoint,
    floating ones at the model dtype: :func:`model_bytes`); less the covered linears' weights,
    what a size budget pays for beside them."""
    from qckpt.calib.calibrate import calibrate_model

    if recipe.search is None or not recipe.search.candidates:
        raise UsageError("search.candidates: the recipe names no candidate scheme to choose from")
    cands = recipe.search.candidates
    schemes = [scheme_of(c.weights, "weight") for c in cands]
    dtype = getattr(torch, recipe.model.dtype)
    fmt = recipe.export.format
    linear_bytes(fmt, cands, {}, dtype)  # a candidate the layout refuses: one line, before work

    def sizes(shapes):
        return linear_bytes(fmt, cands, shapes, dtype)

    algo = SensitivityPass(candidates=schemes, sizes=sizes)
    _, report = calibrate_model(
        model, batches, probe_quant(recipe), mesh, algorithm=algo, progress=progress,
        share_expert_inputs=True, moe_forward=recipe.calibrate.moe_forward,
    )  # fmt: skip
    sens: Sensitivity = report["search"]
    units = make_units(sens, len(cands))
    weights = sum(u.weights for u in units)
    other_bytes = model_bytes - weights * dtype.itemsize
    limit = budget.limit(weights, other_bytes)

    def least(nbytes: int) -> str:
        if budget.bpw is not None:
            return f"{8 * nbytes / weights:.4f}bpw" if weights else "0bpw"
        return f"{nbytes + other_bytes} bytes"

    choice = choose(units, limit, budget, least)
    found = found_recipe(raw, schemes_of(units, choice.picks, cands))
    rep = report_of(units, choice, cands, sens, budget, other_bytes)
    return SearchResult(recipe=found, report=rep, sensitivity=sens, choice=choice)


def make_units(sens: Sensitivity, k: int) -> list[Unit]:
    """The units of the covered linears with their summed costs and errors per candidate."""
    out = []
    for key, mods in units_of(list(sens.shapes)):
        u = Unit(key=key, modules=mods, weights=sum(_numel(sens.shapes[m]) for m in mods))
        for c in range(k):
            costs = [sens.bytes[m][c] for m in mods]
            u.cost.append(None if any(b is None for b in costs) else sum(costs))
            err = 0.0
            for m in mods:  # module order: the same sum everywhere
                err += sens.errors[m][c]
            u.error.append(None if u.cost[c] is None else err)
        out.append(u)
    return out


def model_bytes(names_shapes: dict, dtype: torch.dtype) -> int:
    """The export's bytes of a checkpoint left unquantized (``names_shapes``: name ->
    (shape, dtype), :func:`qckpt.read.readers.checkpoint_names_shapes`): floating tensors at
    the model dtype, the others at their own, as the export writes them."""
    total = 0
    for shape, dt in names_shapes.values():
        total += _numel(shape) * (dtype.itemsize if dt.is_floating_point else dt.itemsize)
    return total


def _numel(shape) -> int:  # noqa: ANN001
    n = 1
    for s in shape:
        n *= int(s)
    return n
