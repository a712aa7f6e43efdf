"""How a pipeline step speaks without knowing about a terminal: a log line and a progress bar.

The CLI passes its own (``qckpt.cli.output``); tests and ``bench/`` take the silent defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any


def _no_log(msg: str) -> None:
    pass


@contextmanager
def _no_progress(description: str, total: int | None) -> Iterator[Callable[..., None]]:
    yield lambda *a: None


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """``log(line)``: a step's detail; ``warn(line)``: something the user must see;
    ``progress(description, total)`` is a context manager yielding the callback a step advances
    (``(n=1)``, or ``(done, total, what)``)."""

    log: Callable[[str], None] = _no_log
    warn: Callable[[str], None] = _no_log
    progress: Callable[[str, int | None], AbstractContextManager[Callable[..., Any]]] = _no_progress


SILENT = Hooks()
