"""Files of a checkpoint dir opened safely, and small JSON files in and out.

A file of a checkpoint dir is opened only when it is a regular file (``open_regular``): a FIFO
named ``model.safetensors`` would otherwise block ``open`` forever. ``read_json`` reads a JSON
object so; ``write_json`` / ``write_text`` write one, flushed to disk (the caller fsyncs the
directory). Every failure is a one-line :class:`CheckpointError` naming the file.

Torch-free.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from qckpt.errors import CheckpointError

MAX_JSON_BYTES = 256 * 2**20  # an index of a very large model is a few MB


def open_regular(path: str | os.PathLike) -> IO[bytes]:
    """Open ``path`` for reading only if it is a regular file (never blocks on a FIFO).

    ``O_NONBLOCK`` makes the open of a FIFO or a device return at once; ``fstat`` on the open
    descriptor then says what it is, with no window between the check and the open.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"{p}: is a directory, not a file") from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot open ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{p}: not a regular file ({_kind(mode)}); refusing to read it")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def is_regular(path: str | os.PathLike) -> bool:
    """True for a regular file (following symlinks); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def require_regular(path: str | os.PathLike) -> int:
    """The size of ``path``, or a CheckpointError when it is missing or not a regular file."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CheckpointError(f"{p}: no such file") from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{p}: not a regular file ({_kind(st.st_mode)}); refusing to read it")
    return st.st_size


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> dict[str, Any]:
    """A JSON object from a regular file; one-line CheckpointError for anything else."""
    p = Path(path)
    with open_regular(p) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{p}: {what} larger than {MAX_JSON_BYTES} bytes; refusing it")
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise CheckpointError(f"{p}: corrupt {what} (not UTF-8 text)") from None
    except ValueError as exc:
        msg = getattr(exc, "msg", "not JSON")
        where = f" at line {exc.lineno} column {exc.colno}" if hasattr(exc, "lineno") else ""
        raise CheckpointError(f"{p}: corrupt {what} ({msg}{where})") from None
    except RecursionError:
        raise CheckpointError(f"{p}: corrupt {what} (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p}: {what} is a JSON {json_type(obj)}, not an object")
    return obj


def json_type(obj: object) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(obj), "number"
    )


def write_json(path: Path, obj: Any) -> None:
    """A JSON file, flushed to disk (the caller fsyncs the directory)."""
    write_text(path, json.dumps(obj, indent=2) + "\n")


def write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
