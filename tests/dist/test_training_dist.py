"""EP2 / TP2 loads from Megatron-Core checkpoints (real gloo ranks): every rank's block equals
the same block of the one-rank load, bit for bit, for the real megatron-core fixture and the
generated stacked layout (TP and EP chunks), and an EP rank reads only its experts' bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist.harness import shared_world

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"


def sc_sharded_vs_one_rank(rank, world, path, source, ep, tp, fmts):
    from qckpt.load.loader import load_checkpoint
    from qckpt.parallel.mesh import init_mesh
    from qckpt.parallel.shard import model_shards
    from qckpt.pipeline.model import build
    from tests._bits import bits

    mesh = init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
    bad, sharded, read = [], 0, {}
    for fmt in fmts:
        one = build(source, mesh, params=fmt, ignore=["lm_head"], sharded=False).model
        whole_rep = load_checkpoint(one, path, reader="plain", mesh=None)
        whole = one.state_dict(keep_vars=True)
        m = build(source, mesh, params=fmt, ignore=["lm_head"]).model
        specs = model_shards(m)
        sharded = len(specs)
        rep = load_checkpoint(m, path, mesh=mesh, reader="fast")
        read[fmt] = (rep.bytes_read, whole_rep.bytes_read)
        for k, v in m.state_dict(keep_vars=True).items():
            ref, got = _value(whole[k]), _value(v)
            spec = specs.get(k)
            if spec is not None:  # this rank's block of the one-rank value
                ref = ref[
                    tuple(slice(o, o + n) for o, n in zip(spec.offsets, got.shape, strict=False))
                ]
            if not torch.equal(bits(ref), bits(got)):
                bad.append(f"{fmt}: {k}")
    return {"bad": bad, "sharded": sharded, "read": read}


def _value(t):  # noqa: ANN001, ANN202
    from qckpt.formats import is_quantized

    return t.dequantize(torch.float32) if is_quantized(t) else t.detach()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    from qckpt.models.build import build_model
    from tests.export_fixtures import hf_state
    from tests.training_fixtures import write_megatron

    root = tmp_path_factory.mktemp("mcdist")
    m = build_model("tiny-moe", dtype="bfloat16", seed=2)
    return write_megatron(hf_state(m), m.config, root / "mc", tp=2, ep=4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ep,tp", [(2, 1), (1, 2)])
def test_sharded_loads_equal_the_one_rank_load(generated, ep, tp):
    runs = [
        (str(FIX / "moe_ep2"), str(FIX / "moe_hf"), ["none", "fp8"]),
        (str(generated), "tiny-moe", ["none"]),
    ]
    for path, source, fmts in runs:
        outs = shared_world(2).run(
            sc_sharded_vs_one_rank, path, source, ep, tp, fmts, deadline_s=180
        )
        for o in outs:
            assert o.ok, f"rank {o.rank}: {o.error}\n{o.traceback}"
            assert o.value["sharded"] >= (4 if ep == 2 else 8)
            assert not o.value["bad"], (o.rank, o.value["bad"])
        if ep == 2:  # each EP rank reads its own experts (most of the bytes), not all of them
            for o in outs:
                mine, whole = o.value["read"]["none"]
                assert mine < 0.7 * whole, (o.rank, mine, whole)
