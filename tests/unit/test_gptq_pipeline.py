"""calibrate.algorithm gptq through ``qckpt calibrate``'s and ``qckpt export``'s library calls
(tiny MoE, one process): the sidecar of GPTQ'd weights, the export that reads it, and ``qckpt
plan``'s prediction of the Hessians' memory against what the run held."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from qckpt.convert.dcp import save_model_dcp
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.calibrate import calibrate
from qckpt.pipeline.export import export
from qckpt.pipeline.plan import plan
from qckpt.recipe import load_recipe
from tests.conftest import ROOT

RECIPE = str(ROOT / "configs" / "tiny-moe.yaml")


def _recipe(d, *more: str):
    return load_recipe(
        RECIPE,
        [
            f"checkpoint.path={d / 'dcp'}",
            "calibrate.algorithm=gptq",
            f"calibrate.output={d / 'calib.safetensors'}",
            f"export.output={d / 'out'}",
            *more,
        ],
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq")
    save_model_dcp(build_model("tiny-moe", seed=0), d / "dcp")
    r = _recipe(d)
    return d, r, calibrate(r, Mesh())


def test_the_export_writes_the_gptq_weights_not_the_checkpoints(run):
    d, r, got = run
    side = load_file(str(d / "calib.safetensors.gptq" / "ep000.safetensors"))
    assert len(side) == 2 * 4 + 2 * 8 * 3  # 2 layers: q/k/v/o and 8 experts x gate/up/down
    export(r, None)
    out = {}
    for f in (d / "out").glob("*.safetensors"):
        out.update(load_file(str(f)))
    src = build_model("tiny-moe", seed=0).state_dict()
    rows = [got.report["layers"][f"model.layers.{i}"]["gptq"] for i in range(2)]
    assert all(row["loss_gptq"] < row["loss_rtn"] for row in rows)
    for m in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.experts.2.down_proj"):
        w = side[f"{m}.weight"].float()
        dq = out[f"{m}.weight"].float() * out[f"{m}.weight_scale"].float()
        # the export dequantizes to the GPTQ'd weights (within the scale's bf16 rounding) ...
        assert torch.allclose(dq, w, rtol=2**-7, atol=0), m
        # ... which are not the checkpoint's weights rounded to nearest
        name = f"{m}.weight" if "experts" not in m else None
        if name is not None:
            s = out[f"{m}.weight_scale"].float()
            rtn = (src[name].float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert not torch.equal(rtn.view(torch.uint8), out[f"{m}.weight"].view(torch.uint8))


def test_plan_predicts_the_hessians_the_run_held(run):
    d, r, got = run
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    data = r.calibrate.data
    io = 2 * data.num_samples * data.seq_len * 64 * 2  # hidden 64, bf16
    assert got.report["gptq_hessian_bytes"] <= got.report["gptq_hessian_bytes_bound"]
    # GPTQ's batches of working copies, linears of one shape side by side: the largest in a
    # tiny-moe layer is the 16 expert gate/up halves [32, 64] with k_proj and v_proj [32, 64]
    predicted = row.gptq_bytes - 2 * got.report["gptq_hessian_bytes_bound"] - io
    assert predicted == 18 * 4 * (3 * 32 * 64 + 64 * 64)
    assert 0 < got.report["gptq_stack_bytes"] <= predicted


def test_quantized_inputs_hold_c_beside_each_hessian_and_plan_counts_it(run, tmp_path):
    """calibrate.gptq_inputs: quantized (FP8 static inputs here): a second matrix (C) beside
    every Hessian, and the input-aware targets of a shape's linears beside its batch: both
    in ``qckpt plan``'s figure, which bounds what the run held."""
    d, _, src = run
    r = _recipe(d, "calibrate.gptq_inputs=quantized", f"calibrate.output={tmp_path / 'c'}")
    got = calibrate(r, Mesh())
    assert got.report["gptq_inputs"] == "quantized" and src.report["gptq_inputs"] == "source"
    for key in ("gptq_hessian_bytes", "gptq_hessian_bytes_bound"):
        assert got.report[key] == 2 * src.report[key], key
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    io = 2 * r.calibrate.data.num_samples * r.calibrate.data.seq_len * 64 * 2
    predicted = row.gptq_bytes - 2 * got.report["gptq_hessian_bytes_bound"] - io
    # the batch of 18 linears [32, 64] (see above) and their 18 targets, float32
    assert predicted == 18 * 4 * (3 * 32 * 64 + 64 * 64) + 18 * 4 * 32 * 64
    assert src.report["gptq_stack_bytes"] < got.report["gptq_stack_bytes"] <= predicted


@pytest.mark.parametrize("offload", ["layer", "host"])
def test_offload_gives_the_resident_sidecar_bit_for_bit(run, tmp_path, offload):
    """calibrate.offload with gptq: the model on meta, one layer at a time on the device (its
    weights read from the checkpoint, or from host memory), GPTQ'd and taken to the sidecar
    before it leaves: the same GPTQ'd weights and calibration file as the resident run, with
    at most two layers' weights on the device, which ``qckpt plan`` bounds."""
    from qckpt.calib.state_file import load_calibration

    d, _, src = run
    out = tmp_path / "c.safetensors"
    r = _recipe(d, f"calibrate.offload={offload}", f"calibrate.output={out}")
    got = calibrate(r, Mesh())
    # written to the file layer by layer: nothing of it held in memory at the end
    assert got.state.weights == {} and src.state.weights
    a = load_file(str(d / "calib.safetensors.gptq" / "ep000.safetensors"))
    b = load_file(str(tmp_path / "c.safetensors.gptq" / "ep000.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 4 + 2 * 8 * 3
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    ca, cb = load_calibration(d / "calib.safetensors"), load_calibration(out)
    assert ca.amax.keys() == cb.amax.keys()
    assert all(torch.equal(ca.amax[k], cb.amax[k]) for k in ca.amax)
    rows = ("loss_rtn", "loss_gptq", "linears", "rounded")
    for i in range(2):
        ga = src.report["layers"][f"model.layers.{i}"]["gptq"]
        gb = got.report["layers"][f"model.layers.{i}"]["gptq"]
        assert [ga[k] for k in rows] == [gb[k] for k in rows]
    off = got.report["offload"]
    assert off["mode"] == offload and off["layers"] == 2
    assert off["layer_weight_bytes_peak"] <= 2 * off["layer_weight_bytes_max"]
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    assert row.parameter_bytes >= off["layer_weight_bytes_peak"] + off["outer_weight_bytes"]
    assert row.gptq_bytes >= 2 * got.report["gptq_hessian_bytes"]
    # the layers are read twice (the max pass, then GPTQ's), or once into host memory
    assert row.bytes_read == off["bytes_read"] > 0


def test_mse_and_awq_refuse_offload_and_gptq_takes_it():
    from qckpt.errors import RecipeError
    from qckpt.recipe import recipe_from_dict

    for algo in ("mse", "awq"):
        with pytest.raises(RecipeError, match=f"{algo} needs calibrate.offload: none") as e:
            recipe_from_dict({"calibrate": {"algorithm": algo, "offload": "layer"}})
        assert "\n" not in str(e.value)
    r = recipe_from_dict({"calibrate": {"algorithm": "gptq", "offload": "layer"}})
    assert r.calibrate.offload == "layer"
