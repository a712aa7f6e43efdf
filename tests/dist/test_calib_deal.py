"""Calibration batches dealt to pure-DP ranks as they come free (qckpt.calib.deal), 2 gloo ranks.

What a user would notice: a slower rank runs fewer batches instead of holding the others at the
amax sync, every batch still runs exactly once, and the calibration file is the one a single
process writes, bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.dist.harness import calibrate_tiny_moe, shared_world

pytestmark = pytest.mark.timeout(240)
DATA = {"source": "synthetic", "num_samples": 16, "seq_len": 16, "batch_size": 2}


def sc_deal(rank, world, n, rounds):
    import torch.distributed as dist

    from qckpt.calib.deal import DealtBatches
    from qckpt.parallel.mesh import init_mesh

    mesh = init_mesh(timeout_s=10, device="cpu")
    out = []
    for _ in range(rounds):  # each dealing counts from zero again
        dealer = DealtBatches([torch.tensor([i]) for i in range(n)], mesh.dp_group)
        got = []
        for b in dealer:
            got.append(int(b))
            time.sleep(0.05 if rank == 1 else 0.005)  # rank 1 is 10x slower
        everyone = [None] * world
        dist.all_gather_object(everyone, got, group=mesh.dp_group)
        out.append({"mine": got, "taken": dealer.taken, "all": everyone, "pos": dealer.position})
    return out


def test_each_batch_runs_once_and_the_faster_rank_runs_more():
    out = shared_world(2).run(sc_deal, 40, 2, deadline_s=120)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    for rnd in range(2):
        rows = [o.value[rnd] for o in out]
        assert rows[0]["all"] == rows[1]["all"] == [rows[0]["mine"], rows[1]["mine"]]
        assert all(r["taken"] == r["mine"] for r in rows)
        # each index exactly once over the ranks, each rank's in increasing order
        assert sorted(rows[0]["mine"] + rows[1]["mine"]) == list(range(40))
        assert all(r["mine"] == sorted(r["mine"]) for r in rows)
        # both start together (the counter's broadcast) and rank 1 takes 10x longer a batch
        assert len(rows[0]["mine"]) > 2 * len(rows[1]["mine"]) > 0
        assert all(r["pos"] == 40 for r in rows)


def _slow_hooks(rank):
    from contextlib import contextmanager

    from qckpt.pipeline.hooks import Hooks

    @contextmanager
    def progress(description, total):
        def advance(*args):
            if rank == 1 and description == "calibrating":
                time.sleep(0.3)  # rank 1 is slower after each batch

        yield advance

    return Hooks(progress=progress)


def sc_calibrate(rank, world, path, out):
    res = calibrate_tiny_moe(world, path, out, DATA, hooks=_slow_hooks(rank))
    rep = res.report
    return {"amax": res.state.amax, "batches": rep["batches"], "tokens": rep["tokens_this_rank"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("deal")
    build_model("tiny-moe", dtype="bfloat16", seed=0).save_pretrained(root / "hf")
    return root / "hf"


def test_a_slow_rank_runs_fewer_batches_and_the_file_is_one_process_s(ckpt, tmp_path):
    one = sc_calibrate(0, 1, ckpt, tmp_path / "one.safetensors")
    assert one["batches"] == 8
    out = shared_world(2).run(sc_calibrate, ckpt, tmp_path / "dp2.safetensors", deadline_s=120)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    ran = [o.value["batches"] for o in out]
    assert sum(ran) == 8 and ran[0] > ran[1], ran
    assert [o.value["tokens"] for o in out] == [n * 2 * 16 for n in ran]
    for o in out:
        amax = o.value["amax"]
        assert sorted(amax) == sorted(one["amax"])
        diff = [k for k in amax if not torch.equal(amax[k], one["amax"][k])]
        assert not diff, diff[:5]


def sc_first_rank_dies(rank, world):
    """Rank 0, which holds the store (as under torchrun and qckpt's launcher: a TCPStore in the
    first rank), dies after its first batch; rank 1 is still taking batches."""
    import datetime
    import os

    import torch.distributed as dist

    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.deal import DealtBatches
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import init_mesh
    from qckpt.recipe import DataConfig, QuantConfig

    c10d = dist.distributed_c10d
    t = datetime.timedelta(seconds=10)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=t, wait_for_workers=False)
        c10d._get_default_store().set("deal-port", str(store.port))
    else:
        port = int(c10d._get_default_store().get("deal-port"))
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=t)
    c10d._get_default_store = lambda: store
    mesh = init_mesh(timeout_s=10, device="cpu")
    model = build_model("tiny-moe", dtype="float32", seed=0)
    batches = calibration_batches(DataConfig(**DATA), vocab_size=256)
    dealt = DealtBatches(batches, mesh.dp_group)

    def progress(*_):
        if rank == 0:
            os._exit(3)  # no message, no goodbye
        time.sleep(0.5)

    calibrate_model(model, dealt, QuantConfig(), mesh, progress=progress)


def test_the_store_rank_dying_while_dealing_is_one_error_not_a_hang():
    from tests.dist.harness import run_once

    t0 = time.monotonic()
    out = run_once(sc_first_rank_dies, 2, deadline_s=60)
    assert out[0].error_type == "Died"
    assert not out[1].ok and out[1].error_type == "PeerError", out[1].error
    assert out[1].error.startswith("PeerError: taking the next batch failed: a rank died")
    assert "\n" not in out[1].error and time.monotonic() - t0 < 60


def sc_late_rank(rank, world, granularity):
    """Rank 1 comes to its batches after rank 0 has taken all the others (its read or warm-up
    ran long): it still runs its own first one, so it holds every static input amax too."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.deal import DealtBatches
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import init_mesh
    from qckpt.recipe import DataConfig, QuantConfig, TensorQuantConfig

    mesh = init_mesh(timeout_s=10, device="cpu")
    model = build_model("tiny-moe", dtype="float32", seed=0)
    dealt = DealtBatches(calibration_batches(DataConfig(**DATA), vocab_size=256), mesh.dp_group)
    if rank == 1:
        while dealt._store.add(dealt._key, 0) < len(dealt) - 2:  # rank 0 took all it could
            time.sleep(0.05)
    quant = QuantConfig(inputs=TensorQuantConfig(granularity=granularity, block_size=[16]))
    state, report = calibrate_model(model, dealt, quant, mesh)
    return {"amax": state.amax, "batches": report["batches"]}


@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_a_late_rank_still_runs_a_batch_and_the_sync_completes(granularity):
    out = shared_world(2).run(sc_late_rank, granularity, deadline_s=120)
    assert all(o.ok for o in out), [o.error for o in out if not o.ok]
    assert [o.value["batches"] for o in out] == [7, 1]
    a, b = (o.value["amax"] for o in out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
