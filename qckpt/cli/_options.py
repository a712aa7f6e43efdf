"""Option types shared by every command, so each flag reads and behaves the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

RecipeArg = Annotated[
    Path,
    typer.Argument(
        metavar="RECIPE", help="The YAML recipe (see configs/ for examples).", show_default=False
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY.PATH=VALUE",
        help="Override one recipe value, e.g. --set load.stream=false. Repeatable.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    Path | None,
    typer.Option(
        "--json", metavar="PATH", help="Also write the report as JSON to PATH.", show_default=False
    ),
]
NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc-per-node",
        min=1,
        metavar="N",
        help="Relaunch this command under torch.distributed.run with N processes on this host.",
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show the detail: each step's lines, the full tables, every rank's own lines.",
    ),
]
