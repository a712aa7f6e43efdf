"""``qckpt plan`` of a mixed recipe (``quant.schemes``): each scheme's linears, amaxes and export
bytes from its own scheme; a recipe no export can be made of refused in one line, exit 2; and
``qckpt init --preset``'s recipes, each one that ``plan`` accepts."""

from __future__ import annotations

import math

import pytest
import yaml

from qckpt.cli.app import main
from qckpt.pipeline.plan import plan
from qckpt.recipe import load_recipe
from tests._inproc import run_main
from tests.conftest import ROOT
from tests.quantized_fixtures import bf16_dir

MIXED = ROOT / "configs" / "tiny-moe-mixed.yaml"
NOWHERE = "checkpoint.path=/nonexistent/dcp"


def test_each_scheme_is_figured_by_its_own_scheme():
    res = plan(load_recipe(MIXED, [NOWHERE]), nproc_per_node=1).to_dict()
    rows = {r["entry"]: r for r in res["schemes"]}
    experts, attn, plain = rows["quant.schemes[0]"], rows["quant.schemes[1]"], rows["unquantized"]
    # tiny-moe: 2 layers x 8 experts x (gate, up, down) of 32x64 / 64x32; q/k/v/o; lm_head
    assert (experts["linears"], attn["linears"], plain["linears"]) == (48, 8, 1)
    n = experts["parameters"]
    assert n == 48 * 32 * 64
    # NVFP4: 4-bit codes, an E4M3 scale per 16, a float32 global scale, an input scale
    assert experts["export_bytes"] == n // 2 + n // 16 + 48 * 4 + 48 * 4
    assert experts["weights"] == "nvfp4 tensor"
    # FP8 per tensor, static inputs: one weight scale (model-dtype sized) and one float32 input
    # scale per linear in the export; one weight and one input amax each calibrated
    assert attn["weights"] == attn["inputs"] == "fp8 tensor"
    assert attn["export_bytes"] == attn["parameters"] + 8 * 2 + 8 * 4
    assert attn["amax_bytes"] == 8 * (4 + 4)
    assert plain["weights"] == "unquantized" and plain["export_bytes"] == 256 * 64 * 2
    assert res["export_bytes"] == res["other_bytes"] + sum(r["export_bytes"] for r in rows.values())
    assert 4.5 < experts["bits_per_weight"] < 4.6


def test_a_one_scheme_recipe_is_one_entry():
    res = plan(load_recipe(ROOT / "configs" / "tiny-moe.yaml", [NOWHERE]), nproc_per_node=1)
    got = [(r.entry, r.linears) for r in res.schemes.rows]
    assert got == [("quant", 56), ("unquantized", 1)]


def _mixed(tmp_path, edit) -> str:
    raw = yaml.safe_load(MIXED.read_text())
    edit(raw["quant"]["schemes"])
    out = tmp_path / "r.yaml"
    out.write_text(yaml.safe_dump(raw))
    return str(out)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s[1].update(targets=["*.q_proj"]),
            "model.layers.0.self_attn.q_proj (quant.schemes[1]) and "
            "model.layers.0.self_attn.k_proj (unquantized) are one weight",
        ),
        (
            lambda s: s[1]["targets"].append("*.shared_expert.*"),
            "quant.schemes[1].targets[1]: '*.shared_expert.*' matches no linear of the model",
        ),
        (
            lambda s: s[0].update(targets=["*.experts.0.*"]),
            "(quant.schemes[0]) and model.layers.0.mlp.experts.1.gate_proj (unquantized)",
        ),
        (lambda s: s[0]["weights"].update(granularity="channel"), "channel"),
    ],
    ids=["split-qkv", "target-matches-nothing", "split-experts", "nvfp4-per-channel"],
)
def test_a_recipe_no_export_can_be_made_of_is_one_line_and_exit_2(tmp_path, capsys, edit, message):
    recipe = _mixed(tmp_path, edit)
    with pytest.raises(SystemExit) as exc:
        main(["plan", recipe, "--nproc-per-node", "1", "--set", NOWHERE])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("presets")
    return d, {"moe": bf16_dir(d, "tiny-moe"), "dense": bf16_dir(d, "tiny-dense")}


@pytest.mark.parametrize(
    ("kind", "preset", "fourbit"),
    [
        ("moe", "nvfp4-experts", 48),
        ("moe", "nvfp4-mlp", 48),
        ("dense", "nvfp4-mlp", 6),
        ("moe", "fp8", 0),
        ("dense", "nvfp4", 14),
    ],
)
def test_each_preset_writes_a_recipe_that_plan_accepts(model_dirs, kind, preset, fourbit):
    d, dirs = model_dirs
    out = d / f"{kind}-{preset}.yaml"
    r = run_main("init", str(dirs[kind]), "--preset", preset, "-o", str(out), "--force", cwd=d)
    assert r.returncode == 0, r.stderr
    rec = load_recipe(out)
    assert rec.quant.mixed == ("-" in preset)
    res = plan(rec, nproc_per_node=1)
    rows = {r.weights: r.linears for r in res.schemes.rows}
    assert rows.get("nvfp4 tensor", 0) == fourbit
    assert rows["unquantized"] == 1  # lm_head (the routers are no linear of these models)
    if rec.quant.mixed:
        assert rows["fp8 block 128x128"] == 8  # attention: q, k, v, o of 2 layers
    assert math.isfinite(res.schemes.export_bytes)


def test_nvfp4_experts_of_a_dense_model_is_one_line(model_dirs):
    d, dirs = model_dirs
    out = d / "none.yaml"
    r = run_main("init", str(dirs["dense"]), "--preset", "nvfp4-experts", "-o", str(out), cwd=d)
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.strip().splitlines()[-1] == (
        "qckpt: error: --preset nvfp4-experts: llama is dense (no routed experts); "
        "--preset nvfp4-mlp is its mix (NVFP4 MLP + FP8 attention)"
    )


def test_fp8_block_with_dynamic_inputs_stores_one_scale_per_block_and_calibrates_no_input(
    tmp_path,
):
    def block(s):
        s[1]["weights"] = {"format": "fp8", "granularity": "block", "block_size": [32, 32]}
        s[1]["inputs"] = {"format": "fp8", "granularity": "block", "block_size": [1, 32],
                          "dynamic": True}  # fmt: skip

    res = plan(load_recipe(_mixed(tmp_path, block), [NOWHERE]), nproc_per_node=1)
    (attn,) = [r for r in res.schemes.rows if r.entry == "quant.schemes[1]"]
    assert attn.inputs == "fp8 block 1x32 dynamic"
    # q/k/v/o of tiny-moe: 64x64, 32x64, 32x64, 64x64 -> 4 + 2 + 2 + 4 blocks per layer
    assert attn.amax_bytes == 2 * 12 * 4
    assert attn.export_bytes == attn.parameters + 2 * 12 * 2
