"""compressed-tensors exports load in Hugging Face transformers and stay close to the BF16 model.

Pipeline as a user runs it: a BF16 model saved with ``save_pretrained``, calibrated with qckpt's
own calibrator (``calibrate_model``), exported with ``export_checkpoint``, loaded with
``AutoModelForCausalLM.from_pretrained`` (compressed-tensors installed, CPU).

Measures (4 sequences x 24 positions, random-init tiny models whose logits are nearly flat):
* cosine of the next-token logits, every position: min >= 0.99;
* top-1 agreement over all positions >= 0.85 (near-ties flip under any quantization);
* every quantized linear's loaded weight (fused experts included, which proves each expert's
  scale was applied) within 5 % relative Frobenius error of the BF16 weight; embeddings, norms,
  the router and lm_head (ignored) bit-identical.

Block weights: tiny-moe uses 128x128 blocks (one padded block per expert: transformers 5.24
dequantizes FP8 experts with ``weight * scale`` and cannot broadcast a multi-block scale onto a
fused expert), tiny-dense uses 32x32 blocks (several per weight). Inputs per group of 32 because
the clients need the group to divide the hidden size 64.
"""

from __future__ import annotations

import json

import pytest
import torch

from qckpt import calibrate_model, init_mesh
from tests.export_fixtures import (
    calib_inputs,
    hf_state,
    quant_config,
    run_export,
    saved_model,
)

CASES = {
    "tensor": ("tensor", "static", (128, 128)),
    "channel": ("channel", "token", (128, 128)),
    "block": ("block", "group", None),  # block size per model, see the module doc
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("export_clients")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("source", ["tiny-moe", "tiny-dense"])
def test_compressed_tensors_export_loads_in_transformers(root, source, case):
    from transformers import AutoModelForCausalLM

    model, hf_dir = saved_model(root, source)
    weights, inputs, block = CASES[case]
    if block is None:
        block = (128, 128) if source == "tiny-moe" else (32, 32)
    q = quant_config(weights, inputs, block, group=32)
    state, _ = calibrate_model(model, calib_inputs(), q, init_mesh(ep=1, tp=1, timeout_s=60))
    out = root / f"{source}-{case}"
    report = run_export(model, hf_dir, state, out, q, source_dir=hf_dir)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    group = cfg["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == weights
    assert (
        group["input_activations"]["strategy"]
        == {"static": "tensor", "token": "token", "group": "group"}[inputs]
    )
    assert report.quantized_linears == (8 + 2 * 8 * 3 if source == "tiny-moe" else 2 * 7)

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    loaded.eval()
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids).logits.float()
        got = loaded(ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(
        f"\n{source} {case}: min cos {cos.min().item():.4f} mean cos {cos.mean().item():.4f} top1 {agree:.3f}"
    )
    assert cos.min().item() >= 0.99
    assert agree >= 0.85

    want = model.state_dict()
    have = loaded.state_dict()
    quantized = 0
    for name, w in want.items():
        g = have[name]
        is_linear = (
            name.endswith(("proj.weight", "gate_up_proj", "down_proj")) and "norm" not in name
        )
        if is_linear:
            rel = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert 0 < rel <= 0.05, (name, rel)
            quantized += 1
        else:
            assert torch.equal(g, w), name
    assert quantized == (2 * 6 if source == "tiny-moe" else 2 * 7)
    # every expert carries its own input scale in the file (vLLM reads them; #45212)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    expert_weights = [k for k in hf_state(model) if ".experts." in k]
    for k in expert_weights:
        assert k.replace(".weight", ".weight_scale") in index
        if inputs == "static":
            assert k.replace(".weight", ".input_scale") in index
