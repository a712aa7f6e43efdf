"""``make demo`` as a new user sees it (issue 30): at most 60 lines, every one of them qckpt's
own or the demo's (no library's warnings, no launcher banner)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

MAX_LINES = 60
# the demo's headers, each command's summary (first line, its indented figures) and result
OURS = re.compile(
    r"^(== \d\. |  \S|(convert|load|calibrate|export): |wrote |loaded |\S+/fp8: OK \(|"
    r"export \S+/fp8: next-token logits vs BF16: )"
)


def test_the_demo_prints_at_most_60_lines_all_of_them_qckpts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QCKPT_DEBUG"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["QCKPT_DEMO_RUN"] = str(tmp_path / "demo")
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, text
    foreign = [ln for ln in lines if not OURS.match(ln)]
    assert not foreign, foreign
    assert text.count("== ") == 5 and "-> OK" in text, text
