"""``qckpt plan``'s per-rank load predictions against sharded loads on 2 gloo ranks (EP2, TP2):
each rank's held parameter bytes, bytes read and transient, exactly."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(600)


def sc_sharded_load(rank, world, recipe, sets, fmt):
    from qckpt.load.loader import load_checkpoint
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.load import build_for_load
    from qckpt.recipe import load_recipe
    from tests.unit.test_plan import held_bytes

    r = load_recipe(recipe, sets)
    mesh = init_mesh(ep=r.parallel.ep, tp=r.parallel.tp, timeout_s=10, device="cpu")
    # the model qckpt load fills: built on meta, EP then TP sharded, quantized blocks
    built = build_for_load(r, mesh)
    assert built.ep_sharded or built.tp_sharded
    lo = r.load
    rep = load_checkpoint(
        built.model, r.checkpoint.path, mesh=mesh, reader=lo.reader, max_inflight=lo.max_inflight
    )
    return {
        "rank": mesh.rank,
        "held": held_bytes(built.model),
        "read": rep.bytes_read,
        "transient": rep.transient_bytes,
        "predicted": rep.predicted_transient_bytes,
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model

    d = tmp_path_factory.mktemp("plan-ckpt")
    for source in ("tiny-moe",):
        model = build_model(source, seed=0)
        save_model_dcp(model, d / source / "dcp")
        model.save_pretrained(d / source / "hf")
    return d


@pytest.mark.parametrize(
    ("source", "kind", "layout", "fmt"),
    [
        ("tiny-moe", "dcp", "ep=2", "fp8"),
        ("tiny-moe", "hf", "ep=2", "fp8_block"),
        # TP splits of tiny-moe's 64-wide linears stay on 16- and 32-element scale blocks
        ("tiny-moe", "hf", "tp=2", "nvfp4"),
        ("tiny-moe", "dcp", "tp=2", "mxfp8"),
    ],
)
def test_sharded_load_is_predicted_per_rank(checkpoints, source, kind, layout, fmt):
    from qckpt.pipeline.plan import plan
    from qckpt.recipe import load_recipe

    recipe = str(ROOT / "configs" / f"{source}.yaml")
    key, _, n = layout.partition("=")
    sets = [
        f"checkpoint.path={checkpoints / source / kind}",
        f"load.params={fmt}",
        f"parallel.{key}={n}",
    ]
    outs = shared_world(2).run(sc_sharded_load, recipe, sets, fmt, deadline_s=300)
    assert all(o.ok for o in outs), [o.error for o in outs]
    rows = plan(load_recipe(recipe, sets), nproc_per_node=2).rows["load"]
    for o in outs:
        got, row = o.value, rows[o.value["rank"]]
        assert row.parameter_bytes == got["held"], (o.rank, row, got)
        assert row.bytes_read == got["read"], (o.rank, row, got)
        assert row.transient_bytes == got["predicted"] >= got["transient"], (o.rank, row, got)
    # a rank holds less than the whole model: half of the sharded tensors
    whole = plan(load_recipe(recipe, sets[:2]), nproc_per_node=1).rows["load"][0]
    assert all(r.parameter_bytes < whole.parameter_bytes for r in rows)


def sc_offload(rank, world, recipe, sets):
    from qckpt.parallel.mesh import init_mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.recipe import load_recipe

    r = load_recipe(recipe, sets)
    mesh = init_mesh(ep=r.parallel.ep, tp=r.parallel.tp, timeout_s=10, device="cpu")
    return {"rank": mesh.rank, **calibrate(r, mesh).report["offload"]}


def test_ep2_layer_offload_is_predicted_per_rank(checkpoints, tmp_path):
    from qckpt.pipeline.plan import plan
    from qckpt.recipe import load_recipe

    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    sets = [
        f"checkpoint.path={checkpoints / 'tiny-moe' / 'hf'}",
        "parallel.ep=2",
        "calibrate.offload=layer",
        # batches of 4, 4, 4, 2 dealt to 2 data ranks: 8 and 6 samples (EP ranks must run
        # as many batches each: every forward is an exchange)
        "calibrate.data.num_samples=14",
        f"calibrate.output={tmp_path / 'calib.safetensors'}",
    ]
    outs = shared_world(2).run(sc_offload, recipe, sets, deadline_s=300)
    assert all(o.ok for o in outs), [o.error for o in outs]
    rows = plan(load_recipe(recipe, sets), nproc_per_node=2).rows["calibrate"]
    got = {o.value["rank"]: o.value for o in outs}
    for row in rows:
        rep = got[row.rank]
        assert row.activation_bytes == rep["activation_bytes"], row.rank
        assert row.parameter_bytes == rep["outer_weight_bytes"] + rep["layer_weight_bytes_peak"]
        assert row.bytes_read == rep["bytes_read"]
    assert rows[0].activation_bytes > rows[1].activation_bytes
