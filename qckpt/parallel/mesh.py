"""The DP x EP x TP mesh built from the torchrun environment.

Rank layout (tp fastest, then ep, then dp): ``rank = (dp_rank * ep + ep_rank) * tp + tp_rank``.
A plain ``qckpt ...`` without torchrun is a world of one with no process groups at all, so the
same code runs on one process or many (every collective helper is a no-op on a ``None`` group).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qckpt.errors import UsageError
from qckpt.parallel.deadline import Deadline, register, unregister
from qckpt.recipe import ParallelConfig


@dataclass(kw_only=True)
class Mesh:
    world_size: int = 1
    rank: int = 0
    dp: int = 1
    ep: int = 1
    tp: int = 1
    dp_rank: int = 0
    ep_rank: int = 0
    tp_rank: int = 0
    backend: str = "none"
    device: torch.device = torch.device("cpu")
    timeout_s: float = 600.0
    world_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    # dp x ep: the ranks that see different calibration data (tp ranks see the same batch)
    data_group: dist.ProcessGroup | None = None
    # shared by every group above: once one collective failed, the others fail at once
    deadline: Deadline | None = None

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        return [
            g
            for g in (
                self.world_group,
                self.dp_group,
                self.ep_group,
                self.tp_group,
                self.data_group,
            )
            if g is not None
        ]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        return self.dp * self.ep

    @property
    def data_rank(self) -> int:
        return self.dp_rank * self.ep + self.ep_rank


def pick_device(
    device: str = "auto", key: str = "load.device", share: bool = False
) -> torch.device:
    """``device`` (auto | cpu | cuda) as this rank's device; ``key`` names the recipe field in
    the error when CUDA is asked for and missing. More ranks than GPUs: with ``share`` rank r
    uses GPU r mod count, else a one-line error (NCCL allows no two ranks on one GPU)."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{key}: cuda asked for but no CUDA device is available")
    if device in ("cuda", "auto") and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if local >= count and not share:
            raise UsageError(
                f"{key}: local rank {local} has no GPU of its own ({count} visible); "
                "start at most one rank per GPU"
            )
        local %= count
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def parse_cpulist(text: str) -> set[int]:
    """Linux's cpulist format (``0-15,32-47``) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_near_gpu(dev: torch.device) -> set[int] | None:
    """Keep this process on the CPUs of ``dev``'s own NUMA node (``local_cpulist`` of its PCI
    device), where the kernel would otherwise move it anywhere; the CPUs set, or None when
    there is nothing to do (not CUDA, no such file, ``QCKPT_NO_CPU_BIND`` set, or the node's
    CPUs not among those allowed). A calibration forward launches kernels from Python: on an
    H200 pair one DP rank ran its batches 13% slower than the other with the same tokens."""
    if dev.type != "cuda" or os.environ.get("QCKPT_NO_CPU_BIND"):
        return None
    try:
        p = torch.cuda.get_device_properties(dev)
        addr = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{addr}/local_cpulist") as f:
            near = parse_cpulist(f.read()) & os.sched_getaffinity(0)
        if not near:
            return None
        os.sched_setaffinity(0, near)
        return near
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def _groups(world: int, sizes: tuple[int, int, int], timeout: datetime.timedelta, backend: str):
    """Create every dp/ep/tp/data group on every rank (new_group is collective) and keep ours.

    A family whose groups hold one rank gets none (None: its collectives are no-ops), and one
    whose group is the whole world uses the world's own group: under NCCL every new group is
    one more communicator split from the world's (on every rank, members or not) and one more
    to tear down at the end; pure DP on 2 GPUs made six, none of them needed. A family whose
    groups are an earlier family's ranks shares them."""
    dp, ep, tp = sizes
    rank = dist.get_rank()
    coords = [((r // tp) // ep, (r // tp) % ep, r % tp) for r in range(world)]
    mine = coords[rank]
    out: dict[str, dist.ProcessGroup | None] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name, keep in (
        ("dp", (1, 2)),  # same ep, tp
        ("ep", (0, 2)),
        ("tp", (0, 1)),
        ("data", (2,)),  # same tp: dp x ep
    ):
        seen = {}
        for r, c in enumerate(coords):
            seen.setdefault(tuple(c[i] for i in keep), []).append(r)
        # every group of a family has the same size, known alike on every rank
        size = len(next(iter(seen.values())))
        if size == 1 or size == world:
            out[name] = None if size == 1 else dist.group.WORLD
            continue
        for key, ranks in sorted(seen.items()):
            # the same ranks as an earlier family's group (data = dp under TP, = ep without
            # DP): that group again
            g = made.get(tuple(ranks))
            if g is None:
                g = made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout, backend=backend)
            if key == tuple(mine[i] for i in keep):
                out[name] = g
    return out


def init_mesh(*, ep: int = 1, tp: int = 1, timeout_s: float = 600.0, device: str = "auto") -> Mesh:
    """Join the torchrun world (if any) and build the mesh; a world of one needs no groups."""
    world = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    ParallelConfig(ep=ep, tp=tp).check_world(world)  # the recipe's own check and message
    dev = pick_device(device)
    if world == 1 and not dist.is_initialized():
        return Mesh(device=dev, timeout_s=timeout_s)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    bind_near_gpu(dev)  # several GPUs: each rank on its own GPU's NUMA node
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # NCCL: bind the communicator to this rank's GPU up front (no guessing on first use)
        kw = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timeout, **kw)
    rank = dist.get_rank()
    world = dist.get_world_size()
    dp = world // (ep * tp)
    g = _groups(world, (dp, ep, tp), timeout, backend)
    mesh = Mesh(
        world_size=world,
        rank=rank,
        dp=dp,
        ep=ep,
        tp=tp,
        dp_rank=(rank // tp) // ep,
        ep_rank=(rank // tp) % ep,
        tp_rank=rank % tp,
        backend=backend,
        device=dev,
        timeout_s=timeout_s,
        world_group=dist.group.WORLD,
        dp_group=g["dp"],
        ep_group=g["ep"],
        tp_group=g["tp"],
        data_group=g["data"],
        deadline=Deadline(timeout_s),
    )
    register(mesh.groups, mesh.deadline)
    return mesh


def shutdown(mesh: Mesh) -> None:
    unregister(mesh.groups)
    if mesh.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a reduce buffer must live for this group's backend: CUDA under NCCL, CPU otherwise."""
    if group is None:
        return torch.device("cpu")
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
