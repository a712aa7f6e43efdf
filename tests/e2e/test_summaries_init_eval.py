"""The two commands ``test_summaries`` does not run on its DCP recipe, ``init`` and ``eval``
(issue 30: a test per command): a short default output holding what was written or read and,
for eval, the whole command's peak against its bound; nothing of torch or torchao on the way."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_qckpt
from tests.e2e.test_summaries import MAX_LINES, PEAK
from tests.quantized_fixtures import bf16_dir


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("init-eval")
    model = bf16_dir(d, "tiny-moe")
    recipe = d / "recipe.yaml"
    init = run_qckpt("init", str(model), "-o", str(recipe), cwd=d)
    sets = [
        "--set", "calibrate.data.num_samples=8", "--set", "calibrate.data.seq_len=32",
        "--set", f"calibrate.output={d}/calib.safetensors", "--set", f"export.output={d}/fp8",
    ]  # fmt: skip
    for cmd in ("calibrate", "export"):
        r = run_qckpt(cmd, str(recipe), *sets, cwd=d)
        assert r.returncode == 0, r.stderr[-2000:]
    data = d / "heldout.bin"
    ids = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
    data.write_bytes(bytes(ids.tolist()))
    ev = run_qckpt(
        "eval", f"{d}/fp8", "--source", str(model), "--data", str(data), "--windows", "4",
        "--seq-len", "64", "--json", str(d / "eval.json"), cwd=d,
    )  # fmt: skip
    return d, model, recipe, init, ev


def _lines(r) -> list[str]:
    return [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]


def test_init_says_what_it_found_and_where_the_recipe_went(made):
    d, _, recipe, init, _ = made
    assert init.returncode == 0, init.stderr
    lines = _lines(init)
    assert len(lines) <= MAX_LINES, lines
    assert init.stdout.strip() == f"wrote {recipe}"
    assert any("MoE, 2 layers" in ln for ln in lines) and any(
        "predicted peak" in ln for ln in lines
    )
    assert all(ln.startswith(("init: ", "  ")) for ln in init.stderr.splitlines()), init.stderr


def test_eval_prints_the_figures_the_peak_and_nothing_foreign(made):
    d, model, _, _, ev = made
    assert ev.returncode == 0, ev.stderr[-2000:]
    lines = _lines(ev)
    assert len(lines) <= MAX_LINES, lines
    text = ev.stdout + ev.stderr
    assert f"{d}/fp8" in text and str(model) in text
    assert PEAK.search(text), text
    rep = json.loads((d / "eval.json").read_text())
    assert f"{rep['export_bits_per_byte']:.4f} bits/byte" in ev.stdout
    for foreign in ("torchao", "Failed to load", "UserWarning", "W1202", "Traceback"):
        assert foreign not in text, text
