"""``qckpt init``: a commented recipe for a model dir, with a parallel layout the planner says
fits the GPUs given (the same :func:`qckpt.pipeline.plan.plan` that ``qckpt plan`` runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qckpt.errors import UsageError
from qckpt.models.arch import Architecture, detect
from qckpt.plan.layouts import Layout
from qckpt.recipe import Recipe, recipe_from_dict
from qckpt.recipe_init import InitChoices, recipe_dict, render_recipe


@dataclass
class InitResult:
    text: str
    arch: Architecture
    layout: Layout
    peaks: dict[str, int]  # command -> predicted peak bytes of its largest rank


def _plan(recipe: Recipe, gpus: int, gpu_bytes: int, suggest: bool):
    from qckpt.pipeline.plan import plan

    return plan(recipe, nproc_per_node=gpus, device_bytes=gpu_bytes, suggest=suggest)


def make_recipe(
    model_dir: str, *, fmt: str, gpus: int, gpu_bytes: int, memory_note: str
) -> InitResult:
    """The recipe's text for ``model_dir``; raises when no layout of ``gpus`` fits."""
    arch = detect(model_dir)
    name = Path(model_dir).resolve().name or "model"
    choices = InitChoices(model_dir=model_dir, name=name, fmt=fmt, gpus=gpus, layout=Layout())
    res = _plan(recipe_from_dict(recipe_dict(arch, choices)), gpus, gpu_bytes, suggest=True)
    # calibrate holds the most (weights + activations): its layout serves load and export too
    lay = res.suggestions.get("calibrate")
    if lay is None:
        raise UsageError(
            f"--gpus {gpus}: no EP/TP layout of {gpus} GPU(s) with {memory_note} each fits "
            "calibrate (qckpt plan shows the figures); give more GPUs or --gpu-memory"
        )
    choices.layout = lay
    recipe = recipe_from_dict(recipe_dict(arch, choices))
    res = _plan(recipe, gpus, gpu_bytes, suggest=False)
    if res.fits("calibrate") is False:
        raise UsageError(f"--gpus {gpus}: the layout {lay.label()} does not fit calibrate")
    peaks = {c: max(r.peak_bytes for r in rows) for c, rows in res.rows.items()}
    misfits = [c for c in ("load", "export") if res.fits(c) is False]
    text = render_recipe(arch, choices, peaks, memory_note, misfits)
    return InitResult(text=text, arch=arch, layout=lay, peaks=peaks)
