"""One process's vLLM engines at a time where ``QCKPT_VLLM_LOCK`` names a file: the GPU round
runs these tests beside bench.quality's engines on one GPU, and an engine that starts while
another process's engines hold most of the memory fails its memory profile. The lock is
bench.quality's own (:func:`bench.quality.vllm_lock`)."""

from __future__ import annotations

import pytest

from bench.quality import vllm_lock


@pytest.fixture(autouse=True)
def _one_process_of_vllm_engines():
    with vllm_lock():
        yield
