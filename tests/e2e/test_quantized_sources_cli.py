"""A DeepSeek-style blockwise-FP8 model as a user feeds it to qckpt: calibrate -> export to
per-tensor FP8 (compressed-tensors, loaded by transformers) and to NVFP4 (ModelOpt), with logits
close to the dequantized model; ``convert --to hf`` dequantizes it; an unknown quantized layout
is refused with one line and exit 1.

The dequantized model is what ``qckpt convert --to hf`` writes, loaded by transformers; the
NVFP4 export is read back through qckpt's ModelOpt source reader (transformers does not
dequantize ModelOpt checkpoints). The FP8 chain runs the CLI; the NVFP4 one the same library
calls in this process (CLI start-ups cost seconds each on shared CPUs).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests import quantized_fixtures as fx
from tests.conftest import run_qckpt

RECIPE = """\
model: {{source: {src}, dtype: bfloat16}}
checkpoint: {{path: {src}}}
load: {{params: none}}
quant:
  weights: {{format: {fmt}, granularity: tensor}}
  inputs: {{format: {fmt}, granularity: tensor, dynamic: false}}
  ignore: ["lm_head", "*.mlp.gate"]
calibrate:
  data: {{source: synthetic, num_samples: 8, seq_len: 32, batch_size: 4}}
  output: {out}/calib-{fmt}.safetensors
parallel: {{timeout_s: 60}}
export: {{format: {layout}, output: {out}/{fmt}}}
"""


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(7))


def _logits(model) -> torch.Tensor:
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        return model(_ids()).logits.float().reshape(-1, 256)


def _cosine(model, ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(_logits(model), ref, dim=-1)


def _ok(res) -> None:
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.timeout(600)
def test_blockwise_fp8_source_calibrates_exports_and_converts(tmp_path):
    from transformers import AutoModelForCausalLM

    from qckpt import build_model, calibrate_model, init_mesh, load_checkpoint
    from tests.export_fixtures import calib_inputs, quant_config, run_export

    src = fx.blockwise_fp8(fx.bf16_dir(tmp_path), tmp_path / "bw", (32, 32))
    _ok(run_qckpt("convert", str(src), str(tmp_path / "deq"), "--to", "hf"))
    ref = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "deq"))
    # per-tensor FP8 as a user runs it: the CLI, then transformers (compressed-tensors, CPU)
    recipe = tmp_path / "fp8.yaml"
    recipe.write_text(RECIPE.format(src=src, out=tmp_path, fmt="fp8", layout="compressed-tensors"))
    _ok(run_qckpt("calibrate", str(recipe)))
    _ok(run_qckpt("export", str(recipe)))
    cos = _cosine(AutoModelForCausalLM.from_pretrained(tmp_path / "fp8"), ref)
    assert float(cos.min()) >= 0.99, float(cos.min())

    # NVFP4 (ModelOpt) through the same library calls, in this process
    model = build_model(str(src), dtype="bfloat16")
    load_checkpoint(model, src)
    q = quant_config(fmt="nvfp4")
    q.ignore = ["lm_head", "*.mlp.gate"]
    state, _ = calibrate_model(model, calib_inputs(), q, init_mesh(ep=1, tp=1, timeout_s=60))
    run_export(model, src, state, tmp_path / "nvfp4", q, fmt="modelopt", source_dir=src)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "deq")
    assert load_checkpoint(model, tmp_path / "nvfp4").source_layout == "modelopt (NVFP4)"
    cos = _cosine(model, ref)
    # 4-bit weights on a random-init model with nearly flat logits: every position >= 0.98,
    # their mean >= 0.99
    assert float(cos.mean()) >= 0.99 and float(cos.min()) >= 0.98, cos


def test_unknown_quantized_layout_exits_1_with_one_line(tmp_path):
    src = fx.bf16_dir(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with safe_open(str(bad / "model.safetensors"), "pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    t["model.layers.1.mlp.experts.3.up_proj.weight_scale"] = torch.ones(1)
    save_file(t, str(bad / "model.safetensors"))
    before = (bad / "model.safetensors").read_bytes()
    res = run_qckpt("convert", str(bad), str(tmp_path / "out"), "--to", "hf")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown quantized layout" in lines[0], res.stderr
    assert "up_proj.weight_scale" in lines[0] and "no quantization_config" in lines[0]
    assert not (tmp_path / "out").exists()
    assert (bad / "model.safetensors").read_bytes() == before
    # inspect describes it instead of failing, and says why it is refused as a source
    res = run_qckpt("inspect", str(bad), "--json", str(tmp_path / "i.json"))
    assert res.returncode == 0, res.stderr
    info = json.loads((tmp_path / "i.json").read_text())
    assert info["source_layout"]["layout"] == "unknown"
    assert "unknown quantized layout" in info["source_layout"]["refused"]
