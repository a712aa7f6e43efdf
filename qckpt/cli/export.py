"""``qckpt export``: FP8 / NVFP4 safetensors for serving stacks, streamed and atomic."""

from __future__ import annotations

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
    from qckpt.calib.state_file import load_calibration
    from qckpt.checkpoint.export import export_checkpoint
    from qckpt.models.build import load_config
    from qckpt.report import render_export_report

    calibration = load_calibration(r.calibrate.output)
    cfg = load_config(r.model.source)
    source_dir = r.model.source if cfg is not None and _is_dir(r.model.source) else None
    with _output.progress("exporting", None) as advance:
        rep = export_checkpoint(
            source=r.checkpoint.path,
            calibration=calibration,
            output=r.export.output,
            model_type=cfg.model_type,
            model_config=cfg,
            quant=r.quant,
            export=r.export,
            source_dir=source_dir,
            progress=advance,
        )
    data = rep.to_dict()
    render_export_report(data)
    for w in rep.warnings:
        _output.log(f"warning: {w}")
    _output.write_json(json_path, data)
    _output.result(f"wrote {r.export.output} ({r.export.format})")


def _is_dir(p: str) -> bool:
    from pathlib import Path

    return Path(p).is_dir()
