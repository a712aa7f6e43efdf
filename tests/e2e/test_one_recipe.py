"""One recipe serves every command (issue 30): a recipe made for ``calibrate`` over EP ranks
exports as it is, and ``--nproc-per-node`` is checked against the GPUs before any rank starts."""

from __future__ import annotations

import json

import pytest

from tests._inproc import run_main
from tests.conftest import ROOT

RECIPE = str(ROOT / "configs" / "tiny-moe.yaml")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    run = tmp_path_factory.mktemp("one-recipe")
    sets = ["--set", f"checkpoint.path={run}/dcp", "--set", f"calibrate.output={run}/c.safetensors"]
    r = run_main("convert", RECIPE, f"{run}/dcp", *sets, cwd=run)
    assert r.returncode == 0, r.stderr
    r = run_main("calibrate", RECIPE, *sets, cwd=run)
    assert r.returncode == 0, r.stderr
    return run, sets


def test_an_ep_recipe_exports_in_one_process(calibrated):
    run, sets = calibrated
    out = run / "fp8-ep"
    r = run_main(
        "export", RECIPE, *sets, "--set", "parallel.ep=2", "--set", f"export.output={out}",
        "--json", str(run / "e.json"), cwd=run,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file()
    assert json.loads((run / "e.json").read_text())["world_size"] == 1


def test_plan_still_takes_the_recipe_as_it_is(calibrated):
    run, sets = calibrated
    r = run_main("plan", RECIPE, *sets, "--set", "parallel.ep=2", "--nproc-per-node", "3", cwd=run)
    assert r.returncode == 2
    assert "parallel.ep: must divide the world size 3" in r.stderr


@pytest.mark.parametrize("cmd", ["load", "calibrate"])
def test_more_ranks_than_gpus_is_one_line_before_any_rank(calibrated, monkeypatch, cmd):
    run, sets = calibrated
    monkeypatch.setattr("qckpt.cli._common.visible_gpus", lambda *a, **k: 1)
    r = run_main(cmd, RECIPE, *sets, "--nproc-per-node", "2", cwd=run)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [
        "qckpt: error: --nproc-per-node 2: only 1 GPU(s) visible here and each rank needs its "
        "own; use --nproc-per-node 1 or less, or --set load.device=cpu"
    ]


def test_export_ranks_share_the_gpu_and_say_so(calibrated, monkeypatch):
    run, sets = calibrated
    monkeypatch.setattr("qckpt.cli._common.visible_gpus", lambda *a, **k: 1)
    out = run / "fp8-shared"
    r = run_main(
        "export", RECIPE, *sets, "--set", f"export.output={out}", "--nproc-per-node", "2",
        "--set", "parallel.ep=2", cwd=run,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "2 ranks share 1 GPU(s)" in r.stderr
    assert (out / "config.json").is_file()
