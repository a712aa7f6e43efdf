"""Run ``qckpt`` in this process (``main(argv)``), capturing what it prints: the CLI tests that
need many commands on one tiny model pay torch's import once, not once per command."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_main(*argv: str, cwd: Path | None = None) -> Ran:
    from qckpt.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_argv = os.getcwd(), sys.argv
    # a relaunch (--nproc-per-node) re-runs sys.argv[1:] as the ranks' command line
    sys.argv = ["qckpt", *argv]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(argv))
                rc = 0
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv
    return Ran(rc, out.getvalue(), err.getvalue())
