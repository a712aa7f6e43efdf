import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs the fuzz tests on a fixed sequence of examples, so a red CI always reproduces;
# QCKPT_FUZZ_RANDOM=1 draws fresh examples to look for new failures.
settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("random", print_blob=True)
settings.load_profile("random" if os.environ.get("QCKPT_FUZZ_RANDOM") else "fixed")

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
