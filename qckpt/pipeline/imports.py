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
import os
import threading
from typing import Any

from qckpt import phases

# the CLI's switch for ``cuda_first_use`` (experimental: off unless set to 1)
CUDA_WARMUP_ENV = "QCKPT_CUDA_WARMUP"


def warm_imports(source: str | None, *modules: str, cuda_first_use: bool = False) -> None:
    """Import the transformers modeling code of ``source``'s architecture (a built-in name or a
    model dir), then ``modules`` (dotted names). A source that cannot be read is left to the
    command, which reports it where it always has.

    ``cuda_first_use``: meanwhile, make this rank's first CUDA tensor on a thread (CUDA's
    context, 0.3-0.9 s on an H200, is created with the GIL released, so it overlaps the imports);
    joined before returning, and this thread's device then set to that rank's GPU, before any
    phase boundary synchronizes one. Any failure there is left to the world's set-up, which
    reports it as it always has."""
    first_use = _start_first_use() if cuda_first_use else None
    try:
        if source is not None:
            with phases.startup_part(phases.MODEL_CODE):
                _model_code(source)
        with phases.startup_part(phases.QCKPT_MODULES):
            for name in modules:
                importlib.import_module(name)
    finally:
        if first_use is not None:
            _finish_first_use(*first_use)


def _start_first_use() -> tuple[threading.Thread, int]:
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))

    def first_use() -> None:
        try:
            # no CUDA here, or no such GPU: the world's set-up decides and words the error
            if torch.cuda.is_available() and local < torch.cuda.device_count():
                # not set_device: it would create the context holding the GIL; a tensor's
                # allocation creates it inside the op, where torch has released the GIL
                torch.empty(1, device=torch.device("cuda", local))
        except Exception:  # noqa: BLE001 - the world's set-up meets it again and reports it
            pass

    t = threading.Thread(target=first_use, name="qckpt-cuda-first-use", daemon=True)
    t.start()
    return t, local


def _finish_first_use(t: threading.Thread, local: int) -> None:
    import torch

    t.join()
    try:
        if torch.cuda.is_initialized():
            # this (main) thread's current device, before a phase boundary synchronizes it: the
            # default, GPU 0, would get a context of every rank
            torch.cuda.set_device(local)
    except Exception:  # noqa: BLE001 - the world's pick_device raises the worded error
        pass


def cuda_warmup_wanted(device: str, env: dict[str, Any]) -> bool:
    """The CLI's reading of ``QCKPT_CUDA_WARMUP`` for a command whose device is ``device``."""
    return device != "cpu" and env.get(CUDA_WARMUP_ENV, "") == "1"


def _model_code(source: str) -> None:
    try:
        from transformers import AutoModelForCausalLM

        from qckpt.models.build import load_config

        # looking the config class up imports its architecture's modeling module
        AutoModelForCausalLM._model_mapping[type(load_config(source))]
    except Exception:  # noqa: BLE001 - a warm-up only: the build raises the real error
        pass
