"""One process's vLLM engines at a time where ``QCKPT_VLLM_LOCK`` names a file: the GPU round
runs these tests beside bench.quality's engines on one GPU, and an engine that starts while
another process's engines hold most of the memory fails its memory profile (the bench takes
the same lock in ``bench.quality.vllm_lock``)."""

from __future__ import annotations

import fcntl
import os

import pytest


@pytest.fixture(autouse=True)
def _one_process_of_vllm_engines():
    path = os.environ.get("QCKPT_VLLM_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
