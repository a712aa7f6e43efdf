"""A DP-replicated model read once over the DP group (qckpt.pipeline.dp_read), 2 gloo ranks.

What a user would notice: each rank reads about half of the checkpoint's bytes, and the model
every rank ends with, and so the calibration file, is the one a whole read gives, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import calibrate_tiny_moe, shared_world

pytestmark = pytest.mark.timeout(240)
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """tiny-moe (seed 0) as a DCP dir and as an HF safetensors dir."""
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("dp_read")
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    save_model_dcp(model, root / "dcp")
    model.save_pretrained(root / "hf")
    return {"dcp": root / "dcp", "safetensors": root / "hf"}


def sc_split_load(rank, world, path, fmt):
    """A model of other values (seed 1) loaded as shares + broadcast: every tensor the
    checkpoint's (seed 0's), on every rank."""
    from qckpt.load.loader import load_checkpoint
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline import dp_read

    mesh = init_mesh(timeout_s=10, device="cpu")
    model = build_model("tiny-moe", dtype="bfloat16", seed=1)
    assert dp_read.splittable(mesh, model, quantized=False)
    shares = dp_read.read_shares(model, mesh.dp)
    only = {n for names, _ in shares[mesh.dp_rank] for n in names}
    rep = load_checkpoint(model, path, format=fmt, mesh=mesh, only=only)
    moved = dp_read.broadcast_shares(shares, mesh.dp_group)
    ref = build_model("tiny-moe", dtype="bfloat16", seed=0).state_dict()
    got = model.state_dict()
    return {
        "differ": [k for k in ref if not torch.equal(ref[k], got[k])],
        "read": rep.bytes_read,
        "moved": moved,
        "total": sum(t.numel() * t.element_size() for t in ref.values()),
    }


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_each_rank_reads_a_share_and_ends_with_the_whole_model(ckpts, fmt):
    out = shared_world(2).run(sc_split_load, ckpts[fmt], fmt, deadline_s=120)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    for o in out:
        assert o.value["differ"] == [], o.value["differ"][:5]
    total = out[0].value["total"]
    reads = [o.value["read"] for o in out]
    # whole tensors dealt by bytes: neither rank reads everything, together they read it once
    assert all(0 < r < 0.7 * total for r in reads), (reads, total)
    assert out[0].value["moved"] == out[1].value["moved"] >= total - max(reads)


def sc_calibrate(rank, world, path, out):
    res = calibrate_tiny_moe(world, path, out, DATA)
    return {"amax": res.state.amax, "read": res.report["read"]}


def test_dp2_calibration_file_bit_identical_to_one_process(ckpts, tmp_path):
    one = sc_calibrate(0, 1, ckpts["safetensors"], tmp_path / "one.safetensors")
    assert one["read"]["split_over_dp"] is False
    out = shared_world(2).run(
        sc_calibrate, ckpts["safetensors"], tmp_path / "dp2.safetensors", deadline_s=120
    )
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    for o in out:
        amax = o.value["amax"]
        assert sorted(amax) == sorted(one["amax"])
        diff = [k for k in amax if not torch.equal(amax[k], one["amax"][k])]
        assert not diff, diff[:5]
        assert o.value["read"]["split_over_dp"] is True
    assert sum(o.value["read"]["bytes_read"] for o in out) == one["read"]["bytes_read"]
