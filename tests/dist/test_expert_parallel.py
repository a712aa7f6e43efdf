"""The EP runtime on 4 gloo ranks: logits and calibration equal the single-process ones."""

import pytest
import torch

from tests.dist._harness import shared_world

TOKENS = torch.Generator().manual_seed(7)
IDS = torch.randint(0, 256, (8, 12), generator=TOKENS)


def _mesh(ep):
    from qckpt.parallel.mesh import init_mesh

    return init_mesh(ep=ep, tp=1, timeout_s=10, device="cpu")


def _reference_logits():
    from qckpt.models.build import build_model

    m = build_model("tiny-moe")
    m.config._experts_implementation = "eager"
    with torch.no_grad():
        return m(IDS).logits


def _ep_logits(rank, world, ep):
    from qckpt.models.build import build_model
    from qckpt.parallel.expert import shard_experts

    mesh = _mesh(ep)
    m = build_model("tiny-moe")
    names = shard_experts(m, mesh)
    n_data = mesh.data_parallel_size
    rows = IDS[mesh.data_rank :: n_data]
    with torch.no_grad():
        logits = m(rows).logits
    return {
        "data_rank": mesh.data_rank,
        "n_data": n_data,
        "logits": logits,
        "sharded": names,
        "experts": m.model.layers[0].mlp.experts.gate_up_proj.shape[0],
    }


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ep_forward_equals_single_process(ep):
    world = shared_world(4)
    out = world.run(_ep_logits, ep)
    assert all(o.ok for o in out), [o.error for o in out]
    ref = _reference_logits()
    for o in out:
        v = o.value
        assert v["experts"] == 8 // ep
        assert bool(v["sharded"]) == (ep > 1)
        mine = ref[v["data_rank"] :: v["n_data"]]
        # bit for bit: the combine adds each token's experts in the eager loop's order
        assert torch.equal(v["logits"], mine), (ep, (v["logits"] - mine).abs().max())


def _bad_ep(rank, world):
    from qckpt.models.build import build_model
    from qckpt.parallel.expert import shard_experts
    from qckpt.parallel.mesh import Mesh

    m = build_model("tiny-moe")
    mesh = _mesh(4)
    fake = Mesh(**{**mesh.__dict__, "ep": 3})
    shard_experts(m, fake)


def test_ep_that_does_not_divide_experts_is_named():
    out = shared_world(4).run(_bad_ep)
    assert all(not o.ok for o in out)
    assert all("parallel.ep: 3 does not divide the 8 experts" in o.error for o in out)
