"""The terminal the library writes to: one stderr console (logs, progress, report tables), one
stdout console (results), and torch's logger levels. Below the CLI, so that ``report`` and
``verify`` can use them without importing it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

err = Console(stderr=True, highlight=False)
out = Console(highlight=False, soft_wrap=True)


def quiet_third_party() -> None:
    """Libraries we import log their own optional-dependency chatter at import time (torchao's
    ``Failed to load .../_C_mxfp8...so``, dynamo's and torch.distributed's warnings) and draw
    their own progress bars; a user of qckpt sees qckpt's lines only. ``QCKPT_DEBUG=1`` keeps
    everything. Before those imports: the environment they read and the loggers they use."""
    if os.environ.get("QCKPT_DEBUG"):
        return
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight loading
    os.environ.setdefault("TQDM_DISABLE", "1")  # compressed-tensors' (de)compressing bars
    for name in ("torchao", "torch", "compressed_tensors", "llmcompressor"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def third_party_stderr_muted() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a library call whose chatter has no switch (its own
    progress bars with ``disable=`` hard-wired); an exception still reaches the caller, which
    words it. ``QCKPT_DEBUG=1`` leaves stderr alone."""
    if os.environ.get("QCKPT_DEBUG"):
        yield
        return
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quiet_torch_logs() -> None:
    """torch configures its loggers when imported, so their levels can only be set after it."""
    if os.environ.get("QCKPT_DEBUG"):
        return
    import logging

    import torch  # noqa: F401

    for name in ("torch.utils._pytree", "torch.distributed", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)


def trace(msg: str) -> None:
    """A progress line for long passes run into a log file (no terminal, so no progress bar):
    written only when ``QCKPT_TRACE`` is set, after the wall-clock time."""
    if os.environ.get("QCKPT_TRACE"):
        import time

        err.print(f"[{time.strftime('%H:%M:%S')}] {msg}", markup=False, highlight=False)
