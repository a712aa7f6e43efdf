"""One place that turns exceptions into a message and an exit code.

Expected failures (``QckptError``) print one line and exit 1 (2 for bad usage); anything else
is a bug and also prints one line, pointing at ``QCKPT_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer

try:  # recent Typer vendors its own copy of Click
    from typer._click import exceptions as _click_exc
except ImportError:  # pragma: no cover - older Typer uses Click itself
    from click import exceptions as _click_exc

from qckpt.cli.launch import rank_error
from qckpt.errors import QckptError, UsageError, unwrap_dcp


class CommandInterrupted(Exception):
    """Ctrl-C or SIGTERM inside a command, carried past Typer: Typer turns a KeyboardInterrupt
    into a silent ``Exit(130)``, so a command's KeyboardInterrupt travels as this instead."""


def interruptible(fn: Callable) -> Callable:
    """Wrap a command so that its KeyboardInterrupt reaches :func:`report` (see above)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise CommandInterrupted(str(exc)) from exc

    return wrapper


def debug() -> bool:
    return os.environ.get("QCKPT_DEBUG", "") not in ("", "0")


def _prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"qckpt: error (rank {os.environ.get('RANK', '0')}): " if world > 1 else "qckpt: error: "


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def _say(line: str, code: int) -> int:
    """Print the one line; under ``--nproc-per-node`` a rank files it for the parent instead,
    which prints only the first failing rank's (see :mod:`qckpt.cli.launch`)."""
    if not rank_error(line, code) or debug():
        print(line, file=sys.stderr)
    return code


def report(exc: BaseException) -> int:
    """Print the exception the way a user should see it; return the exit code."""
    if debug():
        traceback.print_exception(exc, file=sys.stderr)
    exc = unwrap_dcp(exc)
    if isinstance(exc, QckptError):
        return _say(_prefix() + _one_line(str(exc)), exc.exit_code)
    if isinstance(exc, typer.Exit):
        return exc.exit_code
    if isinstance(exc, typer.Abort | KeyboardInterrupt | CommandInterrupted):
        return _say("qckpt: interrupted", 130)
    if type(exc).__name__ == "NoArgsIsHelpError":  # help was already printed
        return 2
    if isinstance(exc, _click_exc.ClickException):
        # Click's usage errors name the bad option; keep its text but on one line.
        code = 2 if isinstance(exc, _click_exc.UsageError) else exc.exit_code
        return _say(_prefix() + _one_line(exc.format_message()), code)
    if isinstance(exc, FileNotFoundError):
        return _say(_prefix() + _one_line(f"{exc.filename}: no such file or directory"), 1)
    hint = "" if debug() else " (QCKPT_DEBUG=1 shows the traceback)"
    return _say(_prefix() + _one_line(f"{type(exc).__name__}: {exc}") + hint, 1)


__all__ = ["UsageError", "report", "debug"]
