"""Asymmetric INT4 W4A16 (``symmetric: false``: a scale and a zero point per group) and GPTQ
act-order on INT4 groups, exported as compressed-tensors ``pack-quantized`` and judged against
compressed-tensors' own ``calculate_qparams``, ``PackedQuantizationCompressor`` (compress and
decompress); read back, checked and evaluated by qckpt; refused in one line where no layout or
algorithm takes it. The real commands on the tiny Llama (``tests/e2e/tiny_exports.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from qckpt import check_export
from tests._inproc import run_main
from tests.e2e.tiny_exports import export_once, modules_with, tensors_of, tiny_recipe, tiny_root

GROUP = 32  # the tiny model's input dims are 64 and 128
ASYM = {"format": "int4", "granularity": "group", "block_size": [GROUP], "symmetric": False}
NONE = {"format": "none"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tiny_root(tmp_path_factory.mktemp("int4asym"), heldout_seed=3)


@pytest.fixture(scope="module")
def asym(root):
    return export_once(root, "asym", ASYM, NONE)


def _ct_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct_decompressed(t: dict, m: str) -> torch.Tensor:
    """compressed-tensors' decompression of module ``m`` of an export's tensors ``t``."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    leaves = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
    sd = {leaf: t[f"{m}.{leaf}"] for leaf in leaves}
    return PackedQuantizationCompressor.decompress(sd, _ct_scheme())["weight"]


def test_asymmetric_export_is_compressed_tensors_bytes(root, asym):
    """Every linear: scale and zero point are ``calculate_qparams`` of the group's min / max
    (float32; the scale then in the model dtype), and ``weight_packed`` / ``weight_scale`` /
    ``weight_zero_point`` are the bytes compressed-tensors' own compressor writes for the source
    weight under them; its decompression is what qckpt reads back, bit for bit."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme()
    t, src = tensors_of(asym), tensors_of(root / "hf")
    qc = json.loads((asym / "config.json").read_text())["quantization_config"]
    args = qc["config_groups"]["group_0"]["weights"]
    assert args["symmetric"] is False and args["strategy"] == "group"
    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors reads the config
    assert parsed.config_groups["group_0"].weights.symmetric is False
    r = run_main("convert", str(asym), str(root / "asym-back"), "--to", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    back = tensors_of(root / "asym-back")
    modules = modules_with(t, "weight_packed")
    assert len(modules) == 14
    for m in modules:
        w = src[f"{m}.weight"].float()
        rows, cols = w.shape
        groups = w.reshape(rows, -1, GROUP)
        want, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        scale = t[f"{m}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and torch.equal(scale, want.to(torch.bfloat16)), m
        assert t[f"{m}.weight_zero_point"].shape == (-(-rows // 8), cols // GROUP)
        sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        ct = PackedQuantizationCompressor.compress(sd, scheme)
        for leaf in ("weight_packed", "weight_scale", "weight_zero_point"):
            assert ct[leaf].dtype == t[f"{m}.{leaf}"].dtype, (m, leaf)
            assert torch.equal(ct[leaf], t[f"{m}.{leaf}"]), (m, leaf)
        assert torch.equal(back[f"{m}.weight"], _ct_decompressed(t, m)), m
    # zero points do something here: some group's is not the symmetric one (code 0)
    assert any(bool((t[f"{m}.weight_zero_point"] != 0).any()) for m in modules)


def test_asymmetric_export_passes_check_and_evaluates(root, asym):
    from qckpt import EvalOptions, evaluate_export

    res = check_export(asym)
    assert res.ok and "INT4 W4A16 group 32 asymmetric" in res.summary(), res.problems
    opts = EvalOptions(windows=4, seq_len=64)
    rep = evaluate_export(asym, root / "hf", root / "heldout.bin", opts)
    assert rep["scheme"]["input_quantization"] == {"unquantized": 14}
    sym = export_once(root, "sym", {**ASYM, "symmetric": True}, NONE)
    rep_sym = evaluate_export(sym, root / "hf", root / "heldout.bin", opts)
    # 16 levels over [min, max] instead of over [-amax, amax]: closer to the source
    assert rep["kl_mean"] < rep_sym["kl_mean"] < 0.05, (rep["kl_mean"], rep_sym["kl_mean"])


def test_check_finds_a_missing_or_misshapen_zero_point(root, asym, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(asym, bad)
    f = next(iter(sorted(bad.glob("*.safetensors"))))
    t = load_file(str(f))
    k = next(k for k in sorted(t) if k.endswith(".weight_zero_point"))
    t[k] = t[k][:-1].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    res = check_export(bad)
    assert not res.ok and any(k in p for p in res.problems), res.problems


def _gptq(root, name: str, weights: dict, **cal) -> tuple[dict, dict, dict]:
    rec = tiny_recipe(root, name, weights, NONE, calibrate={"algorithm": "gptq", **cal})
    for cmd in ("calibrate", "export"):
        r = run_main(cmd, str(rec), "--json", str(root / f"{name}-{cmd}.json"))
        assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((root / f"{name}-calibrate.json").read_text())
    side = tensors_of(root / name / "calib.safetensors.gptq")
    return tensors_of(root / name / "out"), side, report


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_asymmetric_writes_the_scales_and_zero_points_gptq_chose(root, act_order):
    """GPTQ with zero points (each group's made from its current columns as the sweep reaches
    it; with act-order from the weight before the sweep, compressed-tensors' ``actorder:
    weight``): the export writes them and the codes of GPTQ's weights under them, so its values
    decompressed by compressed-tensors are the sidecar's weights exactly."""
    t, side, report = _gptq(root, f"gptq-asym-{act_order}", ASYM, gptq_act_order=act_order)
    rtn = tensors_of(export_once(root, "asym", ASYM, NONE))
    rows = [r["gptq"] for r in report["layers"].values() if "gptq" in r]
    assert rows and all(r["loss_gptq"] < r["loss_rtn"] for r in rows)
    moved = 0
    for m in modules_with(t, "weight_packed"):
        assert torch.equal(_ct_decompressed(t, m), side[f"{m}.weight"]), m
        assert torch.equal(t[f"{m}.weight_scale"], side[f"{m}.weight_block_scale"]), m
        zp = side[f"{m}.weight_zero_point"]
        assert zp.dtype == torch.int8
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        assert torch.equal(t[f"{m}.weight_zero_point"], pack_to_int32(zp, 4, packed_dim=0)), m
        moved += not torch.equal(t[f"{m}.weight_packed"], rtn[f"{m}.weight_packed"])
    assert moved == 14
    res = check_export(root / f"gptq-asym-{act_order}" / "out")
    assert res.ok, res.problems


