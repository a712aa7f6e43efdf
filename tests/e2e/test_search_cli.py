"""``qckpt search`` as a user runs it: the found recipe calibrates and exports unchanged, the
bytes it counted are the export's own, and bad budgets are one line and exit 2."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from tests._inproc import run_main

RECIPE = {
    "model": {"source": "tiny-moe", "dtype": "bfloat16", "seed": 0},
    "checkpoint": {"path": "dcp"},
    "load": {"params": "none"},
    "quant": {"ignore": ["lm_head", "*.mlp.gate"]},
    "search": {
        "budget": "6bpw",
        "candidates": [
            {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}},
            {"weights": {"format": "fp8", "granularity": "channel"},
             "inputs": {"format": "fp8", "dynamic": True}},
            {"weights": {"format": "none"}},
        ],
    },
    "calibrate": {"data": {"source": "synthetic", "num_samples": 8, "seq_len": 16,
                           "batch_size": 2}, "output": "calib.safetensors"},
    "export": {"output": "export"},
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("search")
    (run / "search.yaml").write_text(yaml.safe_dump(RECIPE))
    r = run_main("convert", "search.yaml", "dcp", cwd=run)
    assert r.returncode == 0, r.stderr
    return run


def _tensor_bytes(export: Path) -> dict[str, int]:
    out = {}
    for f in sorted(export.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = v["data_offsets"][1] - v["data_offsets"][0]
    return out


def test_the_found_recipe_exports_the_bytes_it_counted(run):
    r = run_main("search", "search.yaml", "-o", "found.yaml", "--json", "s.json", cwd=run)
    assert r.returncode == 0, r.stderr
    assert "wrote found.yaml" in r.stdout
    rep = json.loads((run / "s.json").read_text())
    assert rep["linear_bytes"] <= rep["limit_bytes"] and rep["bits_per_weight"] <= 6
    chosen = {u["candidate"] for u in rep["units"]}
    assert len(chosen) >= 2  # a mixed choice, not one scheme everywhere
    found = yaml.safe_load((run / "found.yaml").read_text())
    assert "search" not in found and found["quant"]["schemes"]
    for cmd in ("calibrate", "export"):
        r = run_main(cmd, "found.yaml", cwd=run)
        assert r.returncode == 0, r.stderr
    got = _tensor_bytes(run / "export")
    assert sum(got.values()) == rep["export_bytes"]
    # per unit: the bytes of its linears' tensors (codes, scales, global and input scales)
    for u in rep["units"]:
        parent, fused, _ = u["unit"].partition("#")
        if fused:  # q/k/v: the tensors of the three under their attention
            members = [f"{parent}.{p}." for p in ("q_proj", "k_proj", "v_proj")]
        else:  # one linear, or every expert of an experts module
            members = [parent + "."]
        mine = [k for k in got if k.startswith(tuple(members))]
        assert sum(got[k] for k in mine) == u["bytes"], u["unit"]


def test_a_size_budget_counts_the_whole_export(run):
    r = run_main("search", "search.yaml", "-o", "f2.yaml", "--json", "s2.json",
                 "--budget", "200000", cwd=run)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = json.loads((run / "s2.json").read_text())
    assert rep["export_bytes"] <= 200000 and rep["other_bytes"] > 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--budget", "1bpw"], "below the smallest export of these candidates, 4.5"),
        (["--budget", "4.5 bits"], "is neither bits per weight"),
        (["--budget", "1000"], "below the smallest export of these candidates,"),
    ],
)
def test_bad_budgets_are_one_line_and_exit_2(run, args, says):
    r = run_main("search", "search.yaml", "-o", "bad.yaml", *args, cwd=run)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (run / "bad.yaml").exists()


def test_a_recipe_without_candidates_is_one_line_and_exit_2(run):
    plain = {k: v for k, v in RECIPE.items() if k != "search"}
    (run / "plain.yaml").write_text(yaml.safe_dump(plain))
    r = run_main("search", "plain.yaml", "-o", "bad.yaml", "--budget", "6bpw", cwd=run)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "qckpt: error: search: the recipe has no search section (search.candidates)"
    ]
