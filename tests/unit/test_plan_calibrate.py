"""``qckpt plan``'s calibrate figures against what ``calibrate`` reports (one rank, in process):
the parameters a quantized-resident calibration holds."""

from __future__ import annotations

import pytest

from qckpt.convert.dcp import save_model_dcp
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.calibrate import calibrate
from qckpt.pipeline.plan import plan
from qckpt.recipe import load_recipe
from tests.conftest import ROOT

RECIPE = str(ROOT / "configs" / "tiny-moe.yaml")


@pytest.fixture(scope="module")
def dcp(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-cal")
    save_model_dcp(build_model("tiny-moe", seed=0), d / "dcp")
    return d


def _buffers(source: str) -> int:
    model = build_model(source, seed=0)
    return sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("resident", ["bf16", "fp8_block"])
def test_resident_weights_are_predicted_exactly(dcp, resident):
    r = load_recipe(
        RECIPE,
        [
            f"checkpoint.path={dcp / 'dcp'}",
            f"calibrate.weights_resident={resident}",
            f"calibrate.output={dcp / resident}.safetensors",
        ],
    )
    got = calibrate(r, Mesh())
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    # the report counts parameters; a rank also holds its buffers (the rotary table)
    assert row.parameter_bytes == got.report["param_bytes"] + _buffers("tiny-moe")
    bf16 = plan(load_recipe(RECIPE, [f"checkpoint.path={dcp / 'dcp'}"]), nproc_per_node=1)
    if resident != "bf16":
        assert row.parameter_bytes < 0.7 * bf16.rows["calibrate"][0].parameter_bytes


@pytest.mark.parametrize("activations", ["device", "host"])
def test_layer_offload_is_predicted_exactly(dcp, activations):
    r = load_recipe(
        RECIPE,
        [
            f"checkpoint.path={dcp / 'dcp'}",
            "calibrate.offload=layer",
            f"calibrate.activations={activations}",
            f"calibrate.output={dcp / activations}.safetensors",
        ],
    )
    got = calibrate(r, Mesh()).report["offload"]
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    # weights on the device at most: outside the layers plus two adjacent layers
    assert row.parameter_bytes == got["outer_weight_bytes"] + got["layer_weight_bytes_peak"]
    assert row.bytes_read == got["bytes_read"]
    if activations == "device":
        assert row.activation_bytes == got["activation_bytes"] > 0
    else:  # on CPU the runner keeps them where they are: nothing to move them off
        assert row.activation_bytes == 0
        assert row.host_bytes == got["activation_bytes"]
