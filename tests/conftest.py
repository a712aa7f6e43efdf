import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_qckpt(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """Run the CLI as a user would (``python -m qckpt``), capturing stdout and stderr."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("QCKPT_DEBUG", None) if env is None or "QCKPT_DEBUG" not in env else None
    return subprocess.run(
        [sys.executable, "-m", "qckpt", *args],
        cwd=str(cwd or ROOT),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def qckpt_cli():
    return run_qckpt
