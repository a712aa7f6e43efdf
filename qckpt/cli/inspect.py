"""``qckpt inspect``: what a DCP dir, an HF dir, an export or a calibration file holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qckpt.cli import output
from qckpt.cli._options import JsonOpt, VerboseOpt


def inspect_cmd(
    path: Annotated[
        Path, typer.Argument(help="A DCP dir, an HF/export dir, or a .safetensors file.")
    ],
    json_path: JsonOpt = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="For a Megatron / torchtitan checkpoint: the HF config (a model dir or a "
            "built-in name) its tensors map onto.",
        ),
    ] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Tell what a checkpoint, an export or a calibration file holds.

    Examples:

        qckpt inspect runs/tiny-moe/dcp

        qckpt inspect runs/tiny-moe/calib.safetensors

        qckpt inspect runs/tiny-moe/fp8 --json export.json

        qckpt inspect megatron/iter_0001000 --model path/to/hf-config-dir
    """
    from qckpt.outputs import guard

    guard([("--json", json_path)], [("PATH", path)], file_outputs=["--json"])
    from qckpt import phases
    from qckpt.inspect import inspect_path
    from qckpt.summary import figures, inspect_summary

    # an HF dir's source layout (torch dtypes) only where it is shown: --json, --verbose
    info = inspect_path(path, model, layout=verbose or json_path is not None)
    if verbose:
        from qckpt.report import render_mapping

        render_mapping(f"{info['kind']}: {path}", info, console=output.out)
    else:
        for line in inspect_summary(info, str(path)):
            output.result(line)
    output.write_json(json_path, info)
    output.summary(figures(phases.summary()))
