"""Where one amax sync spends its time on GPUs: torch.profiler over 20 syncs, rank 0's table.

torchrun --nproc-per-node 2 scripts/profile_sync.py
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from sync import make_quantizers, restore  # noqa: E402

from qckpt.calib.sync import sync_amax  # noqa: E402


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank = dist.get_rank()
    qs, init = make_quantizers(10000, 0, rank, dev)
    g = dist.group.WORLD
    for _ in range(5):
        restore(qs, init)
        sync_amax(qs, g)
    times = []
    for _ in range(20):
        restore(qs, init)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        sync_amax(qs, g)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    # profiled: repeated syncs of the already-synced state (restoring is 10k tiny ops: kept out)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(20):
            with torch.profiler.record_function("sync_amax"):
                sync_amax(qs, g)
            torch.cuda.synchronize()
    if rank == 0:
        print(f"median {times[10] * 1e3:.3f} ms, min {times[0] * 1e3:.3f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
