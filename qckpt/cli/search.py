"""``qckpt search``: a candidate scheme per linear under a budget, written as a recipe."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from qckpt import phases
from qckpt.cli import output
from qckpt.cli._common import start, world
from qckpt.cli._options import JsonOpt, NprocOpt, RecipeArg, SetOpt, VerboseOpt
from qckpt.cli.gpu_use import GpuUse
from qckpt.outputs import guard as guard_paths
from qckpt.outputs import recipe_inputs
from qckpt.recipe import Recipe

BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        "-b",
        metavar="BUDGET",
        help="4.5bpw (bits per covered weight, scales included) or an export size (18GB, "
        "18GiB); default: search.budget.",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--output", "-o", metavar="FOUND.yaml", help="The recipe to write.", show_default=False
    ),
]


def search_cmd(
    recipe: RecipeArg,
    output_path: OutOpt,
    budget: BudgetOpt = None,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    nproc_per_node: NprocOpt = 1,
    verbose: VerboseOpt = False,
) -> None:
    """Measure each linear's sensitivity to each of search.candidates on the calibration data
    (over DP x EP ranks, bit for bit the one process's), choose one per unit (fused groups and
    an MoE layer's experts together) for the least expected error under the budget, and write
    the recipe with that quant.schemes: calibrate and export then run it unchanged.

    Examples:

        qckpt search recipe.yaml --budget 4.5bpw -o found.yaml

        qckpt search recipe.yaml --budget 18GB -o found.yaml --nproc-per-node 4 --set parallel.ep=2
    """

    def guard(r: Recipe) -> None:
        from qckpt.errors import UsageError
        from qckpt.search.choose import parse_budget

        if r.search is None:
            raise UsageError("search: the recipe has no search section (search.candidates)")
        parse_budget(budget if budget is not None else r.search.budget)
        ins = recipe_inputs(r, recipe) + [("calibrate.data.path", r.calibrate.data.path)]
        outs = [("-o", output_path), ("--json", json_path)]
        guard_paths(outs, ins, file_outputs=["-o", "--json"])
        from qckpt.calib.datasets import precheck

        precheck(r.calibrate.data)

    def gpus(r: Recipe) -> GpuUse:
        return GpuUse("load.device", r.load.device)

    r = start(recipe, set_, nproc_per_node, verbose, guard=guard, gpus=gpus)
    with phases.phase(phases.STARTUP):
        from qckpt.pipeline.imports import cuda_warmup, warm_imports
        from qckpt.recipe import read_raw

        raw = read_raw(recipe, set_ or [])
        mods = ("qckpt.pipeline.search", "qckpt.load.loader", "qckpt.calib.calibrate")
        warm = cuda_warmup(r, "calibrate", os.environ)
        warm_imports(r.model.source, *mods, cuda_first_use=warm or False)
        from qckpt.pipeline.search import search

    with world(r, r.load.device) as mesh:
        run = search(r, raw, mesh, budget=budget, output=output_path, hooks=output.hooks())
        rep = run.result.report
        with phases.phase(phases.REPORT):
            data = output.with_phases({**rep, "data": run.data}, mesh)
            output.summary(table(rep))
            output.write_json(json_path, data)
    output.result(
        f"wrote {run.output}: {len(rep['units'])} units, {rep['bits_per_weight']:.3f} bits per "
        f"weight, {rep['export_bytes']} export bytes, expected error {rep['error']:.6g}"
    )


def table(rep: dict) -> list[str]:
    """The report as lines: per unit its choice, error and bytes, the alternatives' errors."""
    cands = rep["candidates"]
    lines = [f"budget {rep['budget']}: candidates " + "; ".join(
        f"[{i}] {c}" for i, c in enumerate(cands))]  # fmt: skip
    lines.append(f"{'unit':<48} {'chosen':>6} {'error':>12} {'bytes':>12}  errors per candidate")
    for u in rep["units"]:
        alts = " ".join("-" if e is None else f"{e:.4g}" for e in u["errors"])
        lines.append(
            f"{u['unit']:<48} {u['candidate']:>6} {u['error']:>12.6g} {u['bytes']:>12}  {alts}"
        )
    lines.append(
        f"linears {rep['linear_bytes']} bytes ({rep['bits_per_weight']:.3f} bpw) of "
        f"{rep['limit_bytes']} allowed (least {rep['minimum_bytes']}); export "
        f"{rep['export_bytes']} bytes; expected error {rep['error']:.6g}"
    )
    return lines
