"""The Triton kernels' logic on a machine without a GPU: Triton's CPU interpreter runs every
kernel of qckpt/formats/triton_kernels.py (fp8 per-tensor with the scale made in the kernel, a given
scale, the NaN/Inf guard, mxfp8), and each code, scale and amax must equal the torch path's.

The interpreter's own FP8 cast drops mantissa carries, so the kernels' integer rounding
(``KernelPolicy(soft_fp8_cast=True)``) stands in for the hardware conversion; tests/gpu compares the
hardware path. A subprocess, because the interpreter is chosen when triton is imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def test_every_kernel_matches_the_torch_path_in_the_interpreter() -> None:
    script = Path(__file__).with_name("_triton_interpret_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["failed"] == {}, out["failed"]
    assert len(out["results"]) == 48
    bad = {k: {c: n for c, n in v.items() if n} for k, v in out["results"].items()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, bad
