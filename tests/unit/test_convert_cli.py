"""``qckpt convert`` as a user runs it: round trip, refusal of an existing target, no half output."""

from safetensors import safe_open

from tests.conftest import ROOT, run_qckpt


def test_convert_round_trip_and_refusals(tmp_path):
    recipe = str(ROOT / "configs" / "tiny-dense.yaml")
    r = run_qckpt("convert", recipe, str(tmp_path / "dcp"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {tmp_path / 'dcp'} (dcp)"
    assert (tmp_path / "dcp" / ".metadata").is_file() and (
        tmp_path / "dcp" / "config.json"
    ).is_file()

    r = run_qckpt("convert", recipe, str(tmp_path / "dcp"))
    assert r.returncode == 2 and "already exists" in r.stderr

    r = run_qckpt("convert", str(tmp_path / "dcp"), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight" in set(f.keys())

    # a conversion that fails leaves nothing under the target's name, nor a staging dir
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "dcp" / "config.json").rename(tmp_path / "nocfg" / "moved.json")
    r = run_qckpt("convert", str(tmp_path / "dcp"), str(tmp_path / "hf2"))
    assert r.returncode == 2 and "pass --model SOURCE" in r.stderr
    assert not (tmp_path / "hf2").exists()
    r = run_qckpt("convert", str(tmp_path / "dcp"), str(tmp_path / "hf3"), "--model", "tiny-moe")
    assert r.returncode == 1, r.stderr  # a checkpoint of another model: a one-line error
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf3").exists()
    assert not any(p.name.endswith("qckpt-partial") for p in tmp_path.iterdir())
