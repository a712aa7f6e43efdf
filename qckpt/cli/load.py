"""``qckpt load``: build the model with quantized parameters and stream a checkpoint into it."""

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


def load_cmd(
    recipe: RecipeArg,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    nproc_per_node: NprocOpt = 1,
    verbose: VerboseOpt = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", metavar="PNG", help="Draw memory over the load to PNG.")
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="Also run the bulk-dequant baseline and report both side by side."
        ),
    ] = False,
) -> None:
    """Load a checkpoint into a model whose parameters are quantized, and report memory.

    Examples:

        qckpt load configs/tiny-moe.yaml

        qckpt load configs/tiny-moe.yaml --set load.params=mxfp8 --compare --plot mem.png

        torchrun --nproc-per-node 2 -m qckpt load configs/tiny-moe.yaml --json load.json

        qckpt load configs/tiny-dense.yaml --nproc-per-node 2
    """

    def guard(r: Recipe) -> None:
        outs = [("--json", json_path), ("--plot", plot)]
        guard_paths(outs, recipe_inputs(r, recipe), file_outputs=["--json", "--plot"])

    def gpus(r: Recipe) -> GpuUse:
        return GpuUse("load.device", r.load.device)

    r = start(recipe, set_, nproc_per_node, verbose, guard=guard, gpus=gpus)
    if r.load.backend == "te":
        from qckpt.formats.te import require_te

        require_te()  # before any world is started
    with phases.phase(phases.STARTUP):
        from qckpt.pipeline.imports import cuda_warmup, warm_imports

        mods = ("qckpt.pipeline.load", "qckpt.load.loader", "qckpt.plot", "qckpt.report")
        warm = cuda_warmup(r, "load", os.environ)
        warm_imports(r.model.source, *mods, cuda_first_use=warm or False)
        from qckpt.pipeline.load import load
        from qckpt.plot import plot_memory
        from qckpt.report import render_command, render_load_report
        from qckpt.summary import load_summary

    with world(r, r.load.device) as mesh:
        res = load(r, mesh, compare=compare, hooks=output.hooks())
        with phases.phase(phases.REPORT):
            if plot is not None and mesh.is_main:
                from qckpt.atomic import atomic_file

                with atomic_file(plot, key="--plot") as tmp:
                    plot_memory(res.reports, tmp)
            data = output.with_phases(res.to_dict(str(recipe), r.load.params), mesh)
            if output.verbose():
                render_load_report(data)
                render_command(data)
            output.summary(load_summary(data))
            output.write_json(json_path, data)
        first = data["runs"][0]
        output.result(
            f"loaded {first.get('tensors', '?')} tensors from {r.checkpoint.path} into "
            f"{r.load.params} params ({'stream' if r.load.stream else 'bulk'}) "
            f"in {first.get('seconds', 0):.2f} s on {mesh.world_size} rank(s)"
        )
