"""Quantized checkpoints as sources: each layout detected, read bit for bit as an independent
dequantization gives it, copied as it is into params of its own layout, or refused in one line.

Independent references: compressed-tensors' own decompressors for its dirs; for the others the
formulas written out here from the layouts' documentation (DeepSeek-V3's ``weight_dequant``:
``fp8.float() * scale_inv`` per block; ModelOpt: ``code * weight_scale``, E2M1 from a table
times ``weight_scale * weight_scale_2``), each rounded once to BF16.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qckpt.errors import CheckpointError
from qckpt.layouts.registry import source_layout
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.models.naming import hf_tensors
from qckpt.models.quantize_params import quantize_model_params
from qckpt.read.hf_reader import hf_index, hf_source
from qckpt.read.readers import open_source
from tests import quantized_fixtures as fx
from tests.export_fixtures import make_calibration, quant_config, run_export

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
IGNORE = ["lm_head", "*.mlp.gate"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qsrc")
    src = fx.bf16_dir(root)
    out = {"bf16": src}
    out["fp8-blockwise-32x32"] = fx.blockwise_fp8(src, root / "bw32", (32, 32))
    out["fp8-blockwise-24x40"] = fx.blockwise_fp8(src, root / "bw24x40", (24, 40))
    for kind in ("channel", "block", "nvfp4", *fx.INT_MX):
        out[f"ct-{kind}"] = fx.compressed_tensors(src, root / f"ct-{kind}", kind)
    model = build_model("tiny-moe", dtype="bfloat16", seed=0)
    for name, fmt, q in (
        ("ours-ct-tensor", "compressed-tensors", quant_config("tensor", "static")),
        ("ours-modelopt-fp8", "modelopt", quant_config("tensor", "static")),
        ("ours-modelopt-nvfp4", "modelopt", quant_config(fmt="nvfp4")),
    ):
        q.ignore = list(IGNORE)
        cal = make_calibration(model, q)
        run_export(model, src, cal, root / name, q, fmt=fmt, source_dir=src)
        out[name] = root / name
    return out


LAYOUTS = {
    "fp8-blockwise-32x32": ("fp8-blockwise", "fp8 block [32, 32]"),
    "fp8-blockwise-24x40": ("fp8-blockwise", "fp8 block [24, 40]"),
    "ct-channel": ("compressed-tensors", "fp8 channel"),
    "ct-block": ("compressed-tensors", "fp8 block [32, 32]"),
    "ct-nvfp4": ("compressed-tensors", "nvfp4 e4m3 per 16 + global 1/scale"),
    # llm-compressor's W4A16 (GPTQ / AWQ), W8A8 and MXFP4A16 outputs
    "ct-int4": ("compressed-tensors", "int4 group"),
    "ct-int8": ("compressed-tensors", "int8 channel"),
    "ct-mxfp4": ("compressed-tensors", "mxfp4 e8m0 per 32"),
    "ours-ct-tensor": ("compressed-tensors", "fp8 tensor"),
    "ours-modelopt-fp8": ("modelopt", "FP8"),
    "ours-modelopt-nvfp4": ("modelopt", "NVFP4"),
}


def stored(d: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(next(d.glob("*.safetensors"))), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _blocks(s: torch.Tensor, shape: tuple[int, int], b0: int, b1: int) -> torch.Tensor:
    return s.float().repeat_interleave(b0, 0)[: shape[0]].repeat_interleave(b1, 1)[:, : shape[1]]


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    v = E2M1[(codes & 7).long()]
    return torch.where(codes >= 8, -v, v)


def _ct_reference(d: Path, kind: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompressor, module by module."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
    )
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**fx.ct_args(kind, (32, 32)))
    )
    comp = {
        "nvfp4": NVFP4PackedCompressor,
        "int4": PackedQuantizationCompressor,
        "int8": IntQuantizationCompressor,
        "mxfp4": MXFP4PackedCompressor,
    }.get(kind, FloatQuantizationCompressor)
    t = stored(d)
    out = {}
    for k in t:
        mod, _, leaf = k.rpartition(".")
        if leaf in ("weight_packed", "weight") and f"{mod}.weight_scale" in t:
            sd = {n.rpartition(".")[2]: v for n, v in t.items() if n.rpartition(".")[0] == mod}
            out[f"{mod}.weight"] = comp.decompress(sd, scheme)["weight"].to(torch.bfloat16)
    return out


def reference(name: str, d: Path) -> dict[str, torch.Tensor]:
    """Every quantized weight of the dir, dequantized independently of qckpt, in BF16."""
    if name.startswith("ct-"):
        return _ct_reference(d, name[3:])
    t = stored(d)
    out = {}
    for k, v in t.items():
        if name.startswith("fp8-blockwise") and f"{k}_scale_inv" in t:
            b = json.loads((d / "config.json").read_text())["quantization_config"]
            b0, b1 = b["weight_block_size"]
            out[k] = (v.float() * _blocks(t[f"{k}_scale_inv"], v.shape, b0, b1)).bfloat16()
        elif name.endswith("-fp8") or name == "ours-ct-tensor":
            if v.dtype == torch.float8_e4m3fn:
                out[k] = (v.float() * t[f"{k}_scale"].float()).bfloat16()
        elif name.endswith("nvfp4") and v.dtype == torch.uint8:
            s = t[f"{k}_scale"].float() * t[f"{k}_scale_2"].float()
            out[k] = (_e2m1(v) * _blocks(s, (v.shape[0], v.shape[1] * 2), 1, 16)).bfloat16()
    return out


def loaded_hf(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    mt = model.config.model_type
    out = {}
    for k, v in model.state_dict().items():
        v = v.dequantize(torch.bfloat16) if hasattr(v, "qdata") else v
        out.update({n: t for n, t in hf_tensors(k, v, mt)})
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_detected_and_named_like_the_bf16_checkpoint(dirs, name):
    layout = source_layout(dirs[name], hf_index(dirs[name]))
    assert (layout.name, layout.detail) == LAYOUTS[name]
    assert len(layout.weights) == 56  # 8 attention + 48 expert linears of 2 layers
    want = {k: v[1] for k, v in hf_index(dirs["bf16"]).items()}
    have = {k: v[1] for k, v in layout.logical_index(hf_index(dirs[name])).items()}
    assert have == want  # no scale, no input_scale, names and shapes of the BF16 dir
    # export's reader lists the same tensors
    assert {e.name: e.shape for e in open_source(dirs[name]).entries()} == want


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_load_equals_independent_dequantization_bit_for_bit(dirs, name):
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    rep = load_checkpoint(model, dirs[name])
    assert rep.source_layout.startswith(LAYOUTS[name][0])
    got, ref, bf16 = loaded_hf(model), reference(name, dirs[name]), stored(dirs["bf16"])
    assert len(ref) == 56
    for k, v in got.items():
        want = ref.get(k, bf16.get(k))
        assert same_bits(v, want), k
        if k in ref:  # a dequantized weight, not codes read as values
            err = (v.float() - bf16[k].float()).norm() / bf16[k].float().norm()
            four_bit = any(f in name for f in ("nvfp4", "int4", "mxfp4"))
            assert err < (0.2 if four_bit else 0.06), (k, float(err))


def _fields(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if hasattr(v, "qdata")}


def test_blockwise_source_into_fp8_block_params_copies_codes_and_scales(dirs):
    d = dirs["fp8-blockwise-32x32"]
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    quantize_model_params(model, "fp8_block", ignore=IGNORE, block_size=(32, 32))
    rep = load_checkpoint(model, d)
    assert rep.copied_tensors == 12  # every quantized param: 8 attention + 4 fused experts
    t = stored(d)
    for k, q in _fields(model).items():
        codes = dict(hf_tensors(k, q.qdata.view(torch.uint8), "qwen3_moe"))
        for hf_name, c in codes.items():
            assert torch.equal(c, t[hf_name].view(torch.uint8)), hf_name
        if q.dim() == 2:
            assert torch.equal(q.scale, t[f"{k}_scale_inv"]), k
    ref = reference("fp8-blockwise-32x32", d)
    assert all(same_bits(v, ref[k]) for k, v in loaded_hf(model).items() if k in ref)


def test_partial_blocks_copy_where_the_blocks_line_up_and_requantize_elsewhere(dirs):
    d = dirs["fp8-blockwise-24x40"]
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    quantize_model_params(model, "fp8_block", ignore=IGNORE, block_size=(24, 40))
    rep = load_checkpoint(model, d)
    # fused gate_up [8, 64, 64]: up starts at row 32, inside a 24-row block -> requantized
    assert rep.copied_tensors == 10
    ref = reference("fp8-blockwise-24x40", d)
    got = loaded_hf(model)
    for k in ref:
        if ".experts." in k and k.endswith(("gate_proj.weight", "up_proj.weight")):
            err = (got[k].float() - ref[k].float()).norm() / ref[k].float().norm()
            assert err < 0.06, k
        else:
            assert same_bits(got[k], ref[k]), k


@pytest.mark.parametrize(
    ("name", "fmt", "copies"),
    [
        ("ours-modelopt-fp8", "fp8", 8),  # per-tensor: attention copies, fused experts cannot
        ("ours-ct-tensor", "fp8", 8),  # (one scale per fused tensor, one per expert stored)
        ("ct-channel", "fp8", 8),  # per-channel params of 2-D weights
        ("ours-modelopt-nvfp4", "nvfp4", 8),
        ("ct-nvfp4", "nvfp4", 0),  # its 1/global scale rounds differently: never copied
    ],
)
def test_same_layout_params_take_the_stored_fields(dirs, name, fmt, copies):
    gran = {"granularity": "channel"} if name == "ct-channel" else {}
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    quantize_model_params(model, fmt, ignore=IGNORE, **gran)
    rep = load_checkpoint(model, dirs[name])
    assert rep.copied_tensors == copies
    t = stored(dirs[name])
    attn = {k: q for k, q in _fields(model).items() if ".self_attn." in k}
    for k, q in attn.items():
        if copies:
            assert torch.equal(q.qdata.view(torch.uint8), t[k].view(torch.uint8)), k
            assert torch.equal(q.scale.float().reshape(-1), t[f"{k}_scale"].float().reshape(-1))
    ref = reference(name, dirs[name])
    got = loaded_hf(model)
    if copies:
        assert all(same_bits(got[k], ref[k]) for k in ref if ".self_attn." in k)


def test_fp8_export_given_as_checkpoint_reads_values_not_codes(dirs):
    """Issue 13: codes were read as BF16 values (|w| max 448)."""
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    load_checkpoint(model, dirs["ours-ct-tensor"])
    w = model.model.layers[0].self_attn.q_proj.weight
    ref = stored(dirs["bf16"])["model.layers.0.self_attn.q_proj.weight"]
    assert float(w.abs().max()) == pytest.approx(float(ref.abs().max()), rel=0.07)
    assert float(w.abs().max()) < 1.0


def _write_like(src: Path, out: Path, tensors: dict, qc: dict | None, extra=None) -> Path:
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    for k, v in (extra or {}).items():
        (out / k).write_text(json.dumps(v))
    return out


def test_unknown_quantized_layouts_are_refused_in_one_line(dirs, tmp_path):
    bf16 = stored(dirs["bf16"])
    cast = dict(bf16)
    cast["model.layers.0.self_attn.q_proj.weight"] = bf16[
        "model.layers.0.self_attn.q_proj.weight"
    ].to(torch.float8_e4m3fn)
    cases = {
        "fp8 cast, no config": (cast, None, "unknown quantized layout: 1 float8 tensors"),
        "int8 ct": (
            bf16,
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            "compressed-tensors format 'int-quantized' with 8-bit int weights",
        ),
        "int4 ct, no strategy": (
            bf16,
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "int4 weights with strategy None are not read",
        ),
        "awq": (bf16, {"quant_method": "awq"}, "quant_method 'awq': not a source layout"),
        "fp8 without scale": (
            cast,
            {"quant_method": "fp8", "weight_block_size": [32, 32]},
            "q_proj.weight is stored as torch.float8_e4m3fn but the fp8-blockwise",
        ),
        "block size disagrees": (
            stored(dirs["fp8-blockwise-32x32"]),
            {"quant_method": "fp8", "weight_block_size": [64, 64]},
            "fits none of the checkpoint's weight schemes (block [64, 64]) for a weight of shape",
        ),
        "modelopt w4a8": (bf16, None, "modelopt quant_algo 'W4A8_AWQ': not a source layout"),
    }
    extra = {
        "modelopt w4a8": {"hf_quant_config.json": {"quantization": {"quant_algo": "W4A8_AWQ"}}}
    }
    for i, (case, (tensors, qc, msg)) in enumerate(cases.items()):
        d = _write_like(dirs["bf16"], tmp_path / f"bad{i}", tensors, qc, extra.get(case))
        model = build_model("tiny-moe", dtype="bfloat16", seed=5)
        with pytest.raises(CheckpointError) as exc:
            load_checkpoint(model, d)
        text = str(exc.value)
        assert msg in text and "\n" not in text and str(d) in text, (case, text)
        with pytest.raises(CheckpointError):
            open_source(d).entries()  # export's reader refuses it the same way


def test_dcp_holding_fp8_codes_is_refused(dirs, tmp_path):
    from qckpt.convert.dcp import save_model_dcp

    sd = {k: v for k, v in stored(dirs["ours-modelopt-fp8"]).items() if "layers.0.self" in k}
    save_model_dcp(sd, tmp_path / "dcp")
    with pytest.raises(CheckpointError, match="unknown quantized layout.*DCP checkpoint"):
        open_source(tmp_path / "dcp").entries()
    from qckpt.read.readers import open_reader

    with pytest.raises(CheckpointError, match="unknown quantized layout"):
        open_reader(tmp_path / "dcp")


@pytest.mark.parametrize(
    "name", ["ct-block", "ct-nvfp4", "ct-int4", "ct-int8", "ct-mxfp4", "fp8-blockwise-24x40"]
)
def test_dequantized_dir_equals_independent_dequantization(dirs, tmp_path, name):
    from qckpt.convert.dequantize import dequantize_dir

    out = tmp_path / "hf"
    out.mkdir()
    info = dequantize_dir(dirs[name], out)
    assert info["dequantized"] == 56
    got, ref, bf16 = stored(out), reference(name, dirs[name]), stored(dirs["bf16"])
    assert set(got) == set(bf16)
    assert all(same_bits(got[k], ref.get(k, bf16[k])) for k in got)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    # a plain dir again: qckpt reads it as BF16
    assert hf_source(out)[1].name == "plain"


def test_reexport_of_our_per_tensor_fp8_export_gives_identical_tensors(dirs, tmp_path):
    src = dirs["ours-ct-tensor"]
    q = quant_config("tensor", "static")
    q.ignore = list(IGNORE)
    original = build_model("tiny-moe", dtype="bfloat16", seed=0)
    # weight amax from the dequantized source (the model loaded from the export)
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    load_checkpoint(model, src)
    cal = make_calibration(model, q)
    cal.amax.update({k: v for k, v in make_calibration(original, q).amax.items() if "input" in k})
    run_export(model, src, cal, tmp_path / "again", q, source_dir=src)
    a, b = stored(src), stored(tmp_path / "again")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert math.isclose(
        float(b["model.layers.0.self_attn.q_proj.weight_scale"].float()),
        float(a["model.layers.0.self_attn.q_proj.weight_scale"].float()),
    )


def test_fp8_export_converts_to_dcp_and_calibrates_from_its_values(dirs, tmp_path):
    """Issue 13: load, calibrate and convert all took an FP8 export's codes as BF16 values."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.convert.dcp import hf_dir_to_dcp
    from qckpt.parallel.mesh import init_mesh
    from tests.export_fixtures import calib_inputs

    src = dirs["ours-ct-tensor"]
    direct = build_model("tiny-moe", dtype="bfloat16", seed=5)
    load_checkpoint(direct, src)
    hf_dir_to_dcp(src, tmp_path / "dcp", build_model("tiny-moe", dtype="bfloat16", seed=6))
    via_dcp = build_model("tiny-moe", dtype="bfloat16", seed=7)
    load_checkpoint(via_dcp, tmp_path / "dcp")
    a, b = direct.state_dict(), via_dcp.state_dict()
    assert all(same_bits(a[k], b[k]) for k in a)

    q = quant_config("tensor", "static")
    q.ignore = list(IGNORE)
    state, _ = calibrate_model(direct, calib_inputs(), q, init_mesh(ep=1, tp=1, timeout_s=60))
    ref = reference("ours-ct-tensor", src)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.5.down_proj"):
        got = float(state.amax[f"{module}.weight_amax"])
        assert got == float(ref[f"{module}.weight"].float().abs().max()) < 1.0, module


