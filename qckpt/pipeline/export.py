"""``qckpt export``'s body: the recipe's checkpoint and calibration file -> quantized safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qckpt import phases
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.recipe import Recipe

if TYPE_CHECKING:
    from qckpt.parallel.mesh import Mesh


def export(recipe: Recipe, mesh: Mesh | None = None, *, hooks: Hooks = SILENT):
    """Export ``recipe.checkpoint`` with ``recipe.calibrate.output`` to ``recipe.export.output``;
    returns the ``ExportReport``. Every rank of ``mesh`` calls it: each writes its share of the
    tensors into the shared shard files, quantizing on its GPU when ``export.device`` allows one (pick_device)."""
    from qckpt.calib.state_file import load_calibration
    from qckpt.checkpoint.export import WriteOptions, export_checkpoint
    from qckpt.models.build import load_config
    from qckpt.parallel.mesh import pick_device

    # first: a device that is not there is refused before any work
    want = recipe.export.device
    if want == "auto" and recipe.quant.weights.format == "nvfp4":
        # on the H200 (2026-11-30) a GPU NVFP4 export of 4096-wide weights differed from the CPU
        # export in a few bytes; until that is found, auto keeps NVFP4 on the CPU (cuda: as asked)
        want = "cpu"
    device = pick_device(want, key="export.device")
    with phases.phase(phases.PLAN):
        calibration = load_calibration(recipe.calibrate.output)
        source = recipe.model.source
        cfg = load_config(source)
    # a model dir's config.json, tokenizer and generation files travel with the export
    source_dir = source if cfg is not None and Path(source).is_dir() else None
    options = WriteOptions(
        device=str(device), writers=recipe.export.writers, unmap_large_allocations=True
    )
    # plan_export is timed as its own phase; the rest reads, quantizes and writes, tensor by tensor
    with phases.phase(phases.WRITE), hooks.progress("exporting", None) as advance:
        return export_checkpoint(
            source=recipe.checkpoint.path,
            calibration=calibration,
            output=recipe.export.output,
            model_type=cfg.model_type,
            model_config=cfg,
            quant=recipe.quant,
            export=recipe.export,
            source_dir=source_dir,
            progress=advance,
            mesh=mesh,
            options=options,
        )
