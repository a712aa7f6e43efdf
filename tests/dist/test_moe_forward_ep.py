"""calibrate.moe_forward: grouped (and auto, the default) under expert parallelism: the amaxes
(and GPTQ's weights) of one eager process."""

import torch

from tests.dist.harness import shared_world

QUANT = {"weights": {"format": "fp8", "granularity": "tensor"}, "ignore": ["lm_head", "*.mlp.gate"]}
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}


def _calibrate(rank, world, ep, moe_forward, algorithm="max"):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.model import build
    from qckpt.recipe import recipe_from_dict

    cal = {"data": DATA, "moe_forward": moe_forward, "algorithm": algorithm}
    r = recipe_from_dict({"quant": QUANT, "calibrate": cal})
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    model = build("tiny-moe", mesh, seeded=True).model
    batches = calibration_batches(
        r.calibrate.data, vocab_size=256, data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )  # fmt: skip
    state, report = calibrate_model(
        model, batches, r.quant, mesh, moe_forward=r.calibrate.moe_forward, algorithm=algorithm
    )
    tokens = {
        (layer, e): sum(counts)
        for layer, row in report["layers"].items()
        for e, counts in row.get("expert_tokens", {}).items()
    }
    return {
        "amax": state.amax, "tokens": tokens, "weights": state.weights,
        "moe": report["moe_forward"],
    }  # fmt: skip


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


def test_ep2_auto_gptq_equals_one_eager_process_bit_for_bit():
    """The default under EP2 (each rank's experts checked on its own first call): gptq's
    Hessians (its weights) and the amaxes are one eager process's."""
    ref = _calibrate(0, 1, 1, "eager", "gptq")
    out = shared_world(2).run(_calibrate, 2, "auto", "gptq", deadline_s=300)
    assert all(o.ok for o in out), [o.error for o in out]
    seen = {}
    for o in out:
        v = o.value
        assert v["moe"]["used"] == "grouped", v["moe"]
        assert sorted(v["amax"]) == sorted(ref["amax"])
        diff = [k for k in v["amax"] if not torch.equal(v["amax"][k], ref["amax"][k])]
        assert not diff, diff[:5]
        diff = [k for k in v["weights"] if not torch.equal(v["weights"][k], ref["weights"][k])]
        assert not diff, diff[:5]
        seen.update(v["weights"])
    # between them the two ranks hold every GPTQ'd weight, experts of both halves among them
    assert sorted(seen) == sorted(ref["weights"])
    assert any(".experts.7." in k for k in seen) and any(".experts.0." in k for k in seen)
