"""Several schemes in one export (``quant.schemes``) of the tiny MoE, in both layouts: NVFP4
routed experts, FP8 attention (block weights with dynamic per-group inputs in compressed-tensors,
per-tensor static in ModelOpt, whose MIXED_PRECISION takes no FP8 block), the routers and
lm_head in BF16; and the recipes refused in one line before any work (exit 2, nothing written)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from qckpt import check_export, recipe_from_dict, save_calibration
from tests._inproc import run_main
from tests.export_fixtures import make_calibration, run_export, saved_model

EXPERTS = "*.mlp.experts.*"
ATTN = "*.self_attn.*"
FP8, U8 = torch.float8_e4m3fn, torch.uint8


def _t(fmt: str, gran: str = "tensor", block=(128, 128), dynamic: bool = False) -> dict:
    return {"format": fmt, "granularity": gran, "block_size": list(block), "dynamic": dynamic}


def _quant(quant: dict):  # noqa: ANN202 - a recipe's QuantConfig, built as a user writes it
    return recipe_from_dict({"quant": quant}).quant


def mixed_quant(attn_block: bool):  # noqa: ANN201
    nv = {"targets": [EXPERTS], "weights": _t("nvfp4"), "inputs": _t("nvfp4")}
    if attn_block:  # the tiny model's input dim is 64: per-group inputs in groups of 32
        attn = {
            "targets": [ATTN],
            "weights": _t("fp8", "block"),
            "inputs": _t("fp8", "block", (1, 32), True),
        }
    else:
        attn = {"targets": [ATTN], "weights": _t("fp8"), "inputs": _t("fp8")}
    return _quant({"schemes": [nv, attn]})


def mixed_calibration(model, q):  # noqa: ANN001
    """The per-scheme calibrations of the test fixtures, each module's from its own scheme."""
    cals = [make_calibration(model, q.single(e)) for e in q.entries()]
    merged = cals[0]
    amax = {}
    for key in merged.amax:
        module = key.rsplit(".", 1)[0]
        i = q.entry_index(module)
        if key.endswith(".output_amax"):
            i = 1
        if i is not None:
            amax[key] = cals[i].amax[key]
    merged.amax = amax
    merged.quant = q.record()
    return merged


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    model, hf = saved_model(root, "tiny-moe")
    return root, model, hf


