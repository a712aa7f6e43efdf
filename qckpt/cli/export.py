"""``qckpt export``: FP8 / NVFP4 safetensors for serving stacks, streamed and atomic."""

from __future__ import annotations

from qckpt import phases
from qckpt.cli import output
from qckpt.cli._common import start, world
from qckpt.cli._options import JsonOpt, NprocOpt, RecipeArg, SetOpt, VerboseOpt
from qckpt.cli.gpu_use import GpuUse
from qckpt.outputs import check_export_target, recipe_inputs
from qckpt.outputs import guard as guard_paths
from qckpt.recipe import Recipe


def export_cmd(
    recipe: RecipeArg,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    nproc_per_node: NprocOpt = 1,
    verbose: VerboseOpt = False,
) -> None:
    """Write the checkpoint plus the calibration file as quantized safetensors.

    Under torchrun (or with --nproc-per-node) every rank reads, quantizes (on its GPU when
    there is one) and writes its share of the tensors (an equal share of the bytes read and
    written) into the shard files the ranks share; rank 0 writes the rest and renames the
    finished dir into place.

    Examples:

        qckpt export configs/tiny-moe.yaml

        qckpt export configs/tiny-moe.yaml --set export.format=modelopt --set export.output=runs/mo

        qckpt export configs/tiny-dense.yaml --set export.overwrite=true --json export.json

        torchrun --nproc-per-node 2 -m qckpt export configs/tiny-moe.yaml
    """

    def guard(r: Recipe) -> None:
        ins = recipe_inputs(r, recipe) + [("calibrate.output", r.calibrate.output)]
        guard_paths(
            [("export.output", r.export.output), ("--json", json_path)],
            ins,
            file_outputs=["--json"],
        )
        check_export_target(r.export.output, r.export.overwrite)

    def gpus(r: Recipe) -> GpuUse:
        return GpuUse("export.device", r.export.device, share=True)

    r = start(recipe, set_, nproc_per_node, verbose, guard=guard, parallel=False, gpus=gpus)
    with phases.phase(phases.STARTUP):
        from qckpt.export.model_record import peek, usable
        from qckpt.pipeline.imports import warm_imports

        mods = ("qckpt.pipeline.export", "qckpt.export.writer", "qckpt.calib.state_file")
        # the calibration file knows the model's linears: no model code to import (the export
        # imports it itself when it does not)
        known = usable(peek(r.calibrate.output), r.model.source)
        from qckpt.read.detect import is_dcp_dir

        if is_dcp_dir(r.checkpoint.path):  # its reader, in the start-up, not in the export's time
            mods += ("torch.distributed.checkpoint",)
        warm_imports(None if known else r.model.source, *mods, "qckpt.report")
        from qckpt.pipeline.export import export
        from qckpt.report import render_command, render_export_report
        from qckpt.summary import export_summary

    # the ranks only agree on small things (a temp dir's name, who failed): gloo on the host,
    # whatever device quantizes
    with world(r, "cpu", parallel=False) as mesh:
        rep = export(r, mesh, hooks=output.hooks())
        with phases.phase(phases.REPORT):  # in the world: every rank's peaks are gathered
            data = output.with_phases(rep.to_dict(), mesh)
            if output.verbose():
                render_export_report(rep.to_dict())
                render_command(data)
            output.summary(export_summary(data))
            output.write_json(json_path, data)
    output.result(f"wrote {r.export.output} ({r.export.format}) on {rep.world_size} rank(s)")
