import pytest

from tests.conftest import run_qckpt

COMMANDS = ["load", "calibrate", "export", "inspect", "convert", "check", "init"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_examples(cmd):
    r = run_qckpt(cmd, "--help")
    assert r.returncode == 0
    assert "Examples" in r.stdout
    assert f"qckpt {cmd}" in r.stdout


@pytest.mark.parametrize(
    "text, needle",
    [
        ("model:\n  sourc: tiny-moe\n", "model.sourc: unknown key; did you mean 'model.source'?"),
        ("parallel:\n  ep: two\n", "parallel.ep: expected an integer"),
        ("model: [\n", "not valid YAML"),
        ("load:\n  params: fp9\n", "load.params: must be one of"),
    ],
)
@pytest.mark.parametrize("cmd", ["load", "calibrate", "export"])
def test_broken_recipe_exits_2_with_one_line(tmp_path, cmd, text, needle):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    r = run_qckpt(cmd, str(recipe))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_bad_override_exits_2(tmp_path):
    r = run_qckpt("load", "configs/tiny-moe.yaml", "--set", "load.strem=false")
    assert r.returncode == 2
    assert "load.strem: unknown key; did you mean 'load.stream'?" in r.stderr


def test_unknown_flag_is_usage_error():
    r = run_qckpt("load", "configs/tiny-moe.yaml", "--bogus")
    assert r.returncode == 2
    assert "--bogus" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_debug_shows_traceback(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  sourc: x\n")
    r = run_qckpt("load", str(recipe), env={"QCKPT_DEBUG": "1"})
    assert r.returncode == 2
    assert "Traceback" in r.stderr and "RecipeError" in r.stderr


def test_world_that_does_not_fit_the_recipe(tmp_path):
    r = run_qckpt(
        "calibrate", "configs/tiny-moe.yaml", "--set", "parallel.ep=2", env={"WORLD_SIZE": "3"}
    )
    assert r.returncode == 2
    assert "parallel.ep: must divide the world size 3" in r.stderr


def test_inspect_missing_path_exits_1():
    r = run_qckpt("inspect", "/no/such/place")
    assert r.returncode == 1
    assert r.stderr.strip() == "qckpt: error: /no/such/place: no such file or directory"