def _tensors(d: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118
                t = sf.get_slice(k)
                out[k] = (
                    getattr(
                        torch,
                        {
                            "F8_E4M3": "float8_e4m3fn",
                            "U8": "uint8",
                            "BF16": "bfloat16",
                            "F32": "float32",
                        }[t.get_dtype()],
                    ),
                    tuple(t.get_shape()),
                )
    return out


def _export(moe, fmt: str, attn_block: bool, name: str) -> Path:
    root, model, hf = moe
    q = mixed_quant(attn_block)
    out = root / name
    run_export(model, hf, mixed_calibration(model, q), out, q, fmt=fmt, source_dir=hf)
    return out


def test_compressed_tensors_mixed_export(moe):
    out = _export(moe, "compressed-tensors", True, "ct")
    t = _tensors(out)
    a, e = "model.layers.0.self_attn", "model.layers.0.mlp.experts.3"
    assert t[f"{a}.q_proj.weight"] == (FP8, (64, 64))
    assert t[f"{a}.k_proj.weight_scale"] == (torch.bfloat16, (1, 1))  # one 128x128 block
    assert f"{a}.q_proj.input_scale" not in t  # dynamic inputs
    assert t[f"{e}.gate_proj.weight_packed"] == (U8, (32, 32))
    assert t[f"{e}.down_proj.weight_scale"] == (FP8, (64, 2))
    assert t[f"{e}.up_proj.weight_global_scale"] == (torch.float32, (1,))
    assert t[f"{e}.up_proj.input_global_scale"] == (torch.float32, (1,))
    assert t["model.layers.0.mlp.gate.weight"] == (torch.bfloat16, (8, 64))
    assert t["lm_head.weight"][0] == torch.bfloat16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    g0, g1 = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert g0["format"] == "nvfp4-pack-quantized" and g1["format"] == "float-quantized"
    assert g0["targets"] == [
        "re:^model\\.layers\\.0\\.mlp\\.experts\\.\\d+\\.[^.]+$",
        "re:^model\\.layers\\.1\\.mlp\\.experts\\.\\d+\\.[^.]+$",
    ]
    assert "model.layers.1.self_attn.v_proj" in g1["targets"] and len(g1["targets"]) == 8
    assert g1["weights"]["strategy"] == "block" and g1["input_activations"]["group_size"] == 32
    assert "lm_head" in qc["ignore"] and "model.layers.0.mlp.gate" in qc["ignore"]


def test_modelopt_mixed_export(moe):
    out = _export(moe, "modelopt", False, "mo")
    t = _tensors(out)
    a, e = "model.layers.1.self_attn", "model.layers.1.mlp.experts.0"
    assert t[f"{a}.o_proj.weight"] == (FP8, (64, 64))
    assert t[f"{a}.o_proj.weight_scale"] == (torch.float32, ())
    assert t[f"{a}.o_proj.input_scale"] == (torch.float32, ())
    assert t[f"{e}.gate_proj.weight"] == (U8, (32, 32))
    assert t[f"{e}.gate_proj.weight_scale_2"] == (torch.float32, ())
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert cfg["quant_algo"] == hq["quant_algo"] == "MIXED_PRECISION"
    layers = cfg["quantized_layers"]
    assert layers == hq["quantized_layers"]
    assert layers[f"{a}.q_proj"] == {"quant_algo": "FP8"}
    assert layers[f"{e}.down_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert len(layers) == 2 * (4 + 8 * 3)
    assert "lm_head" not in layers and "model.layers.0.mlp.gate" in cfg["ignore"]
    assert cfg["ignore"] == hq["exclude_modules"]
    groups = cfg["config_groups"]
    assert {len(g["targets"]) for g in groups.values()} == {8, 48}
    # a gate/up pair keeps one NVFP4 global scale, as vLLM loads it
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as sf:
        g, u = (sf.get_tensor(f"{e}.{p}_proj.weight_scale_2") for p in ("gate", "up"))
    assert torch.equal(g, u)


def _recipe(moe, schemes: list[dict], name: str) -> tuple[Path, Path]:
    root, model, hf = moe
    cal = root / "cal-nvfp4.safetensors"
    if not cal.exists():
        save_calibration(
            make_calibration(model, mixed_quant(True).single(mixed_quant(True).schemes[0])), cal
        )
    out = root / f"refused-{name}"
    recipe = {
        "model": {"source": "tiny-moe", "dtype": "bfloat16", "seed": 0},
        "checkpoint": {"path": str(hf)},
        "quant": {"schemes": schemes, "ignore": ["lm_head", "*.mlp.gate"]},
        "calibrate": {"output": str(cal)},
        "export": {"format": "compressed-tensors", "output": str(out)},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, out


NV = {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}}
F8 = {"weights": {"format": "fp8"}, "inputs": {"format": "fp8"}}


@pytest.mark.parametrize(
    "name, schemes, says",
    [
        (
            "split",
            [{"targets": ["*.q_proj"], **F8}, {"targets": ["*.k_proj", EXPERTS], **NV}],
            "are one weight in serving stacks",
        ),
        ("nothing", [{"targets": ["*.nope_proj", EXPERTS], **NV}], "matches no linear"),
        (
            "unwritable",
            [
                {
                    "targets": [EXPERTS],
                    "weights": {"format": "nvfp4", "granularity": "channel"},
                    "inputs": {"format": "nvfp4"},
                }
            ],
            "quant.schemes[0].weights: nvfp4 weights take granularity tensor",
        ),
    ],
)
def test_refused_in_one_line_before_any_work(moe, name, schemes, says):
    recipe, out = _recipe(moe, schemes, name)
    r = run_main("export", str(recipe))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert not out.exists()


def _one(fmt: str):  # noqa: ANN202
    return _quant({"weights": _t(fmt), "inputs": _t(fmt)})


def test_eval_emulates_each_linear_with_its_scheme(moe):
    """``qckpt eval`` reads each linear's scheme from the export (config_groups targets,
    quantized_layers): the mix lies between all-FP8 and all-NVFP4."""
    from qckpt import EvalOptions, evaluate_export
    from qckpt.evaluate.scheme import read_scheme

    root, model, hf = moe
    data = root / "heldout.bin"
    g = torch.Generator().manual_seed(1)
    data.write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g).tolist()))
    mixed = root / "mo"
    if not mixed.exists():
        _export(moe, "modelopt", False, "mo")
    s = read_scheme(mixed)
    assert s.inputs["model.layers.0.self_attn.q_proj"].mode == "fp8_static"
    assert s.inputs["model.layers.0.mlp.experts.5.up_proj"].mode == "nvfp4"
    from qckpt.formats.scheme import Fp8Scheme, Nvfp4Scheme

    assert isinstance(s.weights["model.layers.0.mlp.experts.5.up_proj.weight"].scheme, Nvfp4Scheme)
    assert isinstance(s.weights["model.layers.0.self_attn.v_proj.weight"].scheme, Fp8Scheme)
    ct = read_scheme(root / "ct") if (root / "ct").exists() else None
    if ct is not None:
        assert ct.inputs["model.layers.1.self_attn.o_proj"].mode == "fp8_group"
        assert ct.inputs["model.layers.1.mlp.experts.0.down_proj"].mode == "nvfp4"
    opts = EvalOptions(windows=2, seq_len=64)
    kl = {}
    for fmt in ("fp8", "nvfp4"):
        out = root / f"all-{fmt}"
        run_export(model, hf, make_calibration(model, _one(fmt)), out, _one(fmt), fmt="modelopt")
        kl[fmt] = evaluate_export(out, hf, data, opts)["kl_mean"]
    rep = evaluate_export(mixed, hf, data, opts)
    assert rep["emulated"] == {"linears": 8, "experts": 16, "kv_cache_layers": 0}
    assert kl["fp8"] < rep["kl_mean"] < kl["nvfp4"], (kl, rep["kl_mean"])
    # as an H100 serves it: the FP8 attention's inputs quantized, the NVFP4 experts weight-only
    hop = evaluate_export(mixed, hf, data, replace(opts, inputs="hopper"))
    modes = hop["scheme"]["input_quantization"]
    # 2 layers x 8 experts x (gate, up, down) weight-only; the 8 attention linears FP8 W8A8
    assert modes == {"fp8 static per-tensor": 8, "unquantized": 48}, modes
    assert hop["export_bits_per_byte"] != rep["export_bits_per_byte"]