def test_gptq_act_order_on_symmetric_int4_groups(root):
    """Act-order on symmetric INT4 groups: each group's scale is the max rule's of the source
    group (fixed before the sweep: the round-to-nearest export's scales), the values GPTQ's."""
    w = {**ASYM, "symmetric": True}
    t, side, _ = _gptq(root, "gptq-ao", w, gptq_act_order=True)
    rtn = tensors_of(export_once(root, "sym", w, NONE))
    for m in modules_with(t, "weight_packed"):
        assert torch.equal(t[f"{m}.weight_scale"], rtn[f"{m}.weight_scale"]), m
        assert torch.equal(t[f"{m}.weight_scale"], side[f"{m}.weight_block_scale"]), m
        assert f"{m}.weight_zero_point" not in t
    assert check_export(root / "gptq-ao" / "out").ok


@pytest.mark.parametrize(
    "name, weights, over, says",
    [
        (
            "asym-channel",
            {"format": "int4", "granularity": "channel", "symmetric": False},
            {},
            "int4 weights are symmetric (symmetric: false is taken by int4 group weights only)",
        ),
        (
            "asym-int8",
            {"format": "int8", "granularity": "channel", "symmetric": False},
            {},
            "int8 weights are symmetric",
        ),
        ("asym-modelopt", ASYM, {"export": {"format": "modelopt"}}, "export.format modelopt"),
        (
            "asym-mse",
            ASYM,
            {"calibrate": {"algorithm": "mse"}},
            "calibrate.algorithm: mse does not search int4 group 32 asymmetric",
        ),
    ],
)
def test_what_cannot_take_zero_points_is_refused_in_one_line(root, name, weights, over, says):
    rec = tiny_recipe(root, name, weights, NONE, **over)
    r = run_main("calibrate", str(rec))
    if r.returncode == 0:  # a layout's refusal comes at export, before a byte is written
        r = run_main("export", str(rec))
        assert not (root / name / "out").exists()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line = [s for s in r.stderr.splitlines() if s.startswith("qckpt: error:")]
    assert len(line) == 1 and says in line[0], r.stderr


def test_awq_asymmetric_export_decompresses_to_what_qckpt_reads(root):
    """AWQ searches its scales under zero points (its candidates quantized as the export does)
    and the export makes each group's scale and zero point from the folded weights."""
    rec = tiny_recipe(root, "awq-asym", ASYM, NONE, calibrate={"algorithm": "awq"})
    for cmd in ("calibrate", "export"):
        r = run_main(cmd, str(rec))
        assert r.returncode == 0, r.stderr[-2000:]
    out = root / "awq-asym" / "out"
    assert check_export(out).ok
    r = run_main("convert", str(out), str(root / "awq-asym-back"), "--to", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    t, back = tensors_of(out), tensors_of(root / "awq-asym-back")
    for m in modules_with(t, "weight_packed"):
        assert torch.equal(back[f"{m}.weight"], _ct_decompressed(t, m)), m
