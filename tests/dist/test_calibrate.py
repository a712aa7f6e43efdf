"""calibrate_model over real gloo ranks: world-size invariance, cold experts, a rank that dies."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist.harness import run_once, shared_world

pytestmark = pytest.mark.timeout(240)
N = 4
DATA = {"source": "synthetic", "num_samples": 16, "seq_len": 32, "batch_size": 2}


def _mesh(group, world: int, rank: int):
    from qckpt.parallel.mesh import Mesh

    return Mesh(
        world_size=world,
        rank=rank,
        dp=world,
        dp_rank=rank,
        backend="gloo" if group is not None else "none",
        timeout_s=10.0,
        dp_group=group,
        data_group=group,
        world_group=group,
    )


def _calibrate(
    group, world: int, rank: int, *, share=True, bias_router=False, dtype="bfloat16", quant=None
):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.models.build import build_model
    from qckpt.recipe import DataConfig, QuantConfig

    model = build_model("tiny-moe", dtype=dtype, seed=0)
    if bias_router:
        _never_route_to(model, {6, 7})
    batches = calibration_batches(
        DataConfig(**DATA), vocab_size=256, data_rank=rank, data_world=world
    )
    return calibrate_model(
        model, batches, quant or QuantConfig(), _mesh(group, world, rank), share_expert_inputs=share
    )


def _never_route_to(model, cold: set[int]) -> None:
    """A router that never picks the ``cold`` experts (same math as transformers' otherwise)."""
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def forward(h, gate=gate):
            h = h.reshape(-1, gate.hidden_dim)
            logits = nn.functional.linear(h, gate.weight)
            logits[:, sorted(cold)] = float("-inf")
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            top = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
            return logits, top, idx

        gate.forward = forward


def sc_world_size_invariance(rank, world):
    # all three layouts in one live world: world 1 on rank 0 alone, DP2 on ranks {0, 1}, DP4
    pair = dist.new_group([0, 1], timeout=__import__("datetime").timedelta(seconds=10))
    out = {}
    if rank == 0:
        state, _ = _calibrate(None, 1, 0)
        out[1] = state
    if rank < 2:
        state, _ = _calibrate(pair, 2, rank)
        out[2] = state
    state, report = _calibrate(dist.group.WORLD, 4, rank)
    out[4] = state
    if rank != 0:
        return {"keys4": sorted(state.amax), "weights_here": report["weight_amax_here"]}
    return {
        w: {
            "amax": s.amax,
            "meta": {k: (v["calibrated"], v["shared"]) for k, v in s.quantizers.items()},
        }
        for w, s in out.items()
    } | {"report": report, "weights_here": report["weight_amax_here"]}


def sc_weight_split_static(rank, world):
    """Per-channel and per-block weight amaxes (static: every expected rank must hold them),
    each DP rank taking only its share: world 1 on rank 0 beside DP4 on all four."""
    from qckpt.recipe import QuantConfig, TensorQuantConfig

    out = {}
    for gran in ("channel", "block"):
        w = TensorQuantConfig(granularity=gran, block_size=[32, 32])
        quant = QuantConfig(weights=w)
        one = _calibrate(None, 1, 0, quant=quant)[0].amax if rank == 0 else None
        state, report = _calibrate(dist.group.WORLD, 4, rank, quant=quant)
        out[gran] = {"one": one, "four": state.amax, "here": report["weight_amax_here"]}
    return out


def sc_dp2_ep2(rank, world):
    """DP2 x EP2 with the EP runtime (qckpt.parallel.expert) sharding the experts."""
    import datetime

    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.model import build

    to = datetime.timedelta(seconds=10)
    eps = [dist.new_group([0, 1], timeout=to), dist.new_group([2, 3], timeout=to)]
    dps = [dist.new_group([0, 2], timeout=to), dist.new_group([1, 3], timeout=to)]
    dp_rank, ep_rank = rank // 2, rank % 2  # rank = dp_rank * ep + ep_rank
    mesh = Mesh(
        world_size=4,
        rank=rank,
        dp=2,
        ep=2,
        dp_rank=dp_rank,
        ep_rank=ep_rank,
        backend="gloo",
        ep_group=eps[dp_rank],
        dp_group=dps[ep_rank],
        data_group=dist.group.WORLD,
        world_group=dist.group.WORLD,
    )
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.recipe import DataConfig, QuantConfig

    model = build("tiny-moe", mesh, dtype="bfloat16", seed=0, seeded=True).model
    batches = calibration_batches(
        DataConfig(**DATA), vocab_size=256, data_rank=mesh.data_rank, data_world=4
    )
    state, report = calibrate_model(model, batches, QuantConfig(), mesh)
    one = _calibrate(None, 1, 0)[0] if rank == 0 else None
    return {"state": state, "one": one, "report": report}


def sc_cold_experts(rank, world, share):
    try:
        state, report = _calibrate(dist.group.WORLD, world, rank, share=share, bias_router=True)
    except Exception as exc:  # the outcome under test
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"state": state, "report": report}


