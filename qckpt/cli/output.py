"""Where things go: results on stdout, logs, progress and rich tables on stderr.

Under torchrun only rank 0 speaks, unless ``--verbose`` asks every rank for its own lines
(prefixed with the rank so interleaved output stays readable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qckpt import phases
from qckpt.pipeline.hooks import Hooks
from qckpt.term import err, out  # noqa: F401  (the consoles live below the CLI)

_verbose = False


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def set_verbose(v: bool) -> None:
    global _verbose
    _verbose = v


def verbose() -> bool:
    return _verbose


def summary(lines: list[str]) -> None:
    """The command's short summary on stderr, once (rank 0)."""
    if rank() == 0:
        for line in lines:
            err.print(line, markup=False, highlight=False, soft_wrap=True)


def speaks() -> bool:
    return rank() == 0 or _verbose


def log(msg: str) -> None:
    """A line that must be seen (a note, a warning) on stderr: rank 0, or every rank with a
    prefix under --verbose."""
    if rank() == 0 and not _verbose:
        err.print(msg)
    elif _verbose:
        err.print(f"[dim]\\[rank {rank()}][/dim] {msg}")


def result(msg: str) -> None:
    """The command's result on stdout, once (rank 0)."""
    if rank() == 0:
        out.print(msg, markup=False)


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    """The machine-readable report; written atomically, by rank 0 only."""
    if path is None or rank() != 0:
        return
    from qckpt.atomic import write_text

    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", key="--json")


@contextmanager
def progress(description: str, total: int | None) -> Iterator[Any]:
    """A progress bar on stderr with its rate and time left (rank 0, and only on a terminal:
    a log file or a pipe gets the summary, not a bar's redraws).

    Yields a callback that takes either ``(n=1)`` (advance by n) or ``(done, total, what)``
    (absolute position, for steps that know their total only once they start).
    """
    if rank() != 0 or not err.is_terminal:
        yield lambda *a: None
        return
    # imported here: a command that draws no bar (--help, check) does not pay for it
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total, rate="")

        def update(*args: Any) -> None:
            if len(args) >= 2:
                bar.update(task, completed=args[0], total=args[1])
            else:
                bar.advance(task, args[0] if args else 1)
            speed = bar.tasks[0].speed
            if speed:
                bar.update(task, rate=f"{speed:.1f}/s")

        yield update


def detail(msg: str) -> None:
    """A pipeline's step-by-step line: only under --verbose (the summary says what matters)."""
    if _verbose:
        log(msg)


def hooks() -> Hooks:
    """The pipeline's log lines (detail: --verbose) and progress bars, drawn here."""
    return Hooks(log=detail, warn=log, progress=progress)


def with_phases(
    data: dict[str, Any], mesh: Any = None, per_rank: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``data`` with the command's ``phases`` (seconds) and whole-command ``peaks`` so far.

    With a ``mesh`` of several ranks every rank must call it (one all-gather): ``ranks`` then
    lists each rank's phases and peaks, since ``phases``/``peaks`` are this rank's own, merged
    into ``data``'s own ``ranks`` rows where it has them. ``per_rank``: more of this rank's own
    figures for its row (gathered in the same all-gather).
    """
    own = phases.summary()
    if not own or mesh is None or mesh.world_size <= 1:
        return {**data, **own}
    import torch.distributed as dist

    from qckpt.parallel.deadline import collective

    box: list[Any] = [None] * mesh.world_size
    mine = {"rank": mesh.rank, **(per_rank or {}), **own}
    collective(
        "gathering the ranks' reports", dist.all_gather_object, box, mine, group=mesh.world_group
    )
    # a command's own per-rank rows (export: the files and bytes each rank wrote) keep their
    # keys beside the phases and peaks, matched by rank
    rows = {r.get("rank"): r for r in data.get("ranks") or [] if isinstance(r, dict)}
    return {**data, **own, "ranks": [{**rows.get(r["rank"], {}), **r} for r in box]}
