"""Whole-command device peaks on a GPU (issue 17): ``qckpt load`` on CUDA reports the allocator's
never-reset peak, which holds the load window's peak and what the loaded model keeps."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ROOT, run_qckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_load_on_cuda_reports_whole_command_device_peaks(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-moe.yaml")
    sets = ["--set", "checkpoint.path=dcp", "--set", "load.device=cuda"]
    r = run_qckpt("convert", recipe, "dcp", *sets, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_qckpt("load", recipe, *sets, "--json", "load.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((tmp_path / "load.json").read_text())
    pk, run0 = data["peaks"], data["runs"][0]
    assert pk["device"].startswith("cuda") and run0["device"].startswith("cuda")
    assert pk["device_peak_bytes"] >= run0["peak_bytes"] > 0
    # allocated at report time: the model is already freed, so it may be 0
    assert pk["device_peak_bytes"] >= pk["device_allocated_bytes"] >= 0
    assert pk["device_peak_reserved_bytes"] >= pk["device_peak_bytes"]
    assert {"startup", "build", "read"} <= set(data["phases"])
