"""``--nproc-per-node N`` against the GPUs this machine has, checked before any rank starts.

The count is read without torch (importing it costs the launcher seconds): the NVIDIA device
nodes a container is given (``/dev/nvidiaN``), narrowed by ``CUDA_VISIBLE_DEVICES``. A command
that runs one rank per GPU (load, calibrate: NCCL allows no two ranks on one GPU) refuses more
ranks than GPUs in one line; export, whose ranks only quantize on their GPU, lets them share.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from qckpt.errors import UsageError

_NODE = re.compile(r"nvidia(\d+)$")


def visible_gpus(env: dict[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """How many CUDA devices a process started here would see."""
    env = os.environ if env is None else env
    try:
        physical = sum(1 for p in dev.iterdir() if _NODE.match(p.name))
    except OSError:
        physical = 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return physical
    ids = []
    for part in listed.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break  # CUDA stops at the first invalid entry
        ids.append(part)
    return min(len(ids), physical)


@dataclass(frozen=True)
class GpuUse:
    """How a command uses the GPUs: the recipe key that picks its device, and whether several
    of its ranks may share one GPU."""

    key: str
    device: str
    share: bool = False


def check_gpus(use: GpuUse | None, nproc: int, gpus: int) -> str | None:
    """None when ``nproc`` ranks fit; a note to print when they share GPUs; raises when they
    cannot run at all."""
    if use is None or use.device == "cpu":
        return None
    if gpus == 0 or nproc <= gpus:
        # no GPU: auto runs on the CPU, and a rank asked for cuda words that error itself
        return None
    if use.share:
        return f"note: {nproc} ranks share {gpus} GPU(s) (rank r quantizes on GPU r mod {gpus})"
    raise UsageError(
        f"--nproc-per-node {nproc}: only {gpus} GPU(s) visible here and each rank needs its "
        f"own; use --nproc-per-node {gpus} or less, or --set {use.key}=cpu"
    )