def test_dense_compressed_tensors_dir_reads_its_bf16_weights_and_hides_the_scales(dirs, tmp_path):
    """``format: dense``: weights stored unquantized beside their scales (a fake-quant save)."""
    bf16 = stored(dirs["bf16"])
    tensors = dict(bf16)
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(1, dtype=torch.bfloat16)
    tensors["model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(1, dtype=torch.bfloat16)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}
    qc = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {"g": group}}
    d = _write_like(dirs["bf16"], tmp_path / "dense", tensors, qc)
    layout = source_layout(d, hf_index(d))
    assert layout.quantized and not layout.weights and len(layout.hidden) == 2
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    load_checkpoint(model, d)
    got = loaded_hf(model)
    assert all(same_bits(got[k], bf16[k]) for k in bf16)


@pytest.mark.parametrize("name", ["ct-int4", "ct-int8", "ct-mxfp4"])
def test_export_from_an_integer_or_mx_release_is_the_export_of_its_dequantized_dir(
    dirs, tmp_path, name
):
    """An INT4 GPTQ / INT8 / MXFP4 compressed-tensors release re-exported to FP8: the export
    streams its codes, dequantizes them in float32 (``code * scale``, exact there: no BF16
    rounding on the way) and writes what the export of the float32 dequantized dir writes,
    byte for byte (the same calibration); the tensors left unquantized keep their values."""
    from qckpt.convert.dequantize import dequantize_dir

    src = dirs[name]
    plain = tmp_path / "hf"
    plain.mkdir()
    dequantize_dir(src, plain, dtype=torch.float32)
    # a BF16 model whose quantized linears hold the float32 values: the scales follow the
    # model's dtype, as they do for the release
    ref, path = reference(name, src), next(plain.glob("*.safetensors"))
    t = {k: (v if k in ref else v.to(torch.bfloat16)) for k, v in stored(plain).items()}
    save_file(t, str(path), metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    cfg.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in cfg})
    (plain / "config.json").write_text(json.dumps(cfg))
    q = quant_config("channel", "dynamic")
    q.ignore = list(IGNORE)
    model = build_model("tiny-moe", dtype="bfloat16", seed=5)
    load_checkpoint(model, src)
    cal = make_calibration(model, q)
    run_export(model, src, cal, tmp_path / "from-release", q, source_dir=src)
    run_export(model, plain, cal, tmp_path / "from-f32", q, source_dir=plain)
    a, b = stored(tmp_path / "from-release"), stored(tmp_path / "from-f32")
    assert set(a) == set(b)
    codes = [k for k in a if a[k].dtype == torch.float8_e4m3fn]
    assert len(codes) == 56
    for k in a:
        if k in codes or k.endswith("weight_scale"):
            assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
        else:
            assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
