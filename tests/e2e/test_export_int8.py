"""INT8 exports: W8A8 (compressed-tensors ``int-quantized``, int8 inputs per token or per
tensor) and W8A16 (``pack-quantized`` 8-bit), judged against compressed-tensors' own scale
rule, quantize, packing and dequantize; read back as a source; ``qckpt eval`` quantizes the
inputs as vLLM's int8 kernels do; GPTQ's weights written exactly; what no layout takes refused.

The exports run the real commands (convert, calibrate, export) on the tiny Llama; transformers
loading one is ``tests/e2e/test_pipeline.py``'s ``tiny-dense-w8a8`` recipe."""

from __future__ import annotations

import json

import pytest
import torch

from qckpt import EvalOptions, check_export, evaluate_export
from tests._inproc import run_main
from tests.e2e.tiny_exports import export_once, modules_with, tensors_of, tiny_recipe, tiny_root

CHANNEL = {"format": "int8", "granularity": "channel"}
TOKEN = {"format": "int8", "dynamic": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_root(tmp_path_factory.mktemp("int8"), heldout_seed=5)


def test_w8a8_is_what_compressed_tensors_computes(root):
    """Per channel: the stored scale is compressed-tensors' ``calculate_qparams`` of the row's
    min / max (amax / 127.5) in the model dtype, the codes its ``quantize`` of the source
    weight under it, and its ``dequantize`` is what qckpt reads back, bit for bit."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    out = export_once(root, "w8a8", CHANNEL, TOKEN)
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    group = cfg["config_groups"]["group_0"]
    assert cfg["format"] == group["format"] == "int-quantized"
    assert (
        group["weights"] | {"num_bits": 8, "type": "int", "strategy": "channel"}
        == (group["weights"])
    )
    assert (
        group["input_activations"] | {"strategy": "token", "dynamic": True, "type": "int"}
        == (group["input_activations"])
    )
    t, src = tensors_of(out), tensors_of(root / "hf")
    assert not [k for k in t if k.endswith("input_scale")]  # dynamic: nothing calibrated
    r = run_main("convert", str(out), str(root / "back8"), "--to", "hf")
    assert r.returncode == 0 and "14 of 21 tensors dequantized" in r.stdout, r.stdout
    back = tensors_of(root / "back8")
    modules = [m for m in modules_with(t, "weight_scale")]
    assert len(modules) == 14
    for m in modules:
        w = src[f"{m}.weight"].float()
        codes, scale = t[f"{m}.weight"], t[f"{m}.weight_scale"]
        assert codes.dtype == torch.int8 and codes.shape == w.shape, m
        assert scale.dtype == torch.bfloat16 and scale.shape == (w.shape[0], 1), m
        want, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
        assert torch.equal(scale, want.to(torch.bfloat16)), m
        assert torch.equal(codes.float(), quantize(w, scale.float(), zp, args)), m
        value = dequantize(codes, scale.float(), zp, args)
        assert torch.equal(back[f"{m}.weight"], value.to(torch.bfloat16)), m


def test_w8a8_checks_and_evaluates_with_int8_inputs(root):
    out = export_once(root, "w8a8", CHANNEL, TOKEN)
    res = check_export(out)
    assert res.ok and "INT8 channel/dynamic" in res.summary(), res.problems
    opts = EvalOptions(windows=4, seq_len=64)
    rep = evaluate_export(out, root / "hf", root / "heldout.bin", opts)
    assert rep["scheme"]["input_quantization"] == {"int8 dynamic per-token": 14}
    alone = evaluate_export(out, root / "hf", root / "heldout.bin", EvalOptions(
        windows=4, seq_len=64, inputs="unquantized"))  # fmt: skip
    # the inputs' rounding moves the outputs; both stay close to the source
    assert 0 < alone["kl_mean"] < rep["kl_mean"] < 0.01, (alone["kl_mean"], rep["kl_mean"])
    # Ampere / Hopper run int8 GEMMs: as Hopper runs it is as exported
    hop = evaluate_export(out, root / "hf", root / "heldout.bin", EvalOptions(
        windows=4, seq_len=64, inputs="hopper"))  # fmt: skip
    assert hop["export_bits_per_byte"] == rep["export_bits_per_byte"]


def test_static_int8_inputs_store_the_calibrated_scale(root):
    """Static per-tensor inputs: ``input_scale`` is compressed-tensors' scale of the
    calibrated input amax (amax / 127.5) in the model dtype, and ``qckpt eval`` uses it."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    out = export_once(root, "w8a8-static", {"format": "int8", "granularity": "tensor"}, {
        "format": "int8", "dynamic": False})  # fmt: skip
    t = tensors_of(out)
    amax = tensors_of(root / "w8a8-static")
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["input_activations"]["strategy"] == "tensor"
    assert group["group_0"]["input_activations"]["dynamic"] is False
    modules = modules_with(t, "input_scale")
    assert len(modules) == 14
    for m in modules:
        a = amax[f"{m}.input_amax"].float().reshape(1)
        want, _ = calculate_qparams(-a, a, args)
        assert torch.equal(t[f"{m}.input_scale"], want.to(torch.bfloat16).reshape(1)), m
        assert t[f"{m}.weight_scale"].shape == (1,)
    assert check_export(out).ok
    rep = evaluate_export(out, root / "hf", root / "heldout.bin", EvalOptions(windows=2))
    assert rep["scheme"]["input_quantization"] == {"int8 static per-tensor": 14}


