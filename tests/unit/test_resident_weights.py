"""The pieces of quantized-resident calibration, without the forwards.

* a load's tap takes weight amaxes from the checkpoint's values: equal, bit for bit, to what
  the calibrator computes from a BF16 model's weights, per tensor, per channel and per block;
* one expert of a quantized fused experts weight dequantizes alone, to exactly the values of
  the whole tensor's dequantize (so the calibration's expert loop sees the model's weights);
* a quantized weight whose amax was not taken from the checkpoint is refused, by name;
* ``calibrate.weights_resident`` takes the documented values only (one-line error otherwise).
"""

from __future__ import annotations

import pytest
import torch

from qckpt.calib.instrument import calibrate_weights, insert_quantizers, remove_quantizers
from qckpt.calib.weight_amax import CheckpointWeightAmax
from qckpt.convert.dcp import save_model_dcp
from qckpt.errors import CalibrationError, RecipeError
from qckpt.formats import quantize
from qckpt.formats.tensor import select_dequantized
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.models.quantize_params import quantize_model_params
from qckpt.recipe import QuantConfig, TensorQuantConfig, recipe_from_dict

IGNORE = ["lm_head", "*.mlp.gate"]


def _quant(granularity: str) -> QuantConfig:
    return QuantConfig(weights=TensorQuantConfig(granularity=granularity, block_size=[32, 32]))


def _bf16_weight_amax(model, q: QuantConfig) -> dict[str, torch.Tensor]:
    qs = insert_quantizers(model, q)
    try:
        calibrate_weights(model)
    finally:
        remove_quantizers(model)
    return {k: v.amax for k, v in qs.items() if k.endswith(".weight_amax")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    path = tmp_path_factory.mktemp("resident_weights") / "dcp"
    save_model_dcp(model, path)
    return model, path


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_tap_weight_amax_equals_bf16_weights(ckpt, fmt, granularity):
    bf16, path = ckpt
    q = _quant(granularity)
    want = _bf16_weight_amax(bf16, q)
    model = build_model("tiny-moe", dtype="bfloat16", seed=99)  # other values: the load fills it
    assert quantize_model_params(model, fmt, ignore=IGNORE)
    tap = CheckpointWeightAmax(model, q)
    load_checkpoint(model, path, tap=tap)
    got = tap.amax()
    assert sorted(got) == sorted(want) and len(got) == 2 * (4 + 3 * 8)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # and the calibrator takes them instead of the (re-quantized) weights
    qs = insert_quantizers(model, q)
    try:
        calibrate_weights(model, got)
        assert all(torch.equal(qs[k].amax, want[k]) for k in want)
    finally:
        remove_quantizers(model)


def test_quantized_weight_without_checkpoint_amax_is_refused():
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    quantize_model_params(model, "fp8", ignore=IGNORE)
    insert_quantizers(model, _quant("tensor"))
    try:
        with pytest.raises(CalibrationError, match=r"q_proj\.weight_amax: the weight .* quantized"):
            calibrate_weights(model)
    finally:
        remove_quantizers(model)


@pytest.mark.parametrize(
    ("fmt", "opts"),
    [
        ("fp8", {}),
        ("fp8", {"granularity": "channel"}),
        ("fp8_delayed", {}),
        ("fp8_block", {"block_size": (32, 32)}),
        ("mxfp8", {}),
        ("nvfp4", {}),
    ],
)
def test_one_expert_dequantizes_alone_to_the_whole_tensors_values(fmt, opts):
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(4, 48, 64, generator=g).to(torch.bfloat16) * torch.tensor(
        [0.1, 1.0, 10.0, 0.01]
    ).view(4, 1, 1).to(torch.bfloat16)
    q = quantize(fused, fmt, **opts)
    whole = q.dequantize(torch.bfloat16)
    for e in range(4):
        one = select_dequantized(q, e)
        assert one.dtype == torch.bfloat16 and tuple(one.shape) == (48, 64)
        assert torch.equal(one, whole[e]), (fmt, e)
    # a plain tensor: the view transformers' loop takes
    assert select_dequantized(fused, 2).data_ptr() == fused[2].data_ptr()


def test_two_dim_block_tensor_falls_back_to_a_whole_dequantize():
    x = torch.randn(64, 64).to(torch.bfloat16)
    q = quantize(x, "fp8_block", block_size=(32, 32))
    assert torch.equal(select_dequantized(q, 3), q.dequantize(torch.bfloat16)[3])


def test_weights_resident_values():
    assert recipe_from_dict({}).calibrate.weights_resident == "bf16"
    r = recipe_from_dict({"calibrate": {"weights_resident": "fp8_block"}})
    assert r.calibrate.weights_resident == "fp8_block"
    with pytest.raises(RecipeError, match=r"^calibrate\.weights_resident: must be one of") as e:
        recipe_from_dict({"calibrate": {"weights_resident": "nvfp4"}})
    assert "\n" not in str(e.value)


def test_tap_refuses_a_weight_delivered_twice(ckpt):
    bf16, _ = ckpt
    tap = CheckpointWeightAmax(bf16, _quant("tensor"))
    w = bf16.model.layers[0].self_attn.q_proj.weight.detach()
    tap("model.layers.0.self_attn.q_proj.weight", w)
    with pytest.raises(
        CalibrationError, match="q_proj.weight: the load delivered this weight twice"
    ):
        tap("model.layers.0.self_attn.q_proj.weight", w)
    tap("model.norm.weight", w)  # a parameter no weight quantizer reads: ignored
    assert list(tap.amax()) == ["model.layers.0.self_attn.q_proj.weight_amax"]
