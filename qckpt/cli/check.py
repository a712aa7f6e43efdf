"""``qckpt check``: validate an FP8/FP4 export dir without a GPU (and without torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qckpt.cli import output
from qckpt.cli._options import JsonOpt


def check_cmd(
    path: Annotated[Path, typer.Argument(help="An export dir (qckpt's or another tool's).")],
    json_path: JsonOpt = None,
) -> None:
    """Check that an export is what vLLM and transformers will load right: config fields,
    ignore list against the tensors, every scale's shape, dtype and value, MoE experts, KV scales.

    Exit 0 with a one-line summary, or exit 1 with the problems, one per line after a summary.

    Examples:

        qckpt check runs/tiny-moe/fp8

        qckpt check runs/tiny-moe/fp8 --json check.json
    """
    from qckpt.layouts.check import check_export

    if not path.is_dir():
        raise typer.BadParameter(f"{path}: not a directory", param_hint="PATH")
    res = check_export(path)
    output.write_json(
        json_path,
        {
            "path": res.path,
            "ok": res.ok,
            "layout": res.layout,
            "scheme": res.scheme,
            "quantized": res.quantized,
            "experts": res.experts,
            "unquantized": res.unquantized,
            "kv_cache_scales": res.kv,
            "problems": res.problems,
        },
    )
    for line in res.lines():
        output.result(line)
    from qckpt import phases
    from qckpt.summary import figures

    output.summary(figures(phases.summary()))
    if not res.ok:
        raise typer.Exit(1)
