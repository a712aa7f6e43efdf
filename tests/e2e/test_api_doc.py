"""docs/API.md cannot rot: its ``python`` blocks, run in order as one script in a fresh dir,
load, calibrate, export and check the tiny model through the front door; the export they
write is byte for byte the one ``qckpt export`` writes from the same checkpoint and file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from tests.conftest import ROOT

BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def doc_script() -> str:
    blocks = BLOCK.findall((ROOT / "docs" / "API.md").read_text())
    assert len(blocks) >= 4, "docs/API.md lost its python blocks"
    return "\n".join(blocks)


# after the doc, in the same process (torch imported once): the CLI's export of the doc's
# checkpoint and calibration file
CLI_EXPORT = """
from qckpt.cli.app import main
try:
    main(["export", "configs/tiny-dense.yaml", "--set", "checkpoint.path=runs/api/hf",
          "--set", "calibrate.output=runs/api/calib.safetensors",
          "--set", "export.output=runs/api/cli"])
except SystemExit as exc:
    assert not exc.code, exc.code
"""


def test_the_api_doc_runs_and_exports_what_the_cli_exports(tmp_path):
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "tiny-dense.yaml", tmp_path / "configs")
    (tmp_path / "api_doc.py").write_text(doc_script() + CLI_EXPORT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "api_doc.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded 21 tensors" in r.stdout, r.stdout
    assert "runs/api/fp8: OK" in r.stdout, r.stdout
    assert re.search(r"refused: export\.output: .* already exists", r.stdout), r.stdout

    runs = tmp_path / "runs" / "api"
    names = sorted(p.name for p in (runs / "cli").iterdir() if p.name != ".qckpt-export.json")
    assert names == sorted(
        p.name for p in (runs / "fp8").iterdir() if p.name != ".qckpt-export.json"
    )
    assert any(n.endswith(".safetensors") for n in names), names
    for name in names:
        assert (runs / "fp8" / name).read_bytes() == (runs / "cli" / name).read_bytes(), name
