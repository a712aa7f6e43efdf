"""MX exports (compressed-tensors ``mxfp4-pack-quantized`` W4A16, ``mxfp8-quantized``): judged against
compressed-tensors' own MXFP4 scale rule, compressor and decompressor; read back as a source;
weight-only in ``qckpt eval``; GPTQ's per-group exponents written as chosen; what no layout or
algorithm takes refused in one line. The real commands on the tiny Llama (its dims 64, 128)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qckpt import EvalOptions, check_export, evaluate_export
from tests._inproc import run_main
from tests.e2e.tiny_exports import export_once, modules_with, tensors_of, tiny_recipe, tiny_root

MX = {"format": "mxfp4"}
NONE = {"format": "none"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_root(tmp_path_factory.mktemp("mxfp4"), heldout_seed=9)


def _export(root: Path, name: str, **over) -> Path:
    return export_once(root, name, MX, NONE, **over)


def test_mxfp4_export_is_what_compressed_tensors_computes(root):
    """Every linear: compressed-tensors' MXFP4 scales of the source weight (its
    ``calculate_qparams`` of each 32-group) and its compressor's packed codes and E8M0 bytes
    are the stored ones; its decompressor's values are what qckpt reads back, bit for bit."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams

    out = _export(root, "mx")
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    g0 = group["group_0"]
    assert g0["format"] == "mxfp4-pack-quantized" and g0["input_activations"] is None
    assert (g0["weights"]["num_bits"], g0["weights"]["group_size"]) == (4, 32)
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    t, src = tensors_of(out), tensors_of(root / "hf")
    r = run_main("convert", str(out), str(root / "back"), "--to", "hf")
    assert r.returncode == 0 and "14 of 21 tensors dequantized" in r.stdout, r.stdout
    back = tensors_of(root / "back")
    modules = modules_with(t, "weight_packed")
    assert len(modules) == 14 and not [k for k in t if k.endswith("global_scale")]
    for m in modules:
        w = src[f"{m}.weight"]
        rows, cols = w.shape
        groups = w.reshape(rows, cols // 32, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        ct = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        assert t[f"{m}.weight_scale"].dtype == torch.uint8
        assert torch.equal(t[f"{m}.weight_scale"], ct["weight_scale"]), m
        assert torch.equal(t[f"{m}.weight_packed"], ct["weight_packed"]), m
        sd = {"weight_packed": t[f"{m}.weight_packed"], "weight_scale": t[f"{m}.weight_scale"]}
        value = MXFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert torch.equal(back[f"{m}.weight"], value.to(torch.bfloat16)), m


def test_mxfp4_checks_and_evaluates_weight_only(root):
    out = _export(root, "mx")
    res = check_export(out)
    assert res.ok and "MXFP4 W4A16" in res.summary(), res.problems
    opts = EvalOptions(windows=4, seq_len=64)
    rep = evaluate_export(out, root / "hf", root / "heldout.bin", opts)
    assert rep["scheme"]["input_quantization"] == {"unquantized": 14}
    assert 0 < rep["kl_mean"] < 0.05


def test_a_damaged_e8m0_scale_is_a_check_problem(root, tmp_path):
    """A 255 byte (E8M0's NaN) among the scales: ``qckpt check`` names the tensor."""
    import shutil

    from safetensors.torch import save_file

    out = tmp_path / "bad"
    shutil.copytree(_export(root, "mx"), out)
    t = tensors_of(out)
    m = modules_with(t, "weight_packed")[0]
    t[f"{m}.weight_scale"][0, 0] = 255
    (f,) = out.glob("*.safetensors")
    save_file(t, str(f), metadata={"format": "pt"})
    res = check_export(out)
    assert not res.ok and any(f"{m}.weight_scale: NaN" in p for p in res.problems), res.problems


def test_gptq_mxfp4_writes_the_exponents_gptq_chose(root):
    """GPTQ makes each 32-group's exponent from its columns as it reaches them; the export
    writes those bytes and the codes of GPTQ's weights under them: its values are the
    sidecar's weights exactly, and differ from round-to-nearest's."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16

    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    out = _export(root, "gptq", calibrate={"algorithm": "gptq"})
    t = tensors_of(out)
    side = tensors_of(root / "gptq" / "calib.safetensors.gptq")
    rtn = tensors_of(_export(root, "mx"))
    moved = 0
    for m in modules_with(t, "weight_packed"):
        sd = {"weight_packed": t[f"{m}.weight_packed"], "weight_scale": t[f"{m}.weight_scale"]}
        value = MXFP4PackedCompressor.decompress(sd, scheme)["weight"]
        assert torch.equal(value.to(torch.bfloat16), side[f"{m}.weight"]), m
        assert torch.equal(t[f"{m}.weight_scale"], side[f"{m}.weight_block_scale"]), m
        moved += not torch.equal(t[f"{m}.weight_packed"], rtn[f"{m}.weight_packed"])
    assert moved == 14
    assert check_export(out).ok


@pytest.mark.parametrize(
    "name, inputs, over, says",
    [
        ("mx-inputs", {"format": "mxfp4"}, {}, "mxfp4 quantizes no inputs"),
        ("mo-mx", NONE, {"export": {"format": "modelopt"}}, "export.format modelopt writes FP8"),
        ("mx-gptq-block", NONE, {"calibrate": {"algorithm": "gptq", "gptq_block": 48}},
         "with mxfp4 groups of 32: calibrate.gptq_block (48) must be a multiple"),
    ],
)  # fmt: skip
def test_what_no_layout_or_algorithm_takes_is_refused_in_one_line(root, name, inputs, over, says):
    rec = tiny_recipe(root, name, MX, inputs, **over)
    r = run_main("calibrate", str(rec))
    if r.returncode == 0:
        r = run_main("export", str(rec))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = [s for s in r.stderr.splitlines() if s.startswith("qckpt: error:")]
    assert len(line) == 1 and says in line[0], r.stderr
    assert not (root / name / "out").exists()


def test_mxfp8_export_is_what_compressed_tensors_computes(root):
    """MXFP8 (``mxfp8-quantized``, inputs MXFP8 per 32 at run time): compressed-tensors'
    scales of each 32-group, its compressor's E4M3 codes and E8M0 bytes are the stored ones
    (nothing saturates: each group's largest value lands in [224, 448)), its decompressor's
    values are what qckpt reads back; ``qckpt eval`` quantizes the inputs per 32, and as
    Hopper runs it (weight-only, Marlin) leaves them alone."""
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP8
    from compressed_tensors.quantization.utils import calculate_qparams

    rec = tiny_recipe(root, "mx8", {"format": "mxfp8"}, {"format": "mxfp8", "dynamic": True})
    for cmd in ("calibrate", "export"):
        assert run_main(cmd, str(rec)).returncode == 0
    out = root / "mx8" / "out"
    g0 = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    g0 = g0["group_0"]
    assert g0["format"] == "mxfp8-quantized"
    assert g0["input_activations"]["dynamic"] is True
    scheme = QuantizationScheme(targets=["Linear"], **MXFP8)
    t, src = tensors_of(out), tensors_of(root / "hf")
    assert not [k for k in t if k.endswith("input_scale")]
    r = run_main("convert", str(out), str(root / "back8"), "--to", "hf")
    assert r.returncode == 0 and "(mxfp8 e8m0 per 32)" in r.stdout, r.stdout
    back = tensors_of(root / "back8")
    modules = modules_with(t, "weight_scale")
    assert len(modules) == 14
    for m in modules:
        w = src[f"{m}.weight"]
        rows, cols = w.shape
        groups = w.reshape(rows, cols // 32, 32)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        ct = MXFP8QuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        assert t[f"{m}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(t[f"{m}.weight_scale"], ct["weight_scale"]), m
        assert torch.equal(t[f"{m}.weight"].view(torch.uint8), ct["weight"].view(torch.uint8)), m
        sd = {"weight": t[f"{m}.weight"], "weight_scale": t[f"{m}.weight_scale"]}
        value = MXFP8QuantizationCompressor.decompress(sd, scheme)["weight"]
        assert torch.equal(back[f"{m}.weight"], value.to(torch.bfloat16)), m
    res = check_export(out)
    assert res.ok and "MXFP8 dynamic" in res.summary(), res.problems
    opts = EvalOptions(windows=2, seq_len=64)
    rep = evaluate_export(out, root / "hf", root / "heldout.bin", opts)
    assert rep["scheme"]["input_quantization"] == {"mxfp8 dynamic per-32": 14}
    hop = evaluate_export(out, root / "hf", root / "heldout.bin", EvalOptions(
        windows=2, seq_len=64, inputs="hopper"))  # fmt: skip
    assert hop["scheme"]["input_quantization"] == {"unquantized": 14}
