"""Calibrate -> export with every spelling of ``quant.weights.block_size`` the recipe accepts.

``[b]`` once meant 1 x b to the calibrator and b x b to the export, so a whole calibration ran
before the export refused its amaxes. Here each spelling goes through the recipe, the calibrator
and the export of the tiny MoE (dims 32..128, so 16/32 blocks fit), and the written block scales
must have the shape and the values of that block size.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from qckpt import (
    build_model,
    calibrate_model,
    export_checkpoint,
    init_mesh,
    recipe_from_dict,
    save_calibration,
)

Q_PROJ = "model.layers.0.self_attn.q_proj"  # [64, 64]
DOWN = "model.layers.1.mlp.experts.3.down_proj"  # [64, 32]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    d = tmp_path_factory.mktemp("block") / "hf"
    model.save_pretrained(d)
    return model, d


def _block_amax(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    r, c = w.shape
    return w.float().abs().reshape(r // b0, b0, c // b1, b1).amax(dim=(1, 3))


@pytest.mark.parametrize(
    ("spelling", "block"), [([32], (32, 32)), ([32, 32], (32, 32)), ([16, 32], (16, 32))]
)
def test_calibrate_then_export(source, tmp_path, spelling, block):
    model, src = source
    recipe = recipe_from_dict(
        {"quant": {"weights": {"format": "fp8", "granularity": "block", "block_size": spelling}}}
    )
    assert recipe.quant.weights.block_size == list(block)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
    state, _ = calibrate_model(model, batches, recipe.quant, init_mesh(device="cpu"))
    cal = save_calibration(state, tmp_path / "calib.safetensors")
    out = tmp_path / "fp8"
    export_checkpoint(
        source=src,
        calibration=cal,
        output=out,
        model_type=model.config.model_type,
        model_config=model.config,
        quant=recipe.quant,
        export=recipe.export,
    )
    scales = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            scales |= {k: f.get_tensor(k) for k in f.keys() if k.endswith(".weight_scale")}
    sd = model.state_dict()
    q_w = sd[f"{Q_PROJ}.weight"]
    down_w = sd["model.layers.1.mlp.experts.down_proj"][3]
    for module, w in ((Q_PROJ, q_w), (DOWN, down_w)):
        want = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
        got = scales[f"{module}.weight_scale"]
        assert tuple(got.shape) == want, module
        # each block's scale is its own amax / 448 (stored in the model dtype)
        expect = (_block_amax(w, *block) / 448.0).to(got.dtype)
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
