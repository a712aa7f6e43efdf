"""A model dir that ships its own Python (``auto_map``) is refused; its code never runs."""

import json
import subprocess
import sys

import pytest

from qckpt.calib.data import calibration_batches
from qckpt.errors import UsageError
from qckpt.models.build import load_config
from qckpt.recipe import DataConfig
from tests.conftest import ROOT

_EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


def _evil_dir(tmp_path, where: str = "config.json"):
    """A llama-shaped model dir whose ``auto_map`` points at files that leave a marker if run."""
    d = tmp_path / "evil-model"
    d.mkdir()
    marker = tmp_path / "MARKER"
    for mod in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (d / f"{mod}.py").write_text(_EVIL.format(marker=str(marker)))
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2}
    cfg |= {"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    auto_map = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
    }
    tok = {"tokenizer_class": "EvilTokenizer"}
    (cfg if where == "config.json" else tok)["auto_map"] = auto_map
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return d, marker


def _run(*args, cwd):
    # stdin closed: a prompt ("Do you wish to run the custom code? [y/N]") would fail, not wait
    return subprocess.run(
        [sys.executable, "-m", "qckpt", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


def _refused(r, marker) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "never runs code from a model dir" in lines[0]
    assert "Traceback" not in r.stderr and "[y/N]" not in r.stdout + r.stderr
    assert not marker.exists()
    return lines[0]


def test_load_refuses_a_model_dir_with_auto_map(tmp_path):
    d, marker = _evil_dir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {d}}}\ncheckpoint: {{path: {d}}}\n")
    line = _refused(_run("load", str(recipe), cwd=tmp_path), marker)
    assert "config.json" in line and "modeling_evil.py" in line


def test_convert_refuses_a_model_dir_with_auto_map(tmp_path):
    d, marker = _evil_dir(tmp_path)
    _refused(_run("convert", str(d), str(tmp_path / "out"), cwd=tmp_path), marker)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_library_refuses_before_transformers_is_asked(tmp_path, where):
    d, marker = _evil_dir(tmp_path, where)
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text " * 50)
    with pytest.raises(UsageError, match=f"{where} asks to run"):
        if where == "config.json":
            load_config(str(d))
        calibration_batches(
            DataConfig(source="text", path=str(text), num_samples=2, seq_len=8),
            vocab_size=256,
            model_source=str(d),
        )
    assert not marker.exists()
