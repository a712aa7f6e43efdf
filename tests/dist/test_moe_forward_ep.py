"""calibrate.moe_forward: grouped under expert parallelism: the amaxes of one eager process."""

import torch

from tests.dist.harness import shared_world

QUANT = {"weights": {"format": "fp8", "granularity": "tensor"}, "ignore": ["lm_head", "*.mlp.gate"]}
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}


def _calibrate(rank, world, ep, moe_forward):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.model import build
    from qckpt.recipe import recipe_from_dict

    r = recipe_from_dict({"quant": QUANT, "calibrate": {"data": DATA, "moe_forward": moe_forward}})
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    model = build("tiny-moe", mesh, seeded=True).model
    batches = calibration_batches(
        r.calibrate.data, vocab_size=256, data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )  # fmt: skip
    state, report = calibrate_model(
        model, batches, r.quant, mesh, moe_forward=r.calibrate.moe_forward
    )
    tokens = {
        (layer, e): sum(counts)
        for layer, row in report["layers"].items()
        for e, counts in row.get("expert_tokens", {}).items()
    }
    return {"amax": state.amax, "tokens": tokens}


def test_ep2_grouped_equals_one_eager_process_bit_for_bit():
    ref = _calibrate(0, 1, 1, "eager")
    out = shared_world(2).run(_calibrate, 2, "grouped", deadline_s=240)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        amax = o.value["amax"]
        assert sorted(amax) == sorted(ref["amax"])
        diff = [k for k in amax if not torch.equal(amax[k], ref["amax"][k])]
        assert not diff, diff[:5]
    # every expert got the tokens it gets in one process (counted on the rank holding it)
    assert out[0].value["tokens"] == ref["tokens"]
    assert sum(ref["tokens"].values()) > 0
