"""Where one amax sync spends its time: torch.profiler over 20 syncs, rank 0's table.

torchrun --nproc-per-node 2 scripts/profile_sync.py                  # NCCL, one GPU per rank
torchrun --nproc-per-node 2 scripts/profile_sync.py --backend gloo   # CPU only

Besides the table it prints, per sync: the aten ops called from the sync itself (not the ops
they call) and, under NCCL, the CUDA runtime calls that make the host wait or copy.
"""

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from sync import make_quantizers, restore  # noqa: E402

from qckpt.calib.sync import sync_amax  # noqa: E402

REPS = 20
# CUDA runtime calls worth counting: each synchronize (and a plain cudaMemcpy) blocks the host
_RUNTIME = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
)


def _per_sync(prof) -> tuple[Counter, Counter]:
    """Top-level aten ops and CUDA runtime calls inside the ``sync_amax`` ranges."""
    events = list(prof.events())
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == "sync_amax"]

    def inside(e) -> bool:
        return any(a <= e.time_range.start and e.time_range.end <= b for a, b in ranges)

    ops, runtime = Counter(), Counter()
    for e in events:
        if not inside(e):
            continue
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            ops[e.name] += 1
        elif e.name in _RUNTIME:
            runtime[e.name] += 1
    return ops, runtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--quantizers", "-n", type=int, default=10000)
    a = p.parse_args()
    cuda = a.backend == "nccl"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    sync_dev = torch.cuda.synchronize if cuda else (lambda: None)
    rank = dist.get_rank()
    qs, init = make_quantizers(a.quantizers, 0, rank, dev)
    g = dist.group.WORLD
    for _ in range(5):
        restore(qs, init)
        sync_amax(qs, g)
    times = []
    for _ in range(REPS):
        restore(qs, init)
        sync_dev()
        dist.barrier()
        t = time.perf_counter()
        sync_amax(qs, g)
        sync_dev()
        times.append(time.perf_counter() - t)
    times.sort()
    # profiled: repeated syncs of the already-synced state (restoring is 10k tiny ops: kept out)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(REPS):
            with torch.profiler.record_function("sync_amax"):
                sync_amax(qs, g)
            sync_dev()
    if rank == 0:
        print(f"median {times[REPS // 2] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        ops, runtime = _per_sync(prof)
        print(f"aten ops per sync (top level): {sum(ops.values()) / REPS:g}")
        for name, k in ops.most_common():
            print(f"  {name}: {k / REPS:g}")
        if cuda:
            print("CUDA runtime calls per sync:")
            for name in _RUNTIME:
                print(f"  {name}: {runtime[name] / REPS:g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
