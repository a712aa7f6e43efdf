"""``qckpt eval`` on a MoE export with FP8 KV-cache scales (the built-in tiny Qwen3-MoE, random
weights): fused experts emulated per expert with the layer's shared input scales, KV scales
applied, and the figures of an FP8 export close to the source's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import run_qckpt


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory) -> tuple[Path, Path, Path]:
    from qckpt import build_model

    tmp = tmp_path_factory.mktemp("eval-moe")
    src = tmp / "src"
    build_model("tiny-moe", seed=0).save_pretrained(src)
    data = tmp / "heldout.bin"
    data.write_bytes(
        bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).tolist())
    )
    recipe = tmp / "r.yaml"
    recipe.write_text(
        f"""
model: {{source: {src}}}
checkpoint: {{path: {src}}}
quant:
  weights: {{format: fp8, granularity: tensor}}
  inputs: {{format: fp8, granularity: tensor, dynamic: false}}
  kv_cache: true
calibrate:
  data: {{source: synthetic, num_samples: 16, seq_len: 64, batch_size: 4}}
  output: {tmp / "calib.safetensors"}
export: {{format: compressed-tensors, output: {tmp / "fp8"}, moe_scales: per_expert}}
eval: {{path: {data}, windows: 4, seq_len: 64}}
"""
    )
    for cmd in ("calibrate", "export"):
        r = run_qckpt(cmd, str(recipe))
        assert r.returncode == 0, r.stderr[-2000:]
    return src, tmp / "fp8", data


def test_moe_experts_and_kv_scales_are_emulated(moe_export):
    from qckpt import EvalOptions, evaluate_export

    src, exp, data = moe_export
    rep = evaluate_export(exp, src, data, EvalOptions(windows=4, seq_len=64))
    assert rep["emulated"] == {"linears": 8, "experts": 16, "kv_cache_layers": 2}
    assert rep["scheme"]["input_quantization"] == {"fp8 static per-tensor": 8 + 2 * 8 * 3}
    # random weights: flat next-token distributions, so top-1 flips easily; KL is the figure
    assert rep["kl_mean"] < 0.01 and rep["top1_agreement"] > 0.5
    assert abs(rep["relative_increase"]) < 0.01


def test_expert_input_scales_are_shared_per_layer_as_vllm_shares_them(moe_export):
    from qckpt.evaluate.scheme import read_scheme

    _, exp, _ = moe_export
    scheme = read_scheme(exp)
    stored = {}
    with safe_open(str(next(exp.glob("*.safetensors"))), "pt") as f:
        for k in f.keys():
            if ".experts." in k and k.endswith(".input_scale"):
                stored[k[: -len(".input_scale")]] = f.get_tensor(k).float().reshape(())
    pre = "model.layers.0.mlp.experts"
    gate_up = [v for m, v in stored.items() if m.startswith(pre) and not m.endswith("down_proj")]
    down = [v for m, v in stored.items() if m.startswith(pre) and m.endswith("down_proj")]
    assert len(set(float(v) for v in gate_up)) > 1  # per_expert: the file's scales differ
    for e in range(8):
        for proj in ("gate_proj", "up_proj"):
            assert float(scheme.inputs[f"{pre}.{e}.{proj}"].scale) == max(map(float, gate_up))
        assert float(scheme.inputs[f"{pre}.{e}.down_proj"].scale) == max(map(float, down))
    assert set(scheme.kv) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_layer_by_layer_gives_the_resident_figures_bit_for_bit(moe_export):
    from qckpt import EvalOptions, evaluate_export

    src, exp, data = moe_export
    kw = {"windows": 4, "seq_len": 64, "batch_size": 2}
    a = evaluate_export(exp, src, data, EvalOptions(**kw))
    b = evaluate_export(exp, src, data, EvalOptions(**kw, offload="layer"))
    keys = ("source_bits_per_byte", "export_bits_per_byte", "kl_mean", "top1_agreement")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["layers"] == b["layers"] and a["emulated"] == b["emulated"]
