"""``qckpt convert``: an HF safetensors dir (or a recipe's model) to a DCP checkpoint, and back."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated

import typer

from qckpt.atomic import AtomicDir, atomic_dir, terminate_as_interrupt, write_error
from qckpt.cli import _output
from qckpt.cli._common import quiet_torch_logs, refuse_code_in_sources, start, world
from qckpt.cli._launch import relaunch, under_torchrun, will_relaunch
from qckpt.cli._options import NprocOpt, SetOpt, VerboseOpt
from qckpt.errors import OutputError, UsageError
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
    from qckpt.outputs import guard, recipe_inputs

    is_recipe = src.suffix in (".yaml", ".yml")
    outs = [("DST", dst)]
    model_in = [("--model", model)] if model and os.path.lexists(model) else []
    # the recipe's model.source joins the inputs once the recipe is read (in start)
    guard(outs, [("RECIPE" if is_recipe else "SRC", src), *model_in])

    def guard_recipe(r: Recipe) -> None:
        guard(outs, recipe_inputs(r, src, checkpoint=False) + model_in)

    from qckpt.checkpoint.sources import is_dcp_dir

    kind = "recipe" if is_recipe else ("dcp" if is_dcp_dir(src) else "hf")
    to = to or ("hf" if kind == "dcp" else "dcp")
    if to not in ("dcp", "hf"):
        raise UsageError(f"--to: must be dcp or hf, got {to!r}")
    if kind == to == "hf" and _quantized_hf(src):
        return _dequantize_hf(src, dst, dtype)
    if kind == to:
        raise UsageError(f"{src}: is already a {to} checkpoint")
    if kind == "recipe":
        r = start(src, set_, nproc_per_node, verbose, guard=guard_recipe)
    else:
        if not src.is_dir():
            raise UsageError(f"{src}: not a recipe, an HF model dir or a DCP dir")
        r = start_without_recipe(src if kind == "hf" else None, set_, nproc_per_node, verbose)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UsageError(f"DST: {dst} already exists; remove it or choose another destination")

    from qckpt.checkpoint.convert import dcp_to_hf_dir, hf_dir_to_dcp, save_model_dcp
    from qckpt.checkpoint.model_files import copy_model_files
    from qckpt.models.build import build_model, load_config

    # SIGTERM unwinds (removing the temp dir) in a plain run; under torchrun it must kill a rank
    # at once, even one blocked in a collective (a Python handler would wait for it to return)
    on_term = contextlib.nullcontext() if under_torchrun() else terminate_as_interrupt()
    with world(r, "cpu") as mesh, on_term:
        out = AtomicDir(dst, key="DST", replace=True, may_replace=_empty_dir)
        tmp = _begin_all(out, mesh)
        try:
            if kind == "dcp":
                cfg_src = model or (str(src) if (src / "config.json").is_file() else None)
                if cfg_src is None:
                    raise UsageError(
                        f"{src}: has no config.json; pass --model SOURCE for the model config"
                    )
                if mesh.is_main:
                    files_from = model if model and Path(model).is_dir() else src
                    dcp_to_hf_dir(src, tmp, load_config(cfg_src), model_files_from=files_from)
            else:
                built = build_model(r.model.source, dtype=r.model.dtype, seed=r.model.seed)
                if to == "hf":  # a recipe's seeded model, written the way transformers writes it
                    if mesh.is_main:
                        built.save_pretrained(str(tmp))
                else:
                    if kind == "hf":
                        hf_dir_to_dcp(src, tmp, built)
                    else:
                        save_model_dcp(built, tmp, mesh=mesh)
                    if mesh.is_main:
                        # the DCP dir carries its model config so that `--to hf` and `inspect` need no recipe
                        (tmp / "config.json").write_text(built.config.to_json_string())
                if mesh.is_main and Path(r.model.source).is_dir():
                    # tokenizer, generation config, chat template: what `--to hf` carries on
                    copy_model_files(r.model.source, tmp)
            _barrier(mesh)
            if mesh.is_main:  # written whole, then renamed: a failure leaves no half checkpoint
                out.commit()
        except BaseException as exc:
            if mesh.is_main:  # nothing half-written stays behind
                out.abort()
            err = write_error(exc, out.target, "DST", None)
            if err is not None:
                raise err from exc
            raise
    _output.result(f"wrote {dst} ({to})")


def _empty_dir(path: Path) -> None:
    """DST may be an empty dir (replaced), never anything else: checked again at the swap."""
    if not path.is_dir() or path.is_symlink() or any(path.iterdir()):
        raise OutputError(
            f"DST: {path} appeared while this command wrote it; refusing to replace it"
        )


def _begin_all(out: AtomicDir, mesh) -> Path:
    """One temp dir for all ranks: the main rank makes it, the others learn its name (or that
    it failed, so that nobody waits for a dir that will never come)."""
    if mesh.world_size == 1:
        return out.begin()
    import torch.distributed as dist

    box: list[str | None] = [None]
    try:
        if mesh.is_main:
            box[0] = str(out.begin())
    finally:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise OutputError(f"DST: the main rank could not create a temp dir beside {out.target}")
    return Path(box[0])


def _quantized_hf(src: Path) -> bool:
    from qckpt.checkpoint.sources import SafetensorsSource

    if not src.is_dir():
        return False
    layout = SafetensorsSource(src).layout()
    return layout is not None and layout.quantized


def _dequantize_hf(src: Path, dst: Path, dtype: str) -> None:
    """A quantized HF dir -> a plain HF dir of ``dtype``, streaming, written then renamed."""
    from qckpt.checkpoint.dequantize_dir import DTYPES, dequantize_dir

    if dtype not in DTYPES:
        raise UsageError(f"--dtype: must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UsageError(f"DST: {dst} already exists; remove it or choose another destination")
    quiet_torch_logs()
    with atomic_dir(dst, key="DST", replace=True, may_replace=_empty_dir) as tmp:
        info = dequantize_dir(src, tmp, dtype=DTYPES[dtype])
    _output.result(
        f"wrote {dst} (hf, {dtype}): {info['dequantized']} of {info['tensors']} tensors "
        f"dequantized from {info['layout']}"
    )


def _barrier(mesh) -> None:
    if mesh.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def start_without_recipe(
    hf_dir: Path | None, overrides: list[str] | None, nproc: int, verbose: bool
):
    from qckpt.recipe import recipe_from_dict

    _output.set_verbose(verbose)
    raw = {"model": {"source": str(hf_dir)}} if hf_dir is not None else {}
    recipe = recipe_from_dict(raw, overrides or [])  # validated before any rank starts
    recipe.parallel.check_world(
        nproc if will_relaunch(nproc) else int(os.environ.get("WORLD_SIZE", "1"))
    )
    refuse_code_in_sources(recipe)
    code = relaunch(nproc)
    if code is not None:
        raise typer.Exit(code)
    quiet_torch_logs()
    return recipe
