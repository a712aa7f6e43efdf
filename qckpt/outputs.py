"""Where a command may write: the output guard and the export marker.

Every command calls :func:`guard` with its outputs and its inputs before it does any work (and
before torch is imported, so a refusal is instant). An output is refused when, with ``~``
expanded and every symlink resolved, it

* is empty;
* equals, contains or lies inside an input of the same command (the recipe, the checkpoint,
  the model source dir, the calibration file, a data file, a path argument);
* is, or contains, the working directory, the home directory or the filesystem root;
* equals, contains or lies inside another output of the same command;
* is an existing directory where a file is to be written.

The refusal is one line naming the output (its recipe key or flag), the input it would clobber
and the input's key: ``export.output: runs (-> /w/runs) contains checkpoint.path /w/runs/dcp;
refusing to write over an input``.

The export marker: every export dir qckpt writes holds :data:`EXPORT_MARKER`;
``export.overwrite: true`` replaces only a dir that holds it (:func:`check_export_target`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from qckpt.atomic import resolve
from qckpt.errors import ExportError, OutputPathError

if TYPE_CHECKING:
    from qckpt.recipe import Recipe

EXPORT_MARKER = ".qckpt-export.json"

Named = tuple[str, "str | os.PathLike | None"]


def _shown(given: str | os.PathLike, real: Path) -> str:
    text = os.fspath(given)
    absolute = os.path.abspath(os.path.expanduser(text))
    return text if absolute == str(real) else f"{text} (-> {real})"


def _inside(a: Path, b: Path) -> bool:
    """``a`` lies strictly inside ``b``."""
    return a != b and a.is_relative_to(b)


def _relation(out: Path, other: Path) -> str | None:
    if out == other:
        return "is"
    if _inside(other, out):
        return "contains"
    if _inside(out, other):
        return "lies inside"
    return None


def _protected() -> list[tuple[str, Path]]:
    """Dirs no output may be or contain, whatever the command's inputs."""
    return [
        ("the working directory", resolve(os.getcwd())),
        ("the home directory", resolve("~")),
        ("the filesystem root", Path("/")),
    ]


def guard(
    outputs: Iterable[Named],
    inputs: Iterable[Named],
    *,
    file_outputs: Iterable[str] = (),
) -> dict[str, Path]:
    """Refuse an output that would clobber an input or another output (see the module doc).

    ``outputs`` / ``inputs``: ``(key, path)`` pairs, the key as the user wrote it (a recipe
    key, a flag, an argument name); a ``None`` path is skipped (not asked for). Keys in
    ``file_outputs`` name files: an existing directory there is refused. Returns each output's
    resolved path, which the writer should use (it is what was checked).
    """
    # every path an output must keep clear of, with the reason a clash gives: the inputs, then
    # (growing as we go) the outputs already checked
    avoid: list[tuple[str, str, Path, str]] = []
    for k, p in inputs:
        if p is not None and os.fspath(p).strip():
            real_in = resolve(p)
            avoid.append((k, _shown(p, real_in), real_in, "refusing to write over an input"))
    checked: list[tuple[str, str, Path]] = []
    file_keys = set(file_outputs)
    for key, given in outputs:
        if given is None:
            continue
        text = os.fspath(given)
        if not text.strip():
            raise OutputPathError(f"{key}: empty path; name the file or directory to write")
        real = resolve(text)
        shown = _shown(text, real)
        hits = [(real != d, what) for what, d in _protected() if real == d or _inside(d, real)]
        if hits:  # "is" before "contains": the most direct reason
            contains, what = min(hits)
            verb = "contains" if contains else "is"
            raise OutputPathError(f"{key}: {shown} {verb} {what}; refusing to write there")
        for other_key, other_shown, other_real, why in avoid:
            rel = _relation(real, other_real)
            if rel is not None:
                what = other_key if rel == "is" else f"{other_key} {other_shown}"
                raise OutputPathError(f"{key}: {shown} {rel} {what}; {why}")
        if key in file_keys and real.is_dir():
            raise OutputPathError(f"{key}: {shown} is a directory; name a file")
        checked.append((key, shown, real))
        avoid.append((key, shown, real, "each output needs its own path"))
    return {key: real for key, _, real in checked}


# --------------------------------------------------------------------------------------------
# the export marker


def is_marked_export(path: Path) -> bool:
    """``path`` is a dir that ``qckpt export`` wrote (it holds a readable marker)."""
    marker = path / EXPORT_MARKER
    if not (path.is_dir() and marker.is_file() and not marker.is_symlink()):
        return False
    try:
        return json.loads(marker.read_text()).get("written_by") == "qckpt export"
    except (OSError, ValueError, AttributeError):
        return False


def export_marker(**info: object) -> dict[str, object]:
    """The marker's content: who wrote the dir, and a few facts for a human reading it."""
    from qckpt import __version__

    return {"written_by": "qckpt export", "qckpt_version": __version__, **info}


def check_export_target(
    target: str | os.PathLike, overwrite: bool, key: str = "export.output"
) -> None:
    """Refuse an existing target unless ``overwrite`` and it is an export qckpt wrote."""
    t = resolve(target)
    if not os.path.lexists(t):
        return
    if not t.is_dir():
        raise ExportError(f"{key}: {t} exists and is not a directory; refusing to replace it")
    if not overwrite:
        raise ExportError(
            f"{key}: {t} already exists (set export.overwrite: true to replace an earlier export)"
        )
    if not is_marked_export(t):
        raise ExportError(
            f"{key}: {t} exists and was not written by qckpt export (no {EXPORT_MARKER}); "
            "export.overwrite only replaces qckpt exports, remove it yourself if it should go"
        )


# --------------------------------------------------------------------------------------------
# the commands' inputs


def recipe_inputs(
    recipe: Recipe, recipe_path: str | os.PathLike, *, checkpoint: bool = True
) -> list[Named]:
    """The inputs a recipe command reads: the recipe, the model dir and (unless ``convert``
    writes it) the checkpoint. ``model.source`` counts when it names something on disk (a
    built-in name does not)."""
    ins: list[Named] = [("RECIPE", recipe_path)]
    if checkpoint:
        ins.append(("checkpoint.path", recipe.checkpoint.path))
    src = recipe.model.source
    if src and os.path.lexists(os.path.expanduser(src)):
        ins.append(("model.source", src))
    return ins
