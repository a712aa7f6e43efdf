"""Quantized-resident calibration on a GPU (skipped without CUDA).

* Under ``dequantized_compute`` a linear with a per-tensor FP8 weight computes with the
  dequantized weight and the input as it is, bit for bit ``F.linear(x, w.dequantize())``; outside
  it, the same call takes ``torch._scaled_mm`` on an FP8 copy of the input (a different result):
  calibration must see the activations of the dequantized model, not of an FP8-input GEMM.
* tiny-moe calibrated on CUDA with fp8 / fp8_block / mxfp8 resident weights: weight amaxes
  identical to the BF16-resident run, parameters smaller.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_dequantized_compute_turns_scaled_mm_off():
    from qckpt.formats import quantize
    from qckpt.formats.tensor import dequantized_compute

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = quantize(torch.randn(128, 256, device="cuda", generator=g).to(torch.bfloat16), "fp8")
    exact = F.linear(x, w.dequantize(torch.bfloat16))
    with dequantized_compute():
        assert torch.equal(F.linear(x, w), exact)
    assert not torch.equal(F.linear(x, w), exact)  # the FP8-input GEMM outside


@pytest.mark.parametrize("resident", ["fp8", "fp8_block", "mxfp8"])
def test_cuda_calibration_weight_amax_matches_bf16(tmp_path, resident):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.models.build import build_model
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.recipe import recipe_from_dict

    dcp = tmp_path / "dcp"
    save_model_dcp(build_model("tiny-moe", dtype="bfloat16", seed=0), dcp)
    runs = {}
    for fmt in ("bf16", resident):
        r = recipe_from_dict(
            {
                "model": {"source": "tiny-moe"},
                "checkpoint": {"path": str(dcp)},
                "load": {"device": "cuda"},
                "calibrate": {"weights_resident": fmt, "output": str(tmp_path / f"{fmt}.st")},
            }
        )
        runs[fmt] = calibrate(r, Mesh(device=torch.device("cuda")))
    ref, got = runs["bf16"].state.amax, runs[resident].state.amax
    weights = [k for k in ref if k.endswith(".weight_amax")]
    assert weights and all(torch.equal(got[k], ref[k]) for k in weights)
    assert runs[resident].report["param_bytes"] < 0.65 * runs["bf16"].report["param_bytes"]
