"""qckpt search under DP / EP / DP x EP (gloo) on the tiny MoE with cold experts (5-7 never
routed to): the Hessian diagonals, every E, the chosen recipe and then the export of that
recipe are the one process's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(400)
COLD = [5, 6, 7]
RAW = {
    "calibrate": {"data": {"source": "synthetic", "num_samples": 8, "seq_len": 16,
                           "batch_size": 2}},
    "search": {"candidates": [
        {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}},
        {"weights": {"format": "fp8", "granularity": "channel"},
         "inputs": {"format": "fp8", "dynamic": True}},
        {"weights": {"format": "none"}},
    ]},
}  # fmt: skip


def sc_search(rank, world, ep, out, budget="6bpw"):
    """Search the seeded tiny MoE (cold experts) over this world; rank 0 writes ``out``."""
    from qckpt.calib.data import calibration_batches
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.model import build
    from qckpt.pipeline.search import write_found
    from qckpt.recipe import recipe_from_dict
    from qckpt.search.choose import parse_budget
    from qckpt.search.run import search_model
    from tests.dist.test_ep_calibration import starve_experts

    r = recipe_from_dict(RAW)
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    model = build(
        "tiny-moe", mesh, seeded=True, before_shard=lambda m: starve_experts(m, cold=COLD)
    ).model
    batches = calibration_batches(
        r.calibrate.data, vocab_size=256, data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )  # fmt: skip
    res = search_model(model, batches, r, RAW, mesh, budget=parse_budget(budget), model_bytes=0)
    if rank == 0:
        write_found(res.recipe, out)
    s = res.sensitivity
    diag = {k: v.numpy().tobytes() for k, v in s.diag.items()}
    return {"diag": diag, "rows": s.rows, "errors": s.errors, "cold": s.cold, "found": res.recipe}


def sc_calibrate_found(rank, world, ep, found, out):
    """Calibrate the found recipe (max) over this world; rank 0 writes ``out``."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.state_file import save_calibration
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.model import build
    from qckpt.recipe import load_recipe
    from tests.dist.test_ep_calibration import starve_experts

    r = load_recipe(found)
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    model = build(
        "tiny-moe", mesh, seeded=True, before_shard=lambda m: starve_experts(m, cold=COLD)
    ).model
    batches = calibration_batches(
        r.calibrate.data, vocab_size=256, data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )  # fmt: skip
    state, _ = calibrate_model(model, batches, r.quant, mesh)
    if rank == 0:
        save_calibration(state, out)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("search")
    build_model("tiny-moe", dtype="bfloat16", seed=0).save_pretrained(root / "hf")
    return root / "hf"


def _export(hf: Path, found: Path, cal: Path, out: Path) -> dict[str, bytes]:
    from qckpt.models.build import build_model
    from qckpt.recipe import load_recipe
    from tests.export_fixtures import run_export

    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    run_export(model, hf, cal, out, load_recipe(found).quant)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_search_and_its_export_are_bit_identical_on_1_rank_dp2_ep2_dp2xep2(hf, tmp_path):
    one = tmp_path / "one.yaml"
    ref = sc_search(0, 1, 1, one)
    # cold experts got the layer's mean, and some unit took each kind of choice
    assert len(ref["cold"]) == 2 * 2 * len(COLD)
    picked = {t for e in ref["found"]["quant"]["schemes"] for t in e["targets"]}
    assert any(".experts." in t for t in picked)
    sc_calibrate_found(0, 1, 1, one, tmp_path / "one.safetensors")
    ref_files = _export(hf, one, tmp_path / "one.safetensors", tmp_path / "x-one")
    assert ref_files
    for n, ep in ((2, 1), (2, 2), (4, 2)):  # DP2, EP2, DP2 x EP2
        found = tmp_path / f"w{n}ep{ep}.yaml"
        out = shared_world(n).run(sc_search, ep, found, deadline_s=240)
        assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
        for o in out:  # every rank: the same diagonals, errors and choice as one process
            for key in ("diag", "rows", "errors", "cold", "found"):
                assert o.value[key] == ref[key], (n, ep, key)
        assert found.read_bytes() == one.read_bytes(), (n, ep)
        cal = tmp_path / f"w{n}ep{ep}.safetensors"
        out = shared_world(n).run(sc_calibrate_found, ep, found, cal, deadline_s=240)
        assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
        files = _export(hf, found, cal, tmp_path / f"x-{n}-{ep}")
        assert files == ref_files, (n, ep)
