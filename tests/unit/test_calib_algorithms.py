"""Calibration algorithms as registered objects (``qckpt.calib.algorithms``): a recipe's
``calibrate`` keys become one object's options, each algorithm's constraints give their one
line, and ``calibrate_model`` takes the object."""

from __future__ import annotations

import pytest

from qckpt.calib.algorithms import ALGORITHMS, Awq, Gptq, algorithm_from
from qckpt.calib.calibrate import check_algorithm
from qckpt.errors import CalibrationError
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import recipe_from_dict


def test_every_recipe_algorithm_is_registered_with_its_options():
    assert sorted(ALGORITHMS) == ["awq", "gptq", "max", "mse"]
    c = recipe_from_dict(
        {"calibrate": {"algorithm": "gptq", "gptq_percdamp": 0.05, "gptq_block_scales": "mse"}}
    ).calibrate
    g = algorithm_from(c)
    assert isinstance(g, Gptq) and g.percdamp == 0.05 and g.block_scales == "mse"
    assert g.options().block_search and g.sidecar == ".gptq"
    a = algorithm_from(
        recipe_from_dict({"calibrate": {"algorithm": "awq", "awq_scales": "pow2"}}).calibrate
    )
    assert isinstance(a, Awq) and a.scales == "pow2" and a.grid == 20


@pytest.mark.parametrize(
    ("algo", "mesh", "runner", "message"),
    [
        ("gptq", Mesh(tp=2, world_size=2), None, r"^calibrate\.algorithm: gptq runs with "
         r"parallel\.tp: 1 \(got tp 2\)$"),
        ("mse", Mesh(), object(), r"^calibrate\.algorithm: mse runs with calibrate\.offload: "
         r"none \(max and gptq run one layer at a time\)$"),
        ("nope", Mesh(), None, r"^calibrate\.algorithm: 'nope' is not one of max, mse, gptq, awq$"),
    ],
)  # fmt: skip
def test_an_algorithm_refuses_what_it_cannot_run_in_one_line(algo, mesh, runner, message):
    with pytest.raises(CalibrationError, match=message):
        check_algorithm(algo, mesh, runner)


def test_max_and_gptq_run_one_layer_at_a_time():
    assert check_algorithm("max", Mesh(tp=2, world_size=2), object()).name == "max"
    assert check_algorithm(Gptq(percdamp=0.1), Mesh(), object()).percdamp == 0.1


def test_the_public_calibrate_model_refuses_a_sidecar_algorithm_object():
    from qckpt import calibrate_model
    from qckpt.errors import UsageError

    with pytest.raises(UsageError, match="algorithm must be max or mse, got 'gptq'"):
        calibrate_model(None, [], None, algorithm=Gptq())
