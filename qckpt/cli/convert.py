"""``qckpt convert``: an HF safetensors dir (or a recipe's model) to a DCP checkpoint, and back."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated

import typer

from qckpt import phases
from qckpt.atomic import terminate_as_interrupt
from qckpt.cli import output
from qckpt.cli._common import quiet_torch_logs, start, start_with, world
from qckpt.cli._options import JsonOpt, NprocOpt, SetOpt, VerboseOpt
from qckpt.cli.launch import under_torchrun
from qckpt.errors import UsageError
from qckpt.recipe import Recipe


def convert_cmd(
    src: Annotated[
        Path,
        typer.Argument(
            help="A recipe .yaml (its model, seeded), an HF safetensors dir, or a DCP dir.",
            show_default=False,
        ),
    ],
    dst: Annotated[Path, typer.Argument(help="The directory to write.", show_default=False)],
    to: Annotated[
        str | None,
        typer.Option(
            "--to", metavar="dcp|hf", help="Output kind; default: dcp, or hf from a DCP dir."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="SOURCE",
            help="Model config for DCP -> HF when the DCP dir has no config.json (built-in name or HF dir).",
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            metavar="bfloat16|float32|float16",
            help="Dtype of the weights a quantized HF dir is dequantized into (--to hf).",
        ),
    ] = "bfloat16",
    set_: SetOpt = None,
    json_path: JsonOpt = None,
    nproc_per_node: NprocOpt = 1,
    verbose: VerboseOpt = False,
) -> None:
    """Turn a model or checkpoint into a DCP checkpoint, or a DCP checkpoint into HF safetensors.

    Examples:

        qckpt convert configs/tiny-moe.yaml runs/tiny-moe/dcp

        qckpt convert path/to/hf-model runs/model/dcp

        qckpt convert runs/tiny-moe/dcp runs/tiny-moe/hf --to hf

        qckpt convert path/to/fp8-model runs/model/bf16 --to hf --dtype bfloat16
    """
    is_recipe = src.suffix in (".yaml", ".yml")
    model_in = [("--model", model)] if model and os.path.lexists(model) else []
    outs = [("DST", dst), ("--json", json_path)]
    _guard_paths(src, outs, is_recipe, model_in, None)
    from qckpt.read.detect import is_dcp_dir

    kind = "recipe" if is_recipe else ("dcp" if is_dcp_dir(src) else "hf")
    to = to or ("hf" if kind == "dcp" else "dcp")
    if to not in ("dcp", "hf"):
        raise UsageError(f"--to: must be dcp or hf, got {to!r}")
    if kind == to == "hf" and _quantized_hf(src):
        return _dequantize_hf(src, dst, dtype, json_path)
    if kind == to:
        raise UsageError(f"{src}: is already a {to} checkpoint")
    if kind != "recipe" and not src.is_dir():
        raise UsageError(f"{src}: not a recipe, an HF model dir or a DCP dir")
    r = _start(kind, src, outs, set_, nproc_per_node, verbose, model_in)
    _refuse_existing(dst)
    with phases.phase(phases.STARTUP):
        from qckpt.pipeline.imports import warm_imports

        source = None if kind == "dcp" else r.model.source
        warm_imports(source, "qckpt.pipeline.convert", "qckpt.convert.dcp")
        from qckpt.pipeline.convert import convert

    # SIGTERM unwinds (removing the temp dir) in a plain run; under torchrun it must kill a rank
    # at once, even one blocked in a collective (a Python handler would wait for it to return)
    on_term = contextlib.nullcontext() if under_torchrun() else terminate_as_interrupt()
    with world(r, "cpu", parallel=False) as mesh, on_term:
        convert(kind=kind, to=to, src=src, dst=dst, recipe=r, mesh=mesh, model_config=model)
    _report(json_path, {"src": str(src), "dst": str(dst), "to": to})
    output.result(f"wrote {dst} ({to})")


def _report(json_path: Path | None, data: dict) -> None:
    """The phase breakdown and whole-command peaks: on stderr, and in ``--json``."""
    from qckpt.report import render_command

    with phases.phase(phases.REPORT):
        data = output.with_phases(data)
        if output.verbose():
            render_command(data)
        if "src" in data:
            from qckpt.summary import convert_summary

            output.summary(convert_summary(data))
        output.write_json(json_path, data)


def _guard_paths(src: Path, outs: list, is_recipe: bool, model_in: list, r: Recipe | None) -> None:
    """DST and --json against SRC (or the recipe) and --model; once read, the recipe's
    model.source too."""
    from qckpt.outputs import guard, recipe_inputs

    if r is None:
        ins = [("RECIPE" if is_recipe else "SRC", src)]
    else:
        ins = recipe_inputs(r, src, checkpoint=False)
    guard(outs, ins + model_in, file_outputs=["--json"])


def _start(
    kind: str, src: Path, outs: list, set_, nproc: int, verbose: bool, model_in: list
) -> Recipe:
    if kind == "recipe":

        def guard(r: Recipe) -> None:
            _guard_paths(src, outs, True, model_in, r)

        return start(src, set_, nproc, verbose, guard=guard, parallel=False)
    from qckpt.recipe import recipe_from_dict

    # a recipe made of the arguments (an HF dir is the model), validated before any rank starts
    raw = {"model": {"source": str(src)}} if kind == "hf" else {}
    return start_with(lambda: recipe_from_dict(raw, set_ or []), nproc, verbose, parallel=False)


def _refuse_existing(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UsageError(f"DST: {dst} already exists; remove it or choose another destination")


def _quantized_hf(src: Path) -> bool:
    from qckpt.read.sources import SafetensorsSource

    if not src.is_dir():
        return False
    layout = SafetensorsSource(src).layout()
    return layout is not None and layout.quantized


def _dequantize_hf(src: Path, dst: Path, dtype: str, json_path: Path | None) -> None:
    """A quantized HF dir -> a plain HF dir of ``dtype``, streaming, written then renamed."""
    from qckpt.convert.dequantize import DTYPES
    from qckpt.pipeline.convert import dequantize_hf

    if dtype not in DTYPES:
        raise UsageError(f"--dtype: must be one of {', '.join(DTYPES)}; got {dtype!r}")
    _refuse_existing(dst)
    quiet_torch_logs()
    info = dequantize_hf(src, dst, dtype)
    _report(json_path, {"src": str(src), "dst": str(dst), "to": "hf", "dtype": dtype, **info})
    output.result(
        f"wrote {dst} (hf, {dtype}): {info['dequantized']} of {info['tensors']} tensors "
        f"dequantized from {info['layout']}"
    )
