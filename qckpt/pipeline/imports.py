"""Imports a command will need, made in its start-up phase (``qckpt.phases``).

qckpt imports torch, transformers and its own heavy modules lazily, so that commands which need
none of them (``--help``, ``check``, ``inspect`` of an HF dir, a refused recipe) start in a
fraction of a second. A command that will need them pays for them once either way; importing
them up front only moves that time into ``startup``, where a user expects it, instead of
leaving it inside ``build`` or ``plan`` as if it were work.

The model's code is imported first, then the command's own modules, so that the start-up's
parts (``phases.MODEL_CODE``, ``phases.QCKPT_MODULES``) charge a module both need (DTensor,
sympy, dynamo: transformers' modeling code imports them) to the model, and what qckpt adds on
top of it to qckpt.
"""

from __future__ import annotations

import importlib

from qckpt import phases


def warm_imports(source: str | None, *modules: str) -> None:
    """Import the transformers modeling code of ``source``'s architecture (a built-in name or a
    model dir), then ``modules`` (dotted names). A source that cannot be read is left to the
    command, which reports it where it always has."""
    if source is not None:
        with phases.startup_part(phases.MODEL_CODE):
            _model_code(source)
    with phases.startup_part(phases.QCKPT_MODULES):
        for name in modules:
            importlib.import_module(name)


def _model_code(source: str) -> None:
    try:
        from transformers import AutoModelForCausalLM

        from qckpt.models.build import load_config

        # looking the config class up imports its architecture's modeling module
        AutoModelForCausalLM._model_mapping[type(load_config(source))]
    except Exception:  # noqa: BLE001 - a warm-up only: the build raises the real error
        pass
