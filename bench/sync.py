"""Amax sync: our bucketed protocol vs one-or-two collectives per quantizer, side by side.

    torchrun --nproc-per-node 2 -m bench.sync                      # NCCL if CUDA, else gloo
    torchrun --nproc-per-node 2 -m bench.sync --backend gloo --n 2000 --json sync.json

Each rank holds ``--n`` per-tensor quantizers (plus ``--channel`` per-channel ones). To look like
DP calibration of a MoE, every rank has calibrated a different ~3/4 of them; the rest it never saw.
Both protocols get the same quantizers, restored to that state before every repetition (outside
the timed region), and must produce the same amaxes (checked). Reported: median wall time per
sync over the repetitions, collectives per sync, and the ratio naive / ours.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from qckpt.calib.quantizer import AmaxStore, TensorQuantizer
from qckpt.calib.sync import sync_amax


def naive_sync(quantizers, group, device) -> int:
    """The per-quantizer protocol: a presence all-reduce, then a MAX all-reduce if anyone has it.

    This is the shape of the usual fix for the hang (agree on presence, then reduce) done one
    quantizer at a time; it is correct, just slow. Returns the number of collectives.
    """
    n = 0
    for q in quantizers:
        if not q.enabled:
            continue
        flag = torch.ones(1, device=device) if q.amax is not None else torch.zeros(1, device=device)
        dist.all_reduce(flag, group=group)
        n += 1
        if flag.item() == 0:
            continue
        val = (
            q.amax.reshape(-1).float().to(device)
            if q.amax is not None
            else torch.zeros(max(1, q.amax_shape[0] if q.amax_shape else 1), device=device)
        )
        dist.all_reduce(val, op=dist.ReduceOp.MAX, group=group)
        n += 1
        q.amax = val.reshape(q.amax_shape).to(q.device)
    return n


def make_quantizers(n: int, channel: int, rank: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    store = AmaxStore(capacity=n)  # as insert_quantizers makes them: one store, a bank per device
    qs, init = [], []
    for i in range(n + channel):
        gran = "tensor" if i < n else "channel"
        q = TensorQuantizer(
            f"model.layers.{i // 48}.mlp.experts.{i % 48}.gate_proj",
            "input" if gran == "tensor" else "weight",
            shape=(64, 32),
            granularity=gran,
            device=device,
            store=store,
        )
        # per-channel amaxes must be on every rank or none; per-tensor ones on ~3/4 of the ranks
        if gran == "channel" or (i + rank) % 4 != 0:
            init.append(torch.rand(q.amax_shape, generator=g).to(device))
        else:
            init.append(None)
        qs.append(q)
    return qs, init


def restore(qs, init) -> None:
    for q, a in zip(qs, init, strict=True):
        q.amax = a


def timed(fn, reps: int, device) -> list[float]:
    out = []
    for _ in range(reps):
        fn(prep=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn(prep=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quantizers", "-n", type=int, default=10000, help="per-tensor quantizers per rank"
    )
    p.add_argument("--channel", type=int, default=0, help="per-channel quantizers in addition")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--reps", type=int, default=20, help="repetitions of our protocol")
    p.add_argument("--naive-reps", type=int, default=3, help="repetitions of the naive one")
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    a = p.parse_args(argv)

    backend = a.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    qs, init = make_quantizers(a.quantizers, a.channel, rank, device)

    def ours(prep: bool):
        if prep:
            restore(qs, init)
        else:
            sync_amax(qs, group, what="bench")

    def naive(prep: bool):
        if prep:
            restore(qs, init)
        else:
            naive_sync(qs, group, device)

    # warm-up (NCCL communicator setup, allocator) and correctness: both give the same amax
    restore(qs, init)
    res = sync_amax(qs, group, what="bench")
    ours_vals = [None if q.amax is None else q.amax.float().cpu() for q in qs]
    restore(qs, init)
    n_naive = naive_sync(qs, group, device)
    same = all(
        (x is None and q.amax is None) or (x is not None and torch.equal(x, q.amax.float().cpu()))
        for x, q in zip(ours_vals, qs, strict=True)
    )

    t_ours = timed(ours, a.reps, device)
    t_naive = timed(naive, a.naive_reps, device)
    m_ours, m_naive = statistics.median(t_ours), statistics.median(t_naive)
    out = {
        "backend": backend,
        "world_size": world,
        "device": str(device),
        "quantizers": a.quantizers + a.channel,
        "per_channel": a.channel,
        "ours_seconds_median": m_ours,
        "ours_seconds_min": min(t_ours),
        "ours_collectives": res.collectives,
        "ours_bytes": res.bytes,
        "naive_seconds_median": m_naive,
        "naive_collectives": n_naive,
        "ratio_naive_over_ours": m_naive / m_ours,
        "same_result": same,
        "torch": torch.__version__,
    }
    if rank == 0:
        print(
            f"amax sync of {out['quantizers']} quantizers over {world} ranks ({backend}, {device})\n"
            f"  ours : {m_ours * 1e3:9.3f} ms median  ({res.collectives} collectives, "
            f"{res.bytes} bytes)\n"
            f"  naive: {m_naive * 1e3:9.3f} ms median  ({n_naive} collectives)\n"
            f"  naive / ours = {out['ratio_naive_over_ours']:.1f}x   same result: {same}"
        )
        if a.json:
            a.json.write_text(json.dumps(out, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
