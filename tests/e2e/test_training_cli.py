"""A Megatron-Core / torchtitan checkpoint as a user feeds it to the CLI: ``qckpt calibrate``,
then ``qckpt export`` with the same recipe, straight from the training checkpoint.

The export after a calibrate has the calibration file's record of the model (its config as a
dict, ``qckpt.export.model_record``) instead of a transformers config: the training source
takes either. Its export equals, byte for byte, the CLI export of the same weights in Hugging
Face form (the generators of tests/training_fixtures.py write the training layouts from a tiny
HF model's weights) with the same calibration file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.training_fixtures import write_megatron, write_torchtitan

RECIPE = ROOT / "configs" / "tiny-moe.yaml"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny MoE's HF dir (config.json and weights) and its Megatron and torchtitan forms."""
    from qckpt import build_model
    from tests.export_fixtures import hf_state

    root = tmp_path_factory.mktemp("training-cli")
    m = build_model("tiny-moe", dtype="bfloat16", seed=0)
    m.save_pretrained(root / "hf")
    hf = hf_state(m)
    return {
        "hf": root / "hf",
        "megatron": write_megatron(hf, m.config, root / "mc"),
        "torchtitan": write_torchtitan(hf, m.config, root / "tt"),
    }


def _run(*argv: str) -> None:
    from tests._inproc import run_main

    r = run_main(*argv)
    assert r.returncode == 0, (argv, r.stderr[-3000:])


def _sets(kv: dict) -> list[str]:
    return [a for k, v in kv.items() for a in ("--set", f"{k}={v}")]


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_calibrate_then_export_from_a_training_checkpoint(dirs, tmp_path, framework):
    from qckpt.export.model_record import peek, usable

    hf, cal = dirs["hf"], tmp_path / "calib.safetensors"
    common = {"model.source": hf, "load.params": "none", "calibrate.output": cal}
    training = {**common, "checkpoint.path": dirs[framework], "checkpoint.format": framework}
    _run("calibrate", str(RECIPE), *_sets(training))
    # what makes this the path of the bug: export takes the model from the calibration file
    assert usable(peek(cal), str(hf))
    _run("export", str(RECIPE), *_sets({**training, "export.output": tmp_path / "out"}))
    _run(
        "export",
        str(RECIPE),
        *_sets({**common, "checkpoint.path": hf, "export.output": tmp_path / "ref"}),
    )
    got, ref = _files(tmp_path / "out"), _files(tmp_path / "ref")
    assert got.keys() == ref.keys() and any(n.endswith(".safetensors") for n in ref)
    for name, data in ref.items():
        assert got[name] == data, name
