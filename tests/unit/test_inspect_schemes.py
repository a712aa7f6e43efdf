"""``qckpt inspect`` of a mixed export: each compressed-tensors ``config_groups`` entry's scheme
with the linears it holds, and each ModelOpt ``quant_algo`` of a ``MIXED_PRECISION`` export."""

from __future__ import annotations

import json

from qckpt.inspect import export_schemes
from qckpt.summary import inspect_summary

EXPERTS = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
           for p in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
ATTN = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj")]


def _entries(packed: list[str], fp8: list[str]) -> dict[str, dict]:
    out = {f"{m}.weight_packed": {} for m in packed} | {f"{m}.weight": {} for m in fp8}
    out |= {f"{m}.weight_scale": {} for m in packed + fp8}
    return out | {"lm_head.weight": {}, "model.layers.0.mlp.gate.weight": {}}


def test_compressed_tensors_groups_say_their_scheme_and_linears(tmp_path):
    nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    fp8_block = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
    groups = {
        "group_0": {
            "targets": [r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.[^.]+$"],
            "weights": {**nvfp4, "dynamic": False},
            "input_activations": {**nvfp4, "dynamic": "local"},
        },
        "group_1": {
            "targets": ["Linear"],
            "weights": {**fp8_block, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                  "dynamic": True},
        },
    }  # fmt: skip
    qc = {"quant_method": "compressed-tensors", "config_groups": groups, "ignore": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    got = export_schemes(tmp_path, _entries(EXPERTS, ATTN))
    assert got == {
        "group_0": "NVFP4 tensor_group static weights, NVFP4 tensor_group static inputs: "
        "24 linears",
        "group_1": "FP8 block 128x128 static weights, FP8 group dynamic inputs: 4 linears",
    }
    line = inspect_summary({"kind": "export", "schemes": got}, "x")[1]
    assert "group_0=NVFP4 tensor_group static weights" in line and ": 4 linears" in line


def test_modelopt_mixed_precision_counts_each_algo(tmp_path):
    layers = {m: {"quant_algo": "NVFP4", "group_size": 16} for m in EXPERTS}
    layers |= {m: {"quant_algo": "FP8"} for m in ATTN}
    q = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": q}))
    got = export_schemes(tmp_path, _entries(EXPERTS, ATTN))
    assert got == {"NVFP4": "24 linears", "FP8": "4 linears"}


def test_a_one_scheme_modelopt_export_counts_its_quantized_linears(tmp_path):
    q = {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": q}))
    assert export_schemes(tmp_path, _entries([], ATTN)) == {"FP8": "4 linears"}
    (tmp_path / "plain").mkdir()
    assert export_schemes(tmp_path / "plain", {}) == {}
