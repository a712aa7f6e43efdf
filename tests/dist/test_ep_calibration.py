"""Calibration under expert parallelism: identical to one process, and cold experts handled."""

import torch

from tests.dist.harness import shared_world

QUANT = {"weights": {"format": "fp8", "granularity": "tensor"}, "ignore": ["lm_head", "*.mlp.gate"]}
DATA = {"source": "synthetic", "num_samples": 8, "seq_len": 16, "batch_size": 2}


def _calibrate(rank, world, ep, share=True, cold_bias=False):
    """Calibrate tiny-moe on this world with ``ep`` EP ranks (dp = world / ep)."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.model import build
    from qckpt.recipe import recipe_from_dict

    r = recipe_from_dict({"quant": QUANT, "calibrate": {"data": DATA}})
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    starve = (lambda m: starve_experts(m, cold=[5, 6, 7])) if cold_bias else None
    model = build("tiny-moe", mesh, seeded=True, before_shard=starve).model
    batches = calibration_batches(
        r.calibrate.data,
        vocab_size=256,
        data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )
    state, report = calibrate_model(model, batches, r.quant, mesh, share_expert_inputs=share)
    return {"amax": state.amax, "report": report}


def starve_experts(model, cold):
    """Make every router unable to pick the ``cold`` experts."""
    for layer in model.model.layers:
        _patch_router(layer.mlp.gate, cold)


def _patch_router(gate, cold):
    import torch.nn.functional as F

    def forward(hidden_states):
        h = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(h, gate.weight)
        logits[:, cold] = float("-inf")
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        val, idx = torch.topk(probs, gate.top_k, dim=-1)
        if gate.norm_topk_prob:
            val = val / val.sum(dim=-1, keepdim=True)
        return logits, val.to(logits.dtype), idx

    gate.forward = forward


def test_amax_identical_for_world1_dp2_ep2_dp2xep2():
    ref = _calibrate(0, 1, 1)["amax"]
    assert len(ref) == 112
    results = {}
    for n, ep in ((2, 1), (2, 2), (4, 2)):  # DP2, EP2, DP2 x EP2
        out = shared_world(n).run(_calibrate, ep, deadline_s=240)
        assert all(o.ok for o in out), [o.error for o in out]
        results[(n, ep)] = out[0].value["amax"]
        for o in out[1:]:  # every rank ends with the same values
            assert all(torch.equal(o.value["amax"][k], out[0].value["amax"][k]) for k in ref)
    for layout, amax in results.items():
        assert sorted(amax) == sorted(ref), layout
        diff = [k for k in ref if not torch.equal(amax[k], ref[k])]
        assert not diff, (layout, diff[:5])


def test_cold_experts_take_the_layer_value_when_shared():
    out = shared_world(4).run(_calibrate, 2, True, True, deadline_s=240)
    assert all(o.ok for o in out), [o.error for o in out]
    amax = out[0].value["amax"]
    rep = out[0].value["report"]["layers"]["model.layers.0"]
    assert rep["cold_experts"] == [5, 6, 7]
    for layer in (0, 1):
        pre = f"model.layers.{layer}.mlp.experts"
        hot = max(float(amax[f"{pre}.{e}.gate_proj.input_amax"]) for e in range(5))
        for e in (5, 6, 7):
            assert float(amax[f"{pre}.{e}.gate_proj.input_amax"]) == hot
            assert float(amax[f"{pre}.{e}.up_proj.input_amax"]) == hot
            # weight amax comes from the weight itself, cold or not
            assert float(amax[f"{pre}.{e}.down_proj.weight_amax"]) > 0


def test_strict_mode_raises_on_every_rank():
    out = shared_world(4).run(_calibrate, 2, False, True, deadline_s=240)
    assert all(not o.ok for o in out), out
    for o in out:
        assert "MoE calibration incomplete" in o.error
        assert "5" in o.error and "7" in o.error
