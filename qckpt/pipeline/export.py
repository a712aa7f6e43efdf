"""``qckpt export``'s body: the recipe's checkpoint and calibration file -> quantized safetensors."""

from __future__ import annotations

from pathlib import Path

from qckpt import phases
from qckpt.pipeline.hooks import SILENT, Hooks
from qckpt.recipe import Recipe


def export(recipe: Recipe, *, hooks: Hooks = SILENT):
    """Export ``recipe.checkpoint`` with ``recipe.calibrate.output`` to ``recipe.export.output``;
    returns the ``ExportReport``. One process (distributed exports are issue 17)."""
    from qckpt.calib.state_file import load_calibration
    from qckpt.checkpoint.export import export_checkpoint
    from qckpt.models.build import load_config

    with phases.phase(phases.PLAN):
        calibration = load_calibration(recipe.calibrate.output)
        source = recipe.model.source
        cfg = load_config(source)
    # a model dir's config.json, tokenizer and generation files travel with the export
    source_dir = source if cfg is not None and Path(source).is_dir() else None
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
        )
