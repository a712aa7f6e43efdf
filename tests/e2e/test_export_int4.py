"""INT4 W4A16 (compressed-tensors ``pack-quantized``) and NVFP4A16 exports, judged against
compressed-tensors' own packing, scale rule, quantize and dequantize; read back as a source;
weight-only in ``qckpt eval``; the recipes no layout or algorithm takes refused in one line.

The export runs the real commands (convert, calibrate with ``max``, export) on the tiny Llama;
transformers loading it is ``tests/e2e/test_pipeline.py``'s ``tiny-dense-w4a16`` recipe."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from qckpt import check_export
from tests._inproc import run_main
from tests.e2e.tiny_exports import export_once, tensors_of, tiny_recipe, tiny_root

GROUP = 32  # the tiny model's input dims are 64 and 128


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_root(tmp_path_factory.mktemp("int4"))


@pytest.fixture(scope="module")
def w4a16(root):
    w = {"format": "int4", "granularity": "group", "block_size": [GROUP]}
    return export_once(root, "w4a16", w, {"format": "none"})


def test_w4a16_export_is_what_compressed_tensors_computes(root, w4a16):
    """Every linear: the stored scale is compressed-tensors' ``calculate_qparams`` of the
    group's min / max (amax / 7.5) in the model dtype; the codes are its ``quantize`` of the
    source weight under that scale; its ``dequantize`` is what qckpt reads back, bit for bit."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP
    )
    t, src = tensors_of(w4a16), tensors_of(root / "hf")
    cfg = json.loads((w4a16 / "config.json").read_text())["quantization_config"]
    group = cfg["config_groups"]["group_0"]
    assert cfg["format"] == group["format"] == "pack-quantized"
    assert (
        group["weights"] | {"type": "int", "num_bits": 4, "strategy": "group"} == group["weights"]
    )
    assert group["weights"]["group_size"] == GROUP and group["input_activations"] is None
    # read back as a source: `qckpt convert` dequantizes it into a BF16 HF dir
    r = run_main("convert", str(w4a16), str(root / "back"), "--to", "hf")
    assert r.returncode == 0 and "14 of 21 tensors dequantized from compressed-tensors" in r.stdout
    back = tensors_of(root / "back")
    modules = sorted(k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed"))
    assert len(modules) == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head ignored
    for m in modules:
        w = src[f"{m}.weight"].float()
        rows, cols = w.shape
        scale = t[f"{m}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == (rows, cols // GROUP)
        assert t[f"{m}.weight_shape"].tolist() == [rows, cols]
        groups = w.reshape(rows, -1, GROUP)
        want, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        assert torch.equal(scale, want.to(torch.bfloat16)), m
        codes = unpack_from_int32(t[f"{m}.weight_packed"], 4, torch.Size((rows, cols)))
        ct_codes = quantize(w, scale.float(), zp, args)
        assert torch.equal(codes.float(), ct_codes), m
        ct_value = dequantize(codes, scale.float(), zp, args)  # float32: exact products
        assert torch.equal(back[f"{m}.weight"], ct_value.to(torch.bfloat16)), m


def test_w4a16_passes_check_and_evaluates_weight_only(root, w4a16):
    from qckpt import EvalOptions, evaluate_export

    res = check_export(w4a16)
    assert res.ok and "INT4 W4A16 group 32" in res.summary(), res.problems
    data = root / "heldout.bin"
    g = torch.Generator().manual_seed(3)
    data.write_bytes(bytes(torch.randint(0, 256, (8192,), generator=g).tolist()))
    opts = EvalOptions(windows=4, seq_len=64)
    rep = evaluate_export(w4a16, root / "hf", data, opts)
    assert rep["scheme"]["input_quantization"] == {"unquantized": 14}
    assert rep["emulated"]["linears"] == 14
    fp8 = export_once(root, "fp8", {"format": "fp8"}, {"format": "fp8"})
    rep8 = evaluate_export(fp8, root / "hf", data, opts)
    # 4-bit weights move the outputs more than 8-bit ones, and not beyond recognition
    assert rep8["kl_mean"] < rep["kl_mean"] < 0.05, (rep8["kl_mean"], rep["kl_mean"])


def test_nvfp4a16_writes_no_input_scales(root):
    out = export_once(root, "nvfp4a16", {"format": "nvfp4"}, {"format": "none"})
    t = tensors_of(out)
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["input_activations"] is None
    assert group["group_0"]["format"] == "nvfp4-pack-quantized"
    assert not [k for k in t if k.endswith("input_global_scale")]
    assert len([k for k in t if k.endswith(".weight_global_scale")]) == 14
    res = check_export(out)
    assert res.ok and "NVFP4 W4A16" in res.summary(), res.problems


@pytest.mark.parametrize(
    "name, weights, inputs, over, says",
    [
        (
            "w4a8",
            {"format": "int4", "granularity": "group"},
            {"format": "fp8"},
            {},
            "compressed-tensors writes int4 pack-quantized weights weight-only",
        ),
        (
            "mo-int4",
            {"format": "int4", "granularity": "group", "block_size": [GROUP]},
            {"format": "none"},
            {"export": {"format": "modelopt"}},
            "export.format modelopt writes FP8",
        ),
        (
            "int4-inputs",
            {"format": "int4", "granularity": "group", "block_size": [GROUP]},
            {"format": "int4"},
            {},
            "int4 quantizes no inputs",
        ),
        (
            "group-96",
            {"format": "int4", "granularity": "group", "block_size": [96]},
            {"format": "none"},
            {},
            "int4 group 96 does not divide its input dim 64",
        ),
    ],
)
def test_an_unwritable_scheme_is_refused_in_one_line(root, name, weights, inputs, over, says):
    """At export, before a byte is written: exit 2 and one line naming what is wrong."""
    rec = tiny_recipe(root, name, weights, inputs, **over)
    cal = run_main("calibrate", str(rec))
    assert cal.returncode == 0, cal.stderr[-2000:]
    r = run_main("export", str(rec))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = [s for s in r.stderr.splitlines() if s.startswith("qckpt: error:")]
    assert len(line) == 1 and says in line[0], r.stderr
    assert not (root / name / "out").exists()


@pytest.mark.parametrize(
    "name, calibrate, says",
    [
        (
            "gptq-block",
            {"algorithm": "gptq", "gptq_block": 48},
            "calibrate.gptq_block (48) must be a multiple",
        ),
    ],
)
def test_what_an_algorithm_cannot_do_with_int4_is_refused_before_any_work(
    root, name, calibrate, says
):
    w = {"format": "int4", "granularity": "group", "block_size": [GROUP]}
    rec = tiny_recipe(root, f"a-{name}", w, {"format": "none"}, calibrate=calibrate)
    r = run_main("calibrate", str(rec))
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (root / f"a-{name}" / "calib.safetensors").exists()


def test_gptq_w4a16_writes_the_codes_and_group_scales_gptq_chose(root):
    """GPTQ makes each group's scale from the group's columns as it reaches them; the export
    writes those scales and the codes of GPTQ's weights under them, so the export's values are
    the sidecar's (GPTQ's) weights exactly, and differ from round-to-nearest's."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    w = {"format": "int4", "granularity": "group", "block_size": [GROUP]}
    rec = tiny_recipe(root, "gptq", w, {"format": "none"}, calibrate={"algorithm": "gptq"})
    for cmd in ("calibrate", "export"):
        r = run_main(cmd, str(rec))
        assert r.returncode == 0, r.stderr[-2000:]
    t = tensors_of(root / "gptq" / "out")
    side = tensors_of(root / "gptq" / "calib.safetensors.gptq")
    rtn = tensors_of(export_once(root, "w4a16", w, {"format": "none"}))
    moved = 0
    for k in (k for k in t if k.endswith(".weight_packed")):
        m = k[: -len(".weight_packed")]
        scale = t[f"{m}.weight_scale"]
        rows, groups = scale.shape
        codes = unpack_from_int32(t[k], 4, torch.Size((rows, groups * GROUP))).float()
        value = (codes.reshape(rows, groups, GROUP) * scale.float().unsqueeze(-1)).reshape(rows, -1)
        assert torch.equal(value.to(torch.bfloat16), side[f"{m}.weight"]), m
        assert torch.equal(scale, side[f"{m}.weight_block_scale"]), m
        moved += not torch.equal(t[k], rtn[k])
    assert moved == 14  # every linear: GPTQ spread its rounding errors
    assert check_export(root / "gptq" / "out").ok


def test_mse_w4a16_writes_the_searched_clips_and_lowers_every_weights_error(root, w4a16):
    """calibrate.algorithm mse: each group's clip (at most its amax) is in the calibration file
    beside max |w|; the export's scale is compressed-tensors' rule of the clip (clip / 7.5 in
    the model dtype) and its codes compressed-tensors' quantize under it; every linear's
    dequantized error is at most max calibration's, and some below."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP
    )
    w = {"format": "int4", "granularity": "group", "block_size": [GROUP]}
    out = export_once(root, "mse", w, {"format": "none"}, calibrate={"algorithm": "mse"})
    cal = tensors_of(root / "mse" / "calib.safetensors")
    t, src, ref = tensors_of(out), tensors_of(root / "hf"), tensors_of(w4a16)
    lower = 0
    for k in (k for k in t if k.endswith(".weight_packed")):
        m = k[: -len(".weight_packed")]
        x = src[f"{m}.weight"].float()
        rows, cols = x.shape
        clip, amax = cal[f"{m}.weight_clip_amax"], cal[f"{m}.weight_amax"]
        assert clip.shape == amax.shape == (rows, cols // GROUP) and bool((clip <= amax).all())
        scale = t[f"{m}.weight_scale"]
        assert torch.equal(scale, (clip.double() / 7.5).float().to(torch.bfloat16)), m
        err = {}
        for name, tt in (("mse", t), ("max", ref)):
            s = tt[f"{m}.weight_scale"].float()
            codes = unpack_from_int32(tt[k], 4, torch.Size((rows, cols))).float()
            if name == "mse":
                zp = torch.zeros_like(s, dtype=torch.int8)
                assert torch.equal(codes, quantize(x, s, zp, args)), m
            dq = (codes.reshape(rows, -1, GROUP) * s.unsqueeze(-1)).reshape(rows, cols)
            err[name] = float(((dq.double() - x.double()) ** 2).sum())
        assert err["mse"] <= err["max"], (m, err)
        lower += err["mse"] < err["max"]
    assert lower == 14
    assert check_export(out).ok


def test_int4_experts_beside_fp8_attention(tmp_path):
    """``quant.schemes`` mixes INT4 W4A16 routed experts with FP8 W8A8 attention (GPTQ for
    both): one ``config_groups`` entry each, ``mixed-precision`` on top, and ``qckpt eval``
    runs each linear by its own group (the experts weight-only, attention's inputs FP8)."""
    from qckpt import EvalOptions, evaluate_export

    schemes = [
        {
            "targets": ["*.mlp.experts.*"],
            "weights": {"format": "int4", "granularity": "group", "block_size": [GROUP]},
            "inputs": {"format": "none"},
        },
        {"targets": ["*.self_attn.*"], "weights": {"format": "fp8"}, "inputs": {"format": "fp8"}},
    ]
    rec = {
        "model": {"source": "tiny-moe", "dtype": "bfloat16", "seed": 0},
        "checkpoint": {"path": str(tmp_path / "dcp")},
        "quant": {"schemes": schemes, "ignore": ["lm_head", "*.mlp.gate"]},
        "calibrate": {
            "data": {"source": "synthetic", "num_samples": 8, "seq_len": 32, "batch_size": 4},
            "algorithm": "gptq",
            "output": str(tmp_path / "calib.safetensors"),
        },
        "export": {"format": "compressed-tensors", "output": str(tmp_path / "out")},
    }
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(rec))
    for argv in (
        ("convert", str(path), str(tmp_path / "dcp")),
        ("convert", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--to", "hf"),
        ("calibrate", str(path)),
        ("export", str(path)),
    ):
        r = run_main(*argv)
        assert r.returncode == 0, (argv, r.stderr[-2000:])
    out = tmp_path / "out"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert [g["format"] for g in qc["config_groups"].values()] == [
        "pack-quantized",
        "float-quantized",
    ]
    res = check_export(out)
    assert res.ok and "INT4 W4A16 group 32 + FP8" in res.summary(), res.problems
    data = tmp_path / "heldout.bin"
    data.write_bytes(bytes(range(256)) * 16)
    rep = evaluate_export(out, tmp_path / "hf", data, EvalOptions(windows=2, seq_len=64))
    assert rep["scheme"]["input_quantization"] == {
        "fp8 static per-tensor": 8,
        "unquantized": 48,
    }, rep["scheme"]["input_quantization"]
