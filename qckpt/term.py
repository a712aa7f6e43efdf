"""The terminal the library writes to: one stderr console (logs, progress, report tables), one
stdout console (results), and torch's logger levels. Below the CLI, so that ``report`` and
``verify`` can use them without importing it."""

from __future__ import annotations

import os

from rich.console import Console

err = Console(stderr=True, highlight=False)
out = Console(highlight=False, soft_wrap=True)


def quiet_torch_logs() -> None:
    """torch configures its loggers when imported, so their levels can only be set after it."""
    if os.environ.get("QCKPT_DEBUG"):
        return
    import logging

    import torch  # noqa: F401

    for name in ("torch.utils._pytree", "torch.distributed", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
