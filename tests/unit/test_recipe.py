import pytest

from qckpt.errors import RecipeError
from qckpt.recipe import load_recipe, parse_size, recipe_from_dict


def test_defaults_match_design():
    r = recipe_from_dict({})
    assert r.model.source == "tiny-moe"
    assert r.load.params == "fp8" and r.load.stream is True and r.load.backend == "native"
    assert r.quant.ignore == ["lm_head", "*.mlp.gate"]
    assert r.parallel.ep == 1 and r.parallel.tp == 1
    assert r.export.format == "compressed-tensors" and r.export.overwrite is False
    assert r.calibrate.offload == "none" and r.calibrate.activations == "device"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model": {"sourc": "x"}}, "model.sourc: unknown key; did you mean 'model.source'?"),
        ({"lod": {}}, "lod: unknown key; did you mean 'load'?"),
        ({"parallel": {"ep": "two"}}, "parallel.ep: expected an integer, got 'two'"),
        ({"parallel": {"ep": 0}}, "parallel.ep: must be >= 1"),
        ({"load": {"stream": "yes"}}, "load.stream: expected true or false"),
        ({"load": {"params": "fp9"}}, "load.params: must be one of"),
        (
            {"calibrate": {"data": {"num_samples": -1}}},
            "calibrate.data.num_samples: must be positive",
        ),
        ({"calibrate": {"data": {"source": "text"}}}, "calibrate.data.path: required"),
        ({"export": {"max_shard_size": "lots"}}, "export.max_shard_size: not a size"),
        (
            {"quant": {"weights": {"granularity": "row"}}},
            "quant.weights.granularity: must be one of",
        ),
        ({"quant": {"ignore": "lm_head"}}, "quant.ignore: expected a list"),
        ({"model": "tiny"}, "model: expected a mapping"),
        (
            {"calibrate": {"offload": "disk"}},
            "calibrate.offload: must be one of none, layer, host; got 'disk'",
        ),
        (
            {"calibrate": {"gptq_inputs": "int4"}},
            "calibrate.gptq_inputs: must be one of source, quantized; got 'int4'",
        ),
        (
            {"calibrate": {"activations": "host"}},
            "calibrate.activations: host needs calibrate.offload: layer or host",
        ),
        (
            {"calibrate": {"offload": "layer", "weights_resident": "fp8"}},
            "calibrate.offload: layer does not combine with calibrate.weights_resident: fp8",
        ),
    ],
)
def test_errors_name_the_yaml_path(raw, message):
    with pytest.raises(RecipeError) as ei:
        recipe_from_dict(raw)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


def test_world_size_check_names_the_key():
    r = recipe_from_dict({"parallel": {"ep": 2}})
    with pytest.raises(RecipeError, match=r"^parallel.ep: must divide the world size 3$"):
        r.parallel.check_world(3)
    assert r.parallel.check_world(4) == 2
    r = recipe_from_dict({"parallel": {"ep": 2, "tp": 2}})
    with pytest.raises(RecipeError, match="parallel.tp"):
        r.parallel.check_world(6)


def test_overrides_parse_values_as_yaml():
    r = recipe_from_dict(
        {},
        [
            "load.stream=false",
            "parallel.ep=2",
            "quant.ignore=[lm_head]",
            "quant.weights.block_size=[64, 64]",
            "export.output=some/where",
        ],
    )
    assert r.load.stream is False
    assert r.parallel.ep == 2
    assert r.quant.ignore == ["lm_head"]
    assert r.quant.weights.block_size == [64, 64]
    assert r.export.output == "some/where"


def test_override_errors():
    with pytest.raises(RecipeError, match="expected key.path=value"):
        recipe_from_dict({}, ["load.stream"])
    with pytest.raises(RecipeError, match="load.strem: unknown key"):
        recipe_from_dict({}, ["load.strem=false"])


def test_load_recipe_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="a recipe is a mapping"):
        load_recipe(lst)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("0GB")


def test_every_config_validates():
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
    assert configs, "configs/ must hold example recipes"
    for c in configs:
        load_recipe(c)
