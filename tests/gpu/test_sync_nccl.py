"""The amax sync over NCCL with 2 processes on 2 GPUs (skipped without them).

    python -m pytest -q -s tests/gpu/test_sync_nccl.py
    python tests/gpu/test_sync_nccl.py          # the same, where pytest is not installed

Checks on real NCCL what the gloo tests check on CPU, plus what only NCCL can show: the reduce
buffers live on CUDA (an NCCL all-reduce of a CPU tensor fails), the amaxes stay on each rank's
GPU, and the "some ranks lack it" case raises on both ranks instead of hanging. Prints the time
of one sync of 10,000 quantizers against one-or-two collectives per quantizer.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None
if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.dist.harness import run_once  # noqa: E402

pytestmark = (
    []
    if pytest is None
    else [
        pytest.mark.timeout(300),
        pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.device_count() < 2,
            reason="needs 2 CUDA devices",
        ),
    ]
)


def _scenario(rank, world, device_type="cuda"):
    import qckpt.calib.sync as sync_mod
    from qckpt.calib.quantizer import AmaxStore, TensorQuantizer
    from qckpt.calib.sync import COLLECTIVES_PER_SYNC, sync_amax

    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    sync_cuda = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    g = dist.group.WORLD
    out = {}

    def q(name, gran="tensor", kind="input", **kw):
        shape = (4, 8) if kind == "weight" else (8,)
        return TensorQuantizer(name, kind, shape=shape, granularity=gran, device=dev, **kw)

    # group max, zero vs None, dtype adoption, buffers on CUDA, 3 collectives
    seen = []
    real = dist.all_reduce

    def spy(t, *a, **kw):
        seen.append(str(t.device))
        return real(t, *a, **kw)

    t, z, u = q("t"), q("z"), q("u", calib_dtype=torch.bfloat16)
    c = q("c", "channel", kind="weight")
    t.collect(torch.full((2, 8), float(rank + 1), device=dev))
    if rank == 0:
        z.collect(torch.zeros(2, 8, device=dev))
        u.collect(torch.full((2, 8), 3.0, device=dev, dtype=torch.bfloat16))
    c.collect(torch.arange(32, device=dev, dtype=torch.float32).view(4, 8) * (rank + 1))
    sync_mod.dist.all_reduce = spy
    try:
        r = sync_amax([t, z, u, c], g)
    finally:
        sync_mod.dist.all_reduce = real
    out["basic"] = {
        "t": t.amax.item(),
        "t_dev": str(t.amax.device),
        "z": z.amax.item(),
        "u": (u.amax.item(), str(u.amax.dtype)),
        "c": c.amax.tolist(),
        "collectives": r.collectives,
        "wire_devices": sorted(set(seen)),
        "expected_collectives": COLLECTIVES_PER_SYNC,
    }

    # uneven per-channel: both ranks raise at once
    c2 = q("model.layers.0.mlp.down_proj", "channel", kind="weight")
    if rank == 1:
        c2.collect(torch.ones(4, 8, device=dev))
    t0 = time.monotonic()
    try:
        sync_amax([c2], g)
        out["uneven"] = None
    except Exception as exc:
        out["uneven"] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)

    # EP opt-in sharing
    layer = "model.layers.0.mlp.experts"
    ex = [
        q(f"{layer}.{e}.gate_proj", share_group=f"{layer}:in", expert_layer=layer, expert=e)
        for e in range(4)
    ]
    ex[rank].collect(torch.full((1, 8), 2.0 + rank, device=dev))
    sync_amax(ex, g)
    out["ep"] = ([x.amax.item() for x in ex], [x.shared_from_layer for x in ex])

    # timing: 10,000 per-tensor quantizers, ~3/4 calibrated per rank
    n = 10_000
    store = AmaxStore(capacity=n)
    qs = [q(f"model.layers.{i // 64}.mlp.experts.{i % 64}.up_proj", store=store) for i in range(n)]
    init = [torch.rand((), device=dev) if (i + rank) % 4 else None for i in range(n)]

    def restore():
        for x, a in zip(qs, init, strict=True):
            x.amax = a

    times = []
    for _ in range(10):
        restore()
        sync_cuda()
        dist.barrier()
        t0 = time.perf_counter()
        sync_amax(qs, g)
        sync_cuda()
        times.append(time.perf_counter() - t0)
    restore()
    sync_cuda()
    dist.barrier()
    t0 = time.perf_counter()
    for x in qs[:1000]:  # the naive protocol, on 1,000 quantizers (scaled up below)
        flag = torch.ones(1, device=dev) if x.amax is not None else torch.zeros(1, device=dev)
        dist.all_reduce(flag)
        if flag.item():
            v = x.amax.reshape(1).float() if x.amax is not None else torch.zeros(1, device=dev)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
    sync_cuda()
    naive_10k = (time.perf_counter() - t0) * 10
    times.sort()
    out["timing"] = {"ours_median_s": times[len(times) // 2], "naive_10k_s": naive_10k}
    return out


def test_sync_over_nccl_two_gpus():
    out = run_once(_scenario, 2, timeout_s=30.0, deadline_s=240.0, backend="nccl")
    for o in out:
        assert o.ok, o.traceback
    for o in out:
        v = o.value
        b = v["basic"]
        assert b["t"] == 2.0 and b["t_dev"] == f"cuda:{o.rank}"
        assert b["z"] == 0.0
        assert b["u"] == (3.0, "torch.bfloat16")  # rank 1 never calibrated it: adopts bf16
        assert b["c"] == (torch.arange(32.0).view(4, 8) * 2).amax(dim=1).tolist()
        assert b["collectives"] == b["expected_collectives"]
        assert b["wire_devices"] == [f"cuda:{o.rank}"]
        err, secs = v["uneven"]
        assert err.startswith("SyncError") and "1 of 2 ranks lacked it" in err and secs < 5
        assert v["ep"] == ([2.0, 3.0, 3.0, 3.0], [False, False, True, True])
    t = out[0].value["timing"]
    print(
        f"\nNCCL amax sync of 10,000 quantizers: ours {t['ours_median_s'] * 1e3:.3f} ms, "
        f"naive (2 collectives/quantizer, extrapolated from 1,000) {t['naive_10k_s'] * 1e3:.1f} ms, "
        f"ratio {t['naive_10k_s'] / t['ours_median_s']:.0f}x"
    )


if __name__ == "__main__":
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        sys.exit("needs 2 CUDA devices")
    test_sync_over_nccl_two_gpus()
    print("PASSED")
