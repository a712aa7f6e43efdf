"""``calibrate.mse_weighting: hessian`` under DP / EP / DP x EP (gloo) on the tiny MoE with cold
experts (5-7 never routed to): the calibration file (clips and the NVFP4 / MX weights'
``hessian_diag``) and the export are the one process's, bit for bit; and one process's
hessian export is not the plain search's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.harness import shared_world
from tests.dist.test_algorithms_dist import COLD, DATA, QUANTS

pytestmark = pytest.mark.timeout(400)
CASES = {
    "mse": {"algorithm": "mse", "mse_weighting": "hessian"},
    "mse-plain": {"algorithm": "mse"},
    "gptq": {"algorithm": "gptq", "gptq_block_scales": "mse", "mse_weighting": "hessian"},
}


def _recipe(quant: str, case: str):
    from qckpt.recipe import recipe_from_dict

    q = {**QUANTS[quant], "ignore": ["lm_head", "*.mlp.gate"]}
    return recipe_from_dict({"quant": q, "calibrate": {"data": DATA, **CASES[case]}})


def sc_calibrate(rank, world, ep, quant, case, out):
    """Calibrate the seeded tiny MoE (cold experts) over this world; rank 0 writes ``out``."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.state_file import save_calibration
    from qckpt.parallel.mesh import Mesh, init_mesh
    from qckpt.pipeline.calibrate import algorithm_of
    from qckpt.pipeline.model import build
    from tests.dist.test_ep_calibration import starve_experts

    r = _recipe(quant, case)
    mesh = init_mesh(ep=ep, timeout_s=10, device="cpu") if world > 1 else Mesh()
    model = build(
        "tiny-moe", mesh, seeded=True, before_shard=lambda m: starve_experts(m, cold=COLD)
    ).model
    batches = calibration_batches(
        r.calibrate.data, vocab_size=256, data_rank=mesh.data_rank,
        data_world=mesh.data_parallel_size,
    )  # fmt: skip
    state, report = calibrate_model(model, batches, r.quant, mesh, algorithm=algorithm_of(r))
    if r.calibrate.algorithm == "gptq":
        from qckpt.calib.gptq_pass import write_weights

        write_weights(state, out, mesh, suffix=".gptq")
    if rank == 0:
        save_calibration(state, out)
    return {"layers": report["layers"]}


def _export(hf: Path, cal: Path, out: Path, quant: str, case: str) -> dict[str, bytes]:
    from qckpt.models.build import build_model
    from tests.export_fixtures import run_export

    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    run_export(model, hf, cal, out, _recipe(quant, case).quant)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from qckpt.models.build import build_model

    root = tmp_path_factory.mktemp("hmse")
    build_model("tiny-moe", dtype="bfloat16", seed=0).save_pretrained(root / "hf")
    return root / "hf"


@pytest.mark.parametrize(
    ("case", "quant"),
    [("mse", q) for q in ("nvfp4", "mxfp4", "fp8_channel", "int4")] + [("gptq", "nvfp4")],
)
def test_hessian_mse_is_byte_identical_on_1_rank_dp2_ep2_dp2xep2(hf, tmp_path, case, quant):
    from qckpt.calib.state_file import calibration_differences, load_calibration

    one = tmp_path / "one.safetensors"
    ref = sc_calibrate(0, 1, 1, quant, case, one)
    diag = {k for k in load_calibration(one).amax if k.endswith(".hessian_diag")}
    if case == "mse" and quant in ("nvfp4", "mxfp4"):  # the export searches again with them
        assert diag and not any(f".experts.{e}." in k for e in COLD for k in diag)
        assert any(".experts.0.down_proj" in k for k in diag)
    else:  # clips carry the choice (GPTQ's block scales ride in its sidecar)
        assert not diag
    if case == "mse":
        rows = [row["mse"] for row in ref["layers"].values() if "mse" in row]
        assert sum(r["loss_mse"] for r in rows) < sum(r["loss_max"] for r in rows)
    ref_files = _export(hf, one, tmp_path / "x-one", quant, case)
    for n, ep in ((2, 1), (2, 2), (4, 2)):  # DP2, EP2, DP2 x EP2
        cal = tmp_path / f"w{n}ep{ep}.safetensors"
        out = shared_world(n).run(sc_calibrate, ep, quant, case, cal, deadline_s=240)
        assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
        assert calibration_differences(one, cal) == [], (n, ep)
        assert _export(hf, cal, tmp_path / f"x-{n}-{ep}", quant, case) == ref_files, (n, ep)


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4"])
def test_the_hessian_export_is_not_the_plain_one(hf, tmp_path, quant):
    """The file's diagonals reach the export's re-search: other block scales than plain mse's."""
    from safetensors.torch import load_file

    files = {}
    for case in ("mse", "mse-plain"):
        cal = tmp_path / f"{case}.safetensors"
        sc_calibrate(0, 1, 1, quant, case, cal)
        _export(hf, cal, tmp_path / f"x-{case}", quant, case)
        sd = {}
        for p in sorted((tmp_path / f"x-{case}").glob("*.safetensors")):
            sd.update(load_file(str(p)))
        files[case] = sd
    a, b = files["mse"], files["mse-plain"]
    scales = [k for k in a if k.endswith(".weight_scale") and ".self_attn." in k]
    assert scales and any(not (a[k].view(-1) == b[k].view(-1)).all() for k in scales)
    # a cold expert carries no diagonal: its export is the plain search's
    cold = [k for k in a if f".experts.{COLD[0]}." in k]
    assert cold and all((a[k].view(-1) == b[k].view(-1)).all() for k in cold)
