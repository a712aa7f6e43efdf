"""Exceptions that the CLI maps to a one-line message and an exit code.

Library code raises these for *expected* failures (bad input, a checkpoint that does not
fit, a rank that lacks a value). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class QckptError(Exception):
    """An expected failure: one line on stderr, exit code 1."""

    exit_code = 1

    def __init__(self, message: object = "", *args: object) -> None:
        # the message is one line by contract, also when it quotes a library's own text
        # (an unpickler, a JSON parser) that wraps over several
        super().__init__(" ".join(str(message).split()), *args)


class UsageError(QckptError):
    """Bad usage: a wrong flag, a recipe that does not validate. Exit code 2."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe that does not parse or validate; the message names the YAML path."""


class SchemeError(UsageError):
    """A ``quant`` scheme that cannot be: one that splits projections a client fuses, a target
    that matches no module, a scheme the export layout cannot write. Exit code 2, before any
    work."""


class FormatError(QckptError):
    """A value a quantization format cannot represent (NaN/Inf input, a bad shape)."""


class CheckpointError(QckptError):
    """A checkpoint that cannot be read or does not fit the model."""


class SourceLayoutError(CheckpointError):
    """A quantized source whose tensors contradict its own layout (scales that do not fit
    their codes, codes without their scales): bad input, exit code 2, before any tensor is
    written."""

    exit_code = 2


class CalibrationError(QckptError):
    """Calibration failed: non-finite activations, incomplete MoE coverage, a failed sync."""


class SyncError(CalibrationError):
    """The amax sync failed; raised on every rank of the group at once."""


class PeerError(QckptError):
    """A collective failed: a peer rank died or did not answer within ``parallel.timeout_s``."""


class ExportError(QckptError):
    """An export that cannot be written (existing target, mismatched calibration)."""


class OutputPathError(UsageError):
    """An output path that would clobber an input or another output (refused before any work)."""


class OutputError(QckptError):
    """An output that cannot be written: the target exists or appeared, a full disk, a read-only
    directory. Nothing is left half-written."""


def unwrap_dcp(exc: BaseException) -> BaseException:
    """DCP wraps each rank's exception in a CheckpointException; the first real one."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return unwrap_dcp(inner)
    return exc
