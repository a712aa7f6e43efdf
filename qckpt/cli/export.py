"""``qckpt export``: FP8 / NVFP4 safetensors for serving stacks, streamed and atomic."""

from __future__ import annotations

from qckpt import phases
from qckpt.cli import _output
from qckpt.cli._common import start
from qckpt.cli._options import JsonOpt, RecipeArg, SetOpt, VerboseOpt
from qckpt.outputs import check_export_target, recipe_inputs
from qckpt.outputs import guard as guard_paths
from qckpt.recipe import Recipe


def export_cmd(
    recipe: RecipeArg,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Write the checkpoint plus the calibration file as quantized safetensors.

    Examples:

        qckpt export configs/tiny-moe.yaml

        qckpt export configs/tiny-moe.yaml --set export.format=modelopt --set export.output=runs/mo

        qckpt export configs/tiny-dense.yaml --set export.overwrite=true --json export.json
    """

    def guard(r: Recipe) -> None:
        ins = recipe_inputs(r, recipe) + [("calibrate.output", r.calibrate.output)]
        guard_paths(
            [("export.output", r.export.output), ("--json", json_path)],
            ins,
            file_outputs=["--json"],
        )
        check_export_target(r.export.output, r.export.overwrite)

    r = start(recipe, set_, 1, verbose, guard=guard)
    with phases.phase(phases.STARTUP):
        from qckpt.pipeline.export import export
        from qckpt.pipeline.imports import warm_imports
        from qckpt.report import render_command, render_export_report

        warm_imports(r.model.source, "qckpt.checkpoint.export", "qckpt.calib.state_file")

    rep = export(r, hooks=_output.hooks())
    with phases.phase(phases.REPORT):
        data = _output.with_phases(rep.to_dict())
        render_export_report(rep.to_dict())
        render_command(data)
        for w in rep.warnings:
            _output.log(f"warning: {w}")
        _output.write_json(json_path, data)
    _output.result(f"wrote {r.export.output} ({r.export.format})")
