"""``qckpt init MODEL_DIR`` (issue 30): a commented recipe that ``qckpt plan`` accepts, and for
the tiny models one that calibrates and exports, in three commands from a model dir."""

from __future__ import annotations

import json

import pytest

from qckpt import load_recipe
from tests._inproc import run_main
from tests.conftest import ROOT
from tests.quantized_fixtures import bf16_dir

QWEN3 = ROOT / "configs" / "models" / "qwen3-30b-a3b"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("init")
    return d, {"dense": bf16_dir(d, "tiny-dense"), "moe": bf16_dir(d, "tiny-moe")}


def _init(d, model, *args):
    out = d / f"{model.name}{'-'.join(args)}.yaml"
    r = run_main("init", str(model), "-o", str(out), *args, cwd=d)
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_init_writes_a_recipe_that_plans_calibrates_and_exports(dirs, kind):
    d, models = dirs
    recipe = _init(d, models[kind])
    text = recipe.read_text()
    assert "# " in text and ("MoE, 2 layers" in text) == (kind == "moe")
    r = load_recipe(recipe)
    assert r.checkpoint.path == str(models[kind])  # the model dir's own weights
    assert r.quant.ignore == (["lm_head", "*.mlp.gate"] if kind == "moe" else ["lm_head"])
    if kind == "moe":
        assert "expert weights per-expert" in text  # transformers saves them per expert
    assert run_main("plan", str(recipe), "--nproc-per-node", "1", cwd=d).returncode == 0
    sets = ["--set", "calibrate.data.num_samples=8", "--set", "calibrate.data.seq_len=32"]
    rc = run_main("calibrate", str(recipe), *sets, cwd=d)
    assert rc.returncode == 0, rc.stderr
    re = run_main("export", str(recipe), "--json", str(d / f"{kind}.json"), cwd=d)
    assert re.returncode == 0, re.stderr
    out = d / r.export.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert run_main("check", str(out), cwd=d).returncode == 0


@pytest.mark.parametrize(("gpus", "fmt"), [(1, "fp8"), (2, "nvfp4")])
def test_init_of_a_config_only_qwen3_moe_plans_on_the_gpus_given(tmp_path, gpus, fmt):
    out = tmp_path / "q.yaml"
    r = run_main(
        "init", str(QWEN3), "--gpus", str(gpus), "--gpu-memory", "139GiB", "--format", fmt,
        "-o", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rec = load_recipe(out)
    assert rec.quant.weights.format == fmt and rec.quant.ignore == ["lm_head", "*.mlp.gate"]
    assert "128 experts (top-8)" in out.read_text()
    p = run_main(
        "plan", str(out), "--nproc-per-node", str(gpus), "--gpu-memory", "139GiB",
        "--json", str(tmp_path / "p.json"), cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    fits = json.loads((tmp_path / "p.json").read_text())["fits"]
    assert fits["load"] and fits["calibrate"], fits


def test_init_refuses_a_layout_that_cannot_fit_and_writes_nothing(tmp_path):
    out = tmp_path / "q.yaml"
    r = run_main("init", str(QWEN3), "--gpu-memory", "1GiB", "-o", str(out), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("qckpt: error: --gpus 1: no EP/TP layout")
    assert not out.exists()


def test_init_of_a_dir_without_config_is_one_line(tmp_path):
    r = run_main("init", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == f"qckpt: error: MODEL_DIR: {tmp_path}: no config.json there"
