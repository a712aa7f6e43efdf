"""A mixed recipe (``quant.schemes``) in calibration, on the tiny MoE: each linear's quantizers
are its own scheme's (format, granularity, amax shape), the file records the recipe's schemes,
and a recipe that splits a fused group is refused before any data runs (exit 2)."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.data import calibration_batches
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import recipe_from_dict

DATA = {"source": "synthetic", "num_samples": 4, "seq_len": 16, "batch_size": 2}
# NVFP4 routed experts; FP8 block weights with dynamic per-group inputs for q/k/v; FP8 per
# channel with static inputs for o_proj; lm_head matched by nothing (the model dtype)
MIXED = {
    "ignore": ["*.mlp.gate"],
    "schemes": [
        {
            "targets": ["*.mlp.experts.*"],
            "weights": {"format": "nvfp4"},
            "inputs": {"format": "nvfp4"},
        },
        {
            "targets": ["*.q_proj", "*.k_proj", "*.v_proj"],
            "weights": {"format": "fp8", "granularity": "block", "block_size": [32, 32]},
            "inputs": {
                "format": "fp8",
                "granularity": "block",
                "block_size": [1, 32],
                "dynamic": True,
            },
        },  # fmt: skip
        {
            "targets": ["*.o_proj"],
            "weights": {"format": "fp8", "granularity": "channel"},
            "inputs": {"format": "fp8", "granularity": "tensor"},
        },
    ],
}


def _recipe(quant: dict, **cal):
    return recipe_from_dict({"quant": quant, "calibrate": {"data": DATA, **cal}})


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-moe", dtype="bfloat16", seed=0)


def _calibrate(model, r):
    from qckpt.pipeline.calibrate import algorithm_of

    batches = calibration_batches(r.calibrate.data, vocab_size=256)
    return calibrate_model(model, batches, r.quant, Mesh(), algorithm=algorithm_of(r))


@pytest.mark.parametrize("algorithm", ["max", "gptq"])
def test_each_linear_gets_its_own_schemes_quantizers(model, algorithm):
    extra = {"gptq_inputs": "quantized"} if algorithm == "gptq" else {}
    r = _recipe(MIXED, algorithm=algorithm, **extra)
    state, report = _calibrate(model, r)
    q, amax = state.quantizers, state.amax
    L = "model.layers.0"
    e = f"{L}.mlp.experts.3.gate_proj"
    assert q[f"{e}.weight_amax"]["format"] == "nvfp4"
    assert q[f"{e}.weight_amax"]["granularity"] == "dynamic_block"
    assert amax[f"{e}.weight_amax"].shape == ()
    assert q[f"{e}.input_amax"]["format"] == "nvfp4" and q[f"{e}.input_amax"]["enabled"]
    qp = f"{L}.self_attn.q_proj"
    w = model.get_submodule(qp).weight
    assert q[f"{qp}.weight_amax"]["format"] == "fp8"
    assert q[f"{qp}.weight_amax"]["block_size"] == [32, 32]
    assert tuple(amax[f"{qp}.weight_amax"].shape) == (-(-w.shape[0] // 32), -(-w.shape[1] // 32))
    assert not q[f"{qp}.input_amax"]["enabled"]  # dynamic: nothing calibrated
    assert f"{qp}.input_amax" not in amax
    op = f"{L}.self_attn.o_proj"
    assert q[f"{op}.weight_amax"]["granularity"] == "channel"
    assert tuple(amax[f"{op}.weight_amax"].shape) == (model.get_submodule(op).weight.shape[0],)
    assert amax[f"{op}.input_amax"].shape == () and float(amax[f"{op}.input_amax"]) > 0
    assert not any(k.startswith("lm_head.") for k in q)  # no scheme: the model dtype
    assert len(state.quant["schemes"]) == 3  # the file records the recipe's schemes
    if algorithm == "gptq":
        rows = [row["gptq"] for row in report["layers"].values() if "gptq" in row]
        assert len(rows) == 2 and all(r["loss_gptq"] < r["loss_rtn"] for r in rows)
        names = set(state.weights)
        assert f"{e}.weight_block_scale" in names  # NVFP4: its GPTQ'd block scales
        assert f"{qp}.weight" in names and f"{qp}.weight_block_scale" not in names
        assert not any(n.startswith("lm_head.") for n in names)


def test_one_scheme_records_no_schemes(model):
    r = _recipe({"weights": {"format": "fp8"}, "inputs": {"format": "fp8"}})
    state, _ = _calibrate(model, r)
    assert "schemes" not in state.quant


def test_a_split_fused_group_is_refused_before_any_data(model):
    from qckpt.errors import SchemeError

    split = {
        "schemes": [
            {"targets": ["*.q_proj"], "weights": {"format": "nvfp4"},
             "inputs": {"format": "nvfp4"}},
            {"targets": ["*.k_proj", "*.v_proj"]},
        ]
    }  # fmt: skip
    r = _recipe(split)

    class NoData(list):
        def __iter__(self):
            raise AssertionError("data ran before the recipe was checked")

    with pytest.raises(SchemeError, match=r"q_proj .* and .*k_proj") as err:
        calibrate_model(model, NoData([torch.zeros(1, 4, dtype=torch.long)]), r.quant, Mesh())
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
