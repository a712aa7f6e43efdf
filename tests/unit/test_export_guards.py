"""export refuses a checkpoint it would otherwise corrupt in silence (issue 13).

* a NaN (or Inf) weight: it would become a NaN FP8 code and the export would exit 0;
* weights that are not the ones calibrated (same names and shapes, so the fingerprint matches):
  a weight larger than its calibrated amax would be clipped to stale scales without a word.

The calibration is made from the clean model; the checkpoint is then tampered with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from qckpt.errors import ExportError
from tests.conftest import run_qckpt
from tests.export_fixtures import (
    make_calibration,
    quant_config,
    run_export,
    saved_model,
    tampered,
    write_calibration,
)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("guards")
    model, hf_dir = saved_model(root, "tiny-dense")
    return root, model, hf_dir


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_nan_weight_refused_by_the_cli_naming_the_tensor(dense):
    root, model, hf_dir = dense
    q = quant_config("tensor", "static")
    cal = write_calibration(root, model, q, "calib-nan.safetensors")
    w = "model.layers.1.mlp.up_proj.weight"
    bad = tampered(root, hf_dir, "nan", lambda sd: sd[w].__setitem__((3, 5), float("nan")))
    before = _digest(bad)
    out = root / "out-nan"
    recipe = root / "nan.yaml"
    recipe.write_text(
        f"model: {{source: {bad}}}\ncheckpoint: {{path: {bad}}}\n"
        "quant:\n  weights: {format: fp8, granularity: tensor}\n"
        "  inputs: {format: fp8, granularity: tensor, dynamic: false}\n"
        f"calibrate: {{output: {cal}}}\nexport: {{output: {out}}}\n"
    )
    r = run_qckpt("export", str(recipe), cwd=root)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == (
        f"qckpt: error: {w}: not finite (NaN or Inf in row 3) in the checkpoint; "
        "refusing to quantize it"
    )
    assert not out.exists() and not list(root.glob(".out-nan*"))
    assert _digest(bad) == before


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_weights_other_than_the_calibrated_ones_are_refused(dense, granularity):
    root, model, hf_dir = dense
    inputs = "static" if granularity == "tensor" else "token"
    q = quant_config(granularity, inputs)
    cal = make_calibration(model, q)
    w = "model.layers.0.self_attn.o_proj.weight"
    bad = tampered(root, hf_dir, f"grown-{granularity}", lambda sd: sd[w][7].mul_(3.0))
    out = root / f"out-grown-{granularity}"
    with pytest.raises(ExportError) as e:
        run_export(model, bad, cal, out, q)
    msg = str(e.value)
    assert msg.startswith(f"{w}: amax ")
    assert "exceeds the calibrated weight amax" in msg
    assert "not the one that was calibrated" in msg
    if granularity == "channel":
        assert "(row 7)" in msg
    assert "\n" not in msg and not out.exists()


def test_the_calibrated_checkpoint_itself_passes(dense):
    root, model, hf_dir = dense
    q = quant_config("channel", "token")
    out = root / "out-clean"
    run_export(model, hf_dir, make_calibration(model, q), out, q)
    assert (out / "config.json").is_file()
    # a weight that only shrinks is still covered by its scales: not refused
    w = "model.layers.0.mlp.down_proj.weight"
    smaller = tampered(root, hf_dir, "smaller", lambda sd: sd[w].mul_(torch.tensor(0.5)))
    run_export(model, smaller, make_calibration(model, q), root / "out-smaller", q)
