"""The EP runtime on 4 gloo ranks: logits and calibration equal the single-process ones."""

import pytest
import torch

from tests.dist.harness import shared_world

TOKENS = torch.Generator().manual_seed(7)
IDS = torch.randint(0, 256, (8, 12), generator=TOKENS)


def _mesh(ep):
    from qckpt.parallel.mesh import init_mesh

    return init_mesh(ep=ep, tp=1, timeout_s=10, device="cpu")


def _reference_logits(source="tiny-moe"):
    from qckpt.models.build import build_model

    m = build_model(source)
    m.config._experts_implementation = "eager"
    with torch.no_grad():
        return m(IDS).logits


def _ep_logits(rank, world, ep, source="tiny-moe"):
    from qckpt.models.build import build_model
    from qckpt.parallel.expert import shard_experts

    mesh = _mesh(ep)
    m = build_model(source)
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


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """A local HF dir holding a tiny Mixtral config (experts named w1/w2/w3 in its checkpoint)."""
    from transformers import MixtralConfig

    d = tmp_path_factory.mktemp("mixtral")
    MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    ).save_pretrained(str(d))  # fmt: skip
    return str(d)


@pytest.mark.parametrize(
    "world_size, ep", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]
)  # DP2, EP2, DP4, DP2 x EP2, EP4
def test_ep_forward_equals_single_process(world_size, ep):
    world = shared_world(world_size)
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


def test_mixtral_ep_forward_equals_single_process(tiny_mixtral):
    out = shared_world(4).run(_ep_logits, 2, tiny_mixtral)
    assert all(o.ok for o in out), [o.error for o in out]
    ref = _reference_logits(tiny_mixtral)
    for o in out:
        v = o.value
        assert v["experts"] == 4 and v["sharded"]
        assert torch.equal(v["logits"], ref[v["data_rank"] :: v["n_data"]])


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
