"""qckpt: quantized checkpoints for large transformers.

The front door for library users (docs/API.md shows a whole load -> calibrate -> export ->
check). ``import qckpt`` imports no torch: each name below is looked up on first use
(PEP 562), so a script that only checks an export never pays for torch.

* recipes and worlds: ``load_recipe``, ``recipe_from_dict``, ``init_mesh``;
* models and tensors: ``build_model``, ``quantize``, ``dequantize``, ``empty``;
* checkpoints: ``open_checkpoint``, ``load_checkpoint`` with ``LoadOptions``;
* calibration: ``calibrate_model``, ``save_calibration``, ``load_calibration``;
* export: ``plan_export``, ``write_export``, ``export_checkpoint`` with ``WriteOptions``;
  ``check_export``; ``evaluate_export`` with ``EvalOptions``; ``EXPORT_MARKER`` (the file
  every export dir holds: ``export.overwrite`` replaces only a dir that has it);
* errors: ``QckptError`` and its kinds (docs/ERRORS.md).

The CLI's command bodies are ``qckpt.pipeline``; every other module is internal.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it (qckpt.api: the wrappers with a library caller's signature)
_EXPORTS = {
    "load_recipe": "qckpt.recipe",
    "init_mesh": "qckpt.parallel.mesh",
    "build_model": "qckpt.api",
    "quantize": "qckpt.formats",
    "dequantize": "qckpt.formats",
    "empty": "qckpt.formats",
    "open_checkpoint": "qckpt.api",
    "load_checkpoint": "qckpt.api",
    "LoadOptions": "qckpt.api",
    "calibrate_model": "qckpt.api",
    "save_calibration": "qckpt.calib.state_file",
    "load_calibration": "qckpt.calib.state_file",
    "plan_export": "qckpt.api",
    "write_export": "qckpt.export.writer",
    "export_checkpoint": "qckpt.api",
    "WriteOptions": "qckpt.export.writer",
    "check_export": "qckpt.layouts.check",
    "evaluate_export": "qckpt.api",
    "EvalOptions": "qckpt.evaluate.options",
    # a recipe from a mapping (what load_recipe reads from YAML); the file every export dir holds
    "recipe_from_dict": "qckpt.recipe",
    "EXPORT_MARKER": "qckpt.outputs",
    "QckptError": "qckpt.errors",
    "UsageError": "qckpt.errors",
    "RecipeError": "qckpt.errors",
    "FormatError": "qckpt.errors",
    "CheckpointError": "qckpt.errors",
    "CalibrationError": "qckpt.errors",
    "SyncError": "qckpt.errors",
    "PeerError": "qckpt.errors",
    "ExportError": "qckpt.errors",
    "OutputPathError": "qckpt.errors",
    "OutputError": "qckpt.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # an AttributeError also lets ``from qckpt import cli`` fall back to the submodule
        raise AttributeError(f"module 'qckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return list(__all__)
