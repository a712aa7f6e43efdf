"""``qckpt export``'s body: the recipe's checkpoint and calibration file -> quantized safetensors."""

from __future__ import annotations

import gc
import time
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
    from qckpt.export.model_record import modules_of, usable
    from qckpt.export.plan import plan_export
    from qckpt.export.writer import WriteOptions, write_export
    from qckpt.models.build import load_config
    from qckpt.models.naming import refuse_experts_layout
    from qckpt.parallel.mesh import pick_device
    from qckpt.phases import gc_paused

    # first: a device that is not there is refused before any work
    device = pick_device(recipe.export.device, key="export.device", share=True)
    # the export's seconds (and GB/s) count from here, the start of planning, to the committed
    # dir on the main rank: the same span for one process and for every rank count
    started = time.perf_counter()
    with phases.phase(phases.PLAN), gc_paused():
        # before the calibration file: no file qckpt makes fits such a model anyway
        refuse_experts_layout(_dir_model_type(recipe.model.source), "export")
        calibration = load_calibration(recipe.calibrate.output)
        source = recipe.model.source
        rec = calibration.model if usable(calibration.model, source) else None
        # the calibration file knows the model: no transformers config, no meta build
        cfg = _config_of(source, rec) if rec is not None else load_config(source)
        model_type = cfg["model_type"] if isinstance(cfg, dict) else cfg.model_type
        # a model dir's config.json, tokenizer and generation files travel with the export
        source_dir = source if cfg is not None and Path(source).is_dir() else None
        plan = plan_export(
            source=recipe.checkpoint.path,
            source_format=recipe.checkpoint.format,
            calibration=calibration,
            output=recipe.export.output,
            model_type=model_type,
            model_config=cfg,
            quant=recipe.quant,
            export=recipe.export,
            source_dir=source_dir,
            modules=modules_of(rec) if rec is not None else None,
        )
    options = WriteOptions(
        device=str(device), writers=recipe.export.writers, unmap_large_allocations=True
    )
    # the plan's objects (several per tensor: 200k+ on a large MoE) are never garbage: out of
    # the cyclic collector's sight while the write runs, instead of scanned by each collection
    gc.freeze()
    try:
        with phases.phase(phases.WRITE), hooks.progress("exporting", None) as advance:
            return write_export(plan, progress=advance, started=started, mesh=mesh, options=options)
    finally:
        gc.unfreeze()


def _dir_model_type(source: str) -> str:
    """A model dir's config.json ``model_type``; "" for a built-in name (read without
    transformers: the export builds no config where the calibration file has the model)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        return ""
    from qckpt.storage.files import read_json

    return str(read_json(path, what="model config").get("model_type") or "")


def _config_of(source: str, rec: dict) -> dict:
    """The model's config as a dict: the model dir's config.json (what the export writes), or
    the one the calibration file recorded for a built-in name."""
    path = Path(source) / "config.json"
    if path.is_file():
        from qckpt.storage.files import read_json

        return read_json(path, what="model config")
    return dict(rec["config"])
