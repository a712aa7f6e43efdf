"""``qckpt plan`` next to a real ``qckpt load --nproc-per-node 2`` with EP2 (gloo): every rank's
predicted parameter bytes and bytes read equal that rank's row of the load's --json, and the
predicted transient equals the load report's own prediction."""

from __future__ import annotations

import json

import pytest

from qckpt import build_model
from tests.conftest import ROOT, run_qckpt

pytestmark = pytest.mark.timeout(300)


def test_plan_predicts_each_rank_of_a_real_ep2_load(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    model = build_model("tiny-moe", seed=0)
    model.save_pretrained(tmp_path / "hf")
    sets = ["--set", f"checkpoint.path={tmp_path / 'hf'}", "--set", "parallel.ep=2"]
    r = run_qckpt(
        "load", recipe, *sets, "--nproc-per-node", "2", "--json", str(tmp_path / "l.json")
    )
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_qckpt(
        "plan", recipe, *sets, "--nproc-per-node", "2", "--json", str(tmp_path / "p.json")
    )
    assert r.returncode == 0, r.stderr[-2000:]
    run = json.loads((tmp_path / "l.json").read_text())["runs"][0]
    rows = json.loads((tmp_path / "p.json").read_text())["commands"]["load"]
    # the load's param_bytes counts its state dict; a rank also holds the rotary table
    rotary = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    assert len(run["ranks"]) == len(rows) == 2
    for got in run["ranks"]:
        row = rows[got["rank"]]
        assert row["parameter_bytes"] == got["param_bytes"] + rotary
        assert row["bytes_read"] == got["bytes_read"]
        assert got["transient_bytes"] <= row["transient_bytes"]
    assert rows[0]["transient_bytes"] == run["predicted_transient_bytes"]
