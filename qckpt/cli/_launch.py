"""``--nproc-per-node N``: relaunch the same command under ``torch.distributed.run``."""

from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _strip_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    return out


def relaunch(nproc: int) -> int | None:
    """Run this very command under torchrun with ``nproc`` ranks; None when nothing to do."""
    if nproc <= 1 or under_torchrun():
        return None
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "qckpt",
        *_strip_nproc(sys.argv[1:]),
    ]
    return subprocess.call(cmd)
