"""``python -m qckpt.cli._torchrun ARGS``: ``torch.distributed.run`` minus its own output.

``qckpt CMD --nproc-per-node N`` runs this. The ranks inherit the terminal's stdout and stderr
as usual (progress, reports and ``--verbose`` lines stream live, tty and all); what a user must
not see is torchrun's own chatter: the OMP_NUM_THREADS banner, the agent's log lines, and the
~40-line ``ChildFailedError`` traceback when a rank fails. So this process sends *its own*
Python-level ``sys.stderr`` to /dev/null (file descriptor 2, which the ranks inherit, is left
alone) and turns ``ChildFailedError`` into a small summary file that the parent reads.

Why not torchrun's ``--redirects``/``--tee``: they route every line of every rank through log
files and a tailer that prefixes and re-times them (progress bars and rich tables break, a
rank's output arrives late), and the traceback would still have to be filtered out of a stream
by matching its text, which changes between torch versions. Here each rank writes its one-line
error to its own file (:mod:`qckpt.cli.launch`), and nothing is parsed from a stream.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qckpt.cli.launch import LAUNCHER_FILE, RANK_ERRORS_ENV


def _summary(failures: dict[int, int]) -> None:
    d = os.environ.get(RANK_ERRORS_ENV)
    if d:
        (Path(d) / LAUNCHER_FILE).write_text(json.dumps({str(r): c for r, c in failures.items()}))


def main(argv: list[str]) -> int:
    if os.environ.get("QCKPT_DEBUG", "") in ("", "0"):
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of this process
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        failures = {int(r): int(f.exitcode) for r, f in exc.failures.items()}
        _summary({int(first): failures[int(first)], **failures})
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - the agent itself failed (a rendezvous, a signal)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
