"""The large-model plans of docs/SCALING.md: every recipe under configs/models/ plans (from its
config.json alone, no checkpoint), and the per-rank figures follow from the published
architecture numbers, computed here independently of the model build."""

from __future__ import annotations

import json

import pytest

from qckpt.pipeline.plan import plan
from qckpt.recipe import load_recipe
from tests.conftest import ROOT

MODELS = sorted(p.parent.name for p in (ROOT / "configs" / "models").glob("*/plan.yaml"))


def _recipe(name: str, *sets: str):
    return load_recipe(ROOT / "configs" / "models" / name / "plan.yaml", list(sets))


def _expert_bytes(cfg: dict) -> int:
    """BF16 bytes of the routed experts: gate, up and down of every expert in every MoE layer."""
    experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    return 3 * experts * cfg["hidden_size"] * cfg["moe_intermediate_size"] * moe_layers * 2


def test_every_model_config_has_a_plan():
    assert {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2"} <= set(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_ep8_holds_an_eighth_of_the_experts(monkeypatch, name):
    monkeypatch.chdir(ROOT)  # the recipes name their config dir relative to the repo root
    cfg = json.loads((ROOT / "configs" / "models" / name / "config.json").read_text())
    one = plan(_recipe(name), nproc_per_node=8)
    ep8 = plan(_recipe(name, "parallel.ep=8"), nproc_per_node=8)
    whole = one.model["bytes"]
    experts = _expert_bytes(cfg)
    for row in ep8.rows["calibrate"]:  # BF16-resident weights: the model's own bytes
        assert row.bytes_read == whole - experts + experts // 8
        # non-persistent buffers (rotary tables) are held but never read
        assert 0 <= row.parameter_bytes - row.bytes_read < 2**20
    assert all(r.parameter_bytes < one.rows["load"][0].parameter_bytes for r in ep8.rows["load"])


def test_deepseek_v3_on_two_nodes_of_h200(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = _recipe("deepseek-v3", "parallel.ep=16")
    res = plan(r, nproc_per_node=8, nnodes=2, device_bytes=141 * 10**9, suggest=False)
    assert res.world_size == 16 and len(res.rows["load"]) == 16
    assert res.model["parameters"] == pytest.approx(671.0e9, rel=1e-3)
    assert res.fits("load") and res.fits("calibrate")
    # BF16-resident calibration of 671 B parameters does not fit 8 GPUs: fp8 resident does
    one_node = plan(_recipe("deepseek-v3"), nproc_per_node=8, device_bytes=141 * 10**9)
    sug = one_node.suggestions["calibrate"]
    assert sug is not None and sug.ep == 8 and sug.resident != "bf16"


def test_kimi_k2_on_one_node_calibrates_layer_by_layer(monkeypatch):
    monkeypatch.chdir(ROOT)
    # 1 T parameters, two scratches of its largest fused experts (22.5 GB each) in flight: even
    # FP8-resident over EP8 is past 139 GiB a GPU; host offload would need the host memory,
    # not given: the suggestion reads one layer at a time, each expert once
    sets = ("parallel.ep=8", "load.max_inflight=2")
    res = plan(_recipe("kimi-k2", *sets), nproc_per_node=8, device_bytes=139 * 2**30)
    assert res.fits("load") and not res.fits("calibrate")
    sug = res.suggestions["calibrate"]
    assert (sug.offload, sug.activations, sug.ep, sug.resident) == ("layer", "device", 8, "bf16")
    # at the default max_inflight (1) one scratch less: FP8-resident weights over EP8 fit
    res = plan(_recipe("kimi-k2", "parallel.ep=8"), nproc_per_node=8, device_bytes=139 * 2**30)
    sug = res.suggestions["calibrate"]
    assert (sug.offload, sug.ep, sug.resident) == ("none", 8, "fp8")
