"""``qckpt plan``: every rank's memory and reads for a world, predicted from metadata alone."""

from __future__ import annotations

from typing import Annotated

import typer

from qckpt.cli import output
from qckpt.cli._options import JsonOpt, RecipeArg, SetOpt
from qckpt.errors import UsageError


def _size(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    from qckpt.plan.layouts import parse_memory

    try:
        return parse_memory(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc-per-node", metavar="N", help="Processes (GPUs) per node the plan is for."
    ),
]
NnodesOpt = Annotated[int, typer.Option("--nnodes", metavar="M", help="Nodes (world size N x M).")]
GpuMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-memory",
        metavar="SIZE",
        help="Memory of one GPU (141GB, 139GiB): say what fits and suggest a layout.",
        show_default=False,
    ),
]
HostMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--host-memory",
        metavar="SIZE",
        help="Host memory of one node (2TB): also check what offload and export keep there.",
        show_default=False,
    ),
]
LayoutOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--layout",
        metavar="ep=E,tp=T,resident=R,offload=O,activations=A",
        help="Also plan this layout (keys not given: the recipe's). Repeatable.",
        show_default=False,
    ),
]


def plan_cmd(
    recipe: RecipeArg,
    nproc_per_node: NprocOpt,
    nnodes: NnodesOpt = 1,
    gpu_memory: GpuMemoryOpt = None,
    host_memory: HostMemoryOpt = None,
    layout: LayoutOpt = None,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Predict each command's memory and reads on every rank, without loading anything.

    For load, calibrate and export, per rank: parameter bytes, transient bytes, activations
    kept, bytes read, the peak, and whether it fits `--gpu-memory`; then the smallest
    EP/TP/offload layout that fits. The model is sized from its config.json (a model type
    qckpt cannot size so is built on the meta device) and the checkpoint is read for its
    metadata only; without a checkpoint, reads are the model's BF16 size.

    Examples:

        qckpt plan configs/tiny-moe.yaml --nproc-per-node 2

        qckpt plan configs/models/qwen3-30b-a3b/plan.yaml --nproc-per-node 2 --gpu-memory 139GiB

        qckpt plan configs/models/deepseek-v3/plan.yaml --nproc-per-node 8 --nnodes 2 --gpu-memory 139GiB --set parallel.ep=16 --layout ep=16,resident=fp8 --json plan.json
    """
    from qckpt.cli._common import refuse_code_in_sources
    from qckpt.outputs import guard as guard_paths
    from qckpt.outputs import recipe_inputs
    from qckpt.plan.layouts import recipe_layout
    from qckpt.recipe import load_recipe

    if nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node: must be >= 1, got {nproc_per_node}")
    if nnodes < 1:
        raise UsageError(f"--nnodes: must be >= 1, got {nnodes}")
    device_bytes = _size(gpu_memory, "--gpu-memory")
    host_bytes = _size(host_memory, "--host-memory")
    from qckpt.plan.layouts import parse_layout

    r = load_recipe(recipe, set_ or [])
    guard_paths([("--json", json_path)], recipe_inputs(r, recipe), file_outputs=["--json"])
    refuse_code_in_sources(r)
    base = recipe_layout(r)
    extra = [parse_layout(spec, base) for spec in layout or []]
    # torch's logs are quieted where the plan imports torch (the meta model), never before
    from qckpt.pipeline.plan import plan
    from qckpt.plan.render import render_plan

    res = plan(
        r,
        recipe_path=str(recipe),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        layouts=extra,
    )
    data = res.to_dict()
    render_plan(data, console=output.out)
    output.write_json(json_path, data)