def test_w8a16_is_pack_quantized_8_bit(root):
    """INT8 weights with inputs none: four codes an int32 word, compressed-tensors'
    ``pack_to_int32`` of its own quantize, read back and checked as such."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = export_once(root, "w8a16", CHANNEL, {"format": "none"})
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    g0 = group["group_0"]
    assert g0["format"] == "pack-quantized" and g0["weights"]["num_bits"] == 8
    assert g0["input_activations"] is None
    t, src = tensors_of(out), tensors_of(root / "hf")
    for m in modules_with(t, "weight_packed"):
        w = src[f"{m}.weight"].float()
        scale = t[f"{m}.weight_scale"]
        codes = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        assert torch.equal(t[f"{m}.weight_packed"], pack_to_int32(codes, 8)), m
    res = check_export(out)
    assert res.ok and "INT8 W8A16 channel" in res.summary(), res.problems
    rep = evaluate_export(out, root / "hf", root / "heldout.bin", EvalOptions(windows=2))
    assert rep["scheme"]["input_quantization"] == {"unquantized": 14}
    r = run_main("convert", str(out), str(root / "back16"), "--to", "hf")
    assert r.returncode == 0 and "(int8 channel)" in r.stdout, r.stdout


def test_gptq_w8a8_writes_the_weights_gptq_chose(root):
    out = export_once(root, "gptq8", CHANNEL, TOKEN, calibrate={"algorithm": "gptq"})
    t = tensors_of(out)
    side = tensors_of(root / "gptq8" / "calib.safetensors.gptq")
    rtn = tensors_of(export_once(root, "w8a8", CHANNEL, TOKEN))
    moved = 0
    for m in modules_with(t, "weight_scale"):
        value = t[f"{m}.weight"].float() * t[f"{m}.weight_scale"].float()
        assert torch.equal(value.to(torch.bfloat16), side[f"{m}.weight"]), m
        moved += not torch.equal(t[f"{m}.weight"], rtn[f"{m}.weight"])
    assert moved == 14
    assert check_export(out).ok


@pytest.mark.parametrize(
    "name, weights, inputs, over, code, says",
    [
        ("int8-group", {"format": "int8", "granularity": "group"}, TOKEN, {}, 2,
         "int8 weights take granularity channel or tensor, not group"),
        ("fp8-int8", {"format": "fp8"}, TOKEN, {}, 2,
         "compressed-tensors writes FP8 weights with FP8 inputs"),
        ("int8-fp8", CHANNEL, {"format": "fp8"}, {}, 2,
         "writes int8 weights with int8 inputs (W8A8) or none (W8A16); got inputs fp8"),
        ("mo-int8", CHANNEL, TOKEN, {"export": {"format": "modelopt"}}, 2,
         "export.format modelopt writes FP8"),
        ("w8a16-tensor", {"format": "int8", "granularity": "tensor"}, {"format": "none"}, {}, 2,
         "writes int8 weight-only (W8A16) per channel"),
    ],
)  # fmt: skip
def test_what_no_layout_writes_is_refused_in_one_line(
    root, name, weights, inputs, over, code, says
):
    """Exit 2 and one line, at calibrate (a scheme with no such granularity) or at export
    before a byte is written."""
    rec = tiny_recipe(root, name, weights, inputs, **over)
    r = run_main("calibrate", str(rec))
    if r.returncode == 0:
        r = run_main("export", str(rec))
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    line = [s for s in r.stderr.splitlines() if s.startswith("qckpt: error:")]
    assert len(line) == 1 and says in line[0], r.stderr
    assert not (root / name / "out").exists()