class _Toy(nn.Module):
    """A model with an HF-like call signature, without the transformers import cost."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, input_ids, use_cache=False):
        return self.fc2(torch.relu(self.fc1(self.embed(input_ids))))


def sc_rank_dies(rank, world):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.recipe import QuantConfig

    model = _Toy()
    seen = []

    def die_on_second_batch(_mod, _args):
        seen.append(1)
        if rank == 1 and len(seen) == 2:
            os._exit(17)  # killed mid-calibration, no goodbye

    model.fc1.register_forward_pre_hook(die_on_second_batch)
    batches = [torch.randint(0, 256, (2, 8)) for _ in range(4)]
    t0 = time.monotonic()
    try:
        calibrate_model(model, batches, QuantConfig(), _mesh(dist.group.WORLD, world, rank))
    finally:
        print(f"rank {rank} left calibrate after {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="module")
def world():
    return shared_world(N)


def test_world_size_invariance_tiny_moe_bit_identical(world):
    out = world.run(sc_world_size_invariance, deadline_s=180)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    r0 = out[0].value
    ref = r0[1]["amax"]
    assert len(ref) == 112  # 2 layers: 4 attention linears + 8 experts x 3, weight and input
    for w in (2, 4):
        got = r0[w]["amax"]
        assert sorted(got) == sorted(ref)
        diff = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not diff, f"world {w} differs from world 1 at {diff[:5]}"
        assert r0[w]["meta"] == r0[1]["meta"]
    for o in out[1:]:
        assert o.value["keys4"] == sorted(ref)
    # each DP rank took the amaxes of a quarter of the 56 weights (2 layers x (4 + 8 x 3)), not
    # all of them; the sync gave every rank the others (the file is world 1's, above)
    here = [o.value["weights_here"] for o in out]
    assert sum(here) == 56 and max(here) <= 16, here
    # the report says where tokens went: every rank of the 4 got some, summed over experts
    layer0 = r0["report"]["layers"]["model.layers.0"]
    per_rank = [sum(c[r] for c in layer0["expert_tokens"].values()) for r in range(4)]
    assert all(n > 0 for n in per_rank) and sum(per_rank) == 16 * 32 * 2  # top-2


def test_weight_amax_split_over_dp_ranks_static_amax_bit_identical(world):
    out = world.run(sc_weight_split_static, deadline_s=180)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    for gran in ("channel", "block"):
        ref = out[0].value[gran]["one"]
        weights = [k for k in ref if k.endswith(".weight_amax")]
        assert weights and all(ref[k].numel() > 1 for k in weights)  # static, not per tensor
        for o in out:
            got = o.value[gran]["four"]
            assert sorted(got) == sorted(ref)
            diff = [k for k in ref if not torch.equal(ref[k], got[k])]
            assert not diff, f"{gran}: DP4 rank {o.rank} differs from world 1 at {diff[:5]}"
        assert sum(o.value[gran]["here"] for o in out) == len(weights)


def test_dp2_ep2_with_sharded_experts_matches_one_rank_bit_for_bit(world):
    out = world.run(sc_dp2_ep2, deadline_s=180)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    one = out[0].value["one"]
    for o in out:
        state = o.value["state"]
        assert sorted(state.amax) == sorted(one.amax)  # every expert, though each rank holds half
        diff = [k for k in one.amax if not torch.equal(one.amax[k], state.amax[k])]
        assert not diff, diff[:5]
        assert state.model_fingerprint == one.model_fingerprint
    # experts 0-3 live on EP rank 0 (world ranks 0 and 2), 4-7 on EP rank 1 (ranks 1 and 3)
    hot = out[0].value["report"]["layers"]["model.layers.0"]["experts_with_tokens"]
    assert hot == {str(e): "r0 r2" if e < 4 else "r1 r3" for e in range(8)}


def test_cold_experts_take_the_layer_value_when_opted_in(world):
    out = world.run(sc_cold_experts, True, deadline_s=120)
    assert all(o.ok and "error" not in o.value for o in out), out
    for o in out:
        state, report = o.value["state"], o.value["report"]
        for layer in (0, 1):
            prefix = f"model.layers.{layer}.mlp.experts"
            hot = [state.amax[f"{prefix}.{e}.gate_proj.input_amax"] for e in range(6)]
            for e in (6, 7):
                for proj in ("gate_proj", "up_proj"):
                    key = f"{prefix}.{e}.{proj}.input_amax"
                    assert state.quantizers[key]["shared"] is True
                    assert torch.equal(state.amax[key], torch.stack(hot).max())
                # cold experts' weights are calibrated from the weights themselves
                assert state.quantizers[f"{prefix}.{e}.down_proj.weight_amax"]["shared"] is False
                assert f"{prefix}.{e}.down_proj.weight_amax" in state.amax
            row = report["layers"][f"model.layers.{layer}"]
            assert row["cold_experts"] == [6, 7]
            assert row["shared"] == 6  # gate, up, down inputs of experts 6 and 7
    assert out[0].value["state"].amax.keys() == out[3].value["state"].amax.keys()


def test_strict_mode_raises_moe_incomplete_on_every_rank(world):
    out = world.run(sc_cold_experts, False, deadline_s=120)
    for o in out:
        assert o.ok, o.traceback
        err = o.value.get("error", "")
        assert err.startswith("SyncError: MoE calibration incomplete"), err
        assert "model.layers.0.mlp.experts: experts 6, 7" in err
        assert "model.layers.1.mlp.experts: experts 6, 7" in err


def test_a_rank_killed_mid_calibration_fails_the_others_within_the_timeout():
    t0 = time.monotonic()
    out = run_once(sc_rank_dies, 2, timeout_s=10.0, deadline_s=60.0)
    elapsed = time.monotonic() - t0
    assert out[1].exitcode == 17
    survivor = out[0]
    assert survivor.exitcode == 1  # non-zero, as a CLI run would end
    assert survivor.error_type == "SyncError", survivor.error
    assert "died or timed out" in survivor.error
    assert survivor.seconds < 10.0 + 5.0, survivor.seconds  # within the group timeout
    assert elapsed < 60.0
