"""``python tests/e2e/_paused_cli.py MARKER GO -- ARGS...``: the ``qckpt`` CLI, exactly as
``python -m qckpt ARGS...`` runs it, except that the export pauses mid-write.

Through the export's progress callback (no hook in qckpt itself): after the second source tensor
is written it creates MARKER, then waits until the file GO exists (``-``: forever, until a
signal). Tests use it to interrupt an export, or to line two exports up, at a known point.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> None:
    marker, go, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: _paused_cli.py MARKER GO -- ARGS..."
    import qckpt.export.writer as export

    real = export.write_export  # what the command calls with its progress, after planning

    def paused(plan, **kw):
        user = kw.get("progress")

        def progress(done: int, total: int, name: str) -> None:
            if user is not None:
                user(done, total, name)
            if done == 2:
                Path(marker).touch()
                deadline = time.monotonic() + 120
                while go == "-" or not Path(go).exists():
                    if time.monotonic() > deadline:
                        raise SystemExit("paused export: never released")
                    time.sleep(0.02)

        return real(plan, **{**kw, "progress": progress})

    export.write_export = paused
    from qckpt.cli.app import main as qckpt_main

    sys.argv = ["qckpt", *args]
    qckpt_main(args)


if __name__ == "__main__":
    main()