def test_check_finds_a_fused_group_split_over_groups(moe, tmp_path):
    """``qckpt check`` on a mixed export whose config gives q_proj another group than k/v."""
    import shutil

    root, _, _ = moe
    src = root / "ct"
    if not src.exists():
        _export(moe, "compressed-tensors", True, "ct")
    assert check_export(src).ok
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    q = "model.layers.0.self_attn.q_proj"
    groups["group_1"]["targets"].remove(q)
    groups["group_0"]["targets"].append(q)
    (bad / "config.json").write_text(json.dumps(cfg))
    res = check_export(bad)
    assert not res.ok
    assert any(q in p and "NVFP4" in p for p in res.problems), res.problems
    assert any("clients load them as one weight" in p for p in res.problems), res.problems


def test_int4_w4a16_experts_beside_fp8_attention_are_each_schemes_own_export(moe):
    """Issue 42's mix for Hopper: INT4 W4A16 routed experts (group 32) + FP8 per-channel
    attention with dynamic inputs, calibrated and exported by the commands. Each module's
    tensors are byte for byte what the export of its scheme alone writes; the config has one
    group per scheme; ``check`` passes and ``eval`` reads each linear's scheme."""
    from qckpt.evaluate.scheme import read_scheme
    from qckpt.formats.scheme import Fp8Scheme, Int4Scheme

    root, _, hf = moe
    int4 = {"format": "int4", "granularity": "group", "block_size": [32]}
    fp8 = {"format": "fp8", "granularity": "channel"}
    dyn = {"format": "fp8", "granularity": "tensor", "dynamic": True}
    none = {"format": "none"}
    quants = {
        "int4-fp8": {
            "schemes": [
                {"targets": [EXPERTS], "weights": int4, "inputs": none},
                {"targets": [ATTN], "weights": fp8, "inputs": dyn},
            ]
        },
        "all-int4": {"weights": int4, "inputs": none},
        "all-fp8-channel": {"weights": fp8, "inputs": dyn},
    }
    t = {}
    for name, quant in quants.items():
        run = root / name
        recipe = {
            "model": {"source": str(hf)},
            "checkpoint": {"path": str(hf)},
            "quant": {**quant, "ignore": ["lm_head", "*.mlp.gate"]},
            "calibrate": {
                "data": {"source": "synthetic", "num_samples": 8, "seq_len": 32, "batch_size": 4},
                "algorithm": "max",
                "output": str(run / "calib.safetensors"),
            },
            "export": {"format": "compressed-tensors", "output": str(run / "out")},
        }
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        for cmd in ("calibrate", "export"):
            r = run_main(cmd, str(path))
            assert r.returncode == 0, (name, cmd, r.stderr[-2000:])
        t[name] = _stored(run / "out")
    mixed = t["int4-fp8"]
    for k, v in mixed.items():
        if ".mlp.experts." in k:
            want = t["all-int4"][k]
        elif ".self_attn." in k:
            want = t["all-fp8-channel"][k]
        else:  # router, norms, embeddings, lm_head: BF16 as in either
            want = t["all-int4"][k]
        assert v.dtype == want.dtype and torch.equal(v.view(torch.uint8), want.view(torch.uint8)), k
    assert mixed["model.layers.0.mlp.experts.3.gate_proj.weight_packed"].dtype == torch.int32
    assert mixed["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    out = root / "int4-fp8" / "out"
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["format"] for g in groups.values()] == ["pack-quantized", "float-quantized"]
    assert groups["group_0"]["input_activations"] is None
    assert groups["group_1"]["input_activations"]["dynamic"] is True
    res = check_export(out)
    assert res.ok, res.problems
    s = read_scheme(out)
    assert isinstance(s.weights["model.layers.1.mlp.experts.7.down_proj.weight"].scheme, Int4Scheme)
    assert isinstance(s.weights["model.layers.1.self_attn.o_proj.weight"].scheme, Fp8Scheme)


def _stored(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            out |= {k: sf.get_tensor(k) for k in sf.keys()}  # noqa: SIM118
    return out
