"""The fast read's sizes, apart from its engine (:mod:`qckpt.read.fast_read`, which
imports torch.distributed.checkpoint): the start-up's CUDA warm-up sizes its pinned buffers
from them before the model's code is imported (:mod:`qckpt.pipeline.imports`)."""

from __future__ import annotations

import os

CHUNK_BYTES = 16 << 20  # one read piece: large enough for full-speed reads, small to overlap


# read-ahead: the bytes of the streamed destinations after the ``max_inflight`` live ones that
# the readers may read into staging buffers before those destinations get their scratch, so
# the reads go on while the previous destination's last copies land and its quantize runs.
# Device loads only (host memory, pinned, in CHUNK_BYTES buffers)
READ_AHEAD_BYTES = 256 << 20


# on an H200 host 4 threads read the 8-layer Qwen3-30B-A3B shape faster than 16 (1.54 vs 1.78 s):
# past a few threads the readers' per-piece Python contends for the GIL
MAX_THREADS = 8


def default_threads() -> int:
    """Reader threads when none are asked for: the cores, at least 2, at most 8."""
    return max(2, min(MAX_THREADS, os.cpu_count() or 2))
