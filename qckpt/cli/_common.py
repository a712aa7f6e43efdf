"""Steps several commands share: reading the recipe, joining the world, building the model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from qckpt import phases
from qckpt.cli import output
from qckpt.cli.gpu_use import GpuUse, check_gpus, visible_gpus
from qckpt.cli.launch import relaunch, will_relaunch
from qckpt.models.remote_code import refuse_custom_code
from qckpt.recipe import Recipe, load_recipe
from qckpt.term import quiet_torch_logs


def start(
    recipe_path: Path,
    overrides: list[str] | None,
    nproc: int = 1,
    verbose: bool = False,
    guard: Callable[[Recipe], None] | None = None,
    *,
    parallel: bool = True,
    gpus: Callable[[Recipe], GpuUse] | None = None,
) -> Recipe:
    """Relaunch under torchrun if asked; otherwise read and validate the recipe.

    ``guard(recipe)`` checks the command's output paths against its inputs (``qckpt.outputs``);
    it runs before torch is imported, so a refused output costs no start-up time. ``parallel``:
    whether the command uses the recipe's ``parallel.ep``/``tp`` (export and convert split
    their work over whatever ranks they have, so one recipe serves every command). ``gpus``:
    how the command uses the GPUs, to check ``--nproc-per-node`` against them first.
    """
    return start_with(
        lambda: load_recipe(recipe_path, overrides or []),
        nproc,
        verbose,
        guard,
        parallel=parallel,
        gpus=gpus,
    )


def start_with(
    read: Callable[[], Recipe],
    nproc: int = 1,
    verbose: bool = False,
    guard: Callable[[Recipe], None] | None = None,
    *,
    parallel: bool = True,
    gpus: Callable[[Recipe], GpuUse] | None = None,
) -> Recipe:
    """``start`` for a recipe that ``read()`` makes (``convert`` makes one from its arguments)."""
    with phases.phase(phases.STARTUP):
        return _start(read, nproc, verbose, guard, parallel, gpus)


def _start(
    read: Callable[[], Recipe],
    nproc: int,
    verbose: bool,
    guard: Callable[[Recipe], None] | None,
    parallel: bool,
    gpus: Callable[[Recipe], GpuUse] | None,
) -> Recipe:
    output.set_verbose(verbose)
    # everything that can be checked is checked here, before any rank starts: a bad recipe is
    # one line and exit 2, never a launcher's output
    with phases.startup_part(phases.RECIPE):
        recipe = read()
        if parallel:
            recipe.parallel.check_world(nproc if will_relaunch(nproc) else _world_size())
        if guard is not None:
            guard(recipe)
        refuse_code_in_sources(recipe)
        if will_relaunch(nproc) and gpus is not None:
            note = check_gpus(gpus(recipe), nproc, visible_gpus())
            if note:
                output.log(note)
    code = relaunch(nproc)
    if code is not None:
        raise typer.Exit(code)
    with phases.startup_part(phases.TORCH):
        quiet_torch_logs()  # imports torch
    return recipe


def refuse_code_in_sources(recipe: Recipe) -> None:
    """A model dir that ships its own Python is refused here, before torch or transformers load."""
    if Path(recipe.model.source).is_dir():
        refuse_custom_code(recipe.model.source)


@contextmanager
def world(recipe: Recipe, device: str = "auto", parallel: bool = True) -> Iterator:
    """The DP x EP x TP mesh for the life of a command; torn down even on failure. Without
    ``parallel`` every rank is a DP rank (the command ignores ``parallel.ep``/``tp``)."""
    with phases.phase(phases.WORLD):
        from qckpt.parallel.mesh import init_mesh, shutdown

        mesh = init_mesh(
            ep=recipe.parallel.ep if parallel else 1,
            tp=recipe.parallel.tp if parallel else 1,
            timeout_s=recipe.parallel.timeout_s,
            device=device,
        )
    try:
        yield mesh
    finally:
        with phases.phase(phases.WORLD):
            shutdown(mesh)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
