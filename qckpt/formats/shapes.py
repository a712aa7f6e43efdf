"""The shape of a quantizer's amax, derived from (quant config, tensor shape) in one place.

The quantizer lays out what it records, the TP gather makes a shard's amax whole, the export
checks the calibration file and sizes the block scales it writes: all of them call
:func:`amax_shape`, so they cannot disagree on what a block size means.

Block sizes: the recipe normalizes ``quant.*.block_size`` when it is validated (``[b]`` means
``[b, b]``, a square block, as the export layouts and the serving stacks assume). A weight's
block is ``(rows, cols)``; an input's blocks run along its last dim, ``block_size[-1]`` wide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# granularities whose amax is one number (NVFP4's block scales are made when quantizing; only
# its per-tensor global amax is calibrated)
SCALAR_GRANULARITIES = ("tensor", "dynamic_block")


def weight_block(block_size: Sequence[int]) -> tuple[int, int]:
    """A weight's (row, column) block; the recipe has already turned ``[b]`` into ``[b, b]``."""
    if len(block_size) != 2:
        raise ValueError(f"a weight block is (rows, cols), got {tuple(block_size)}")
    return int(block_size[0]), int(block_size[1])


def amax_shape(
    granularity: str,
    kind: str,
    shape: Sequence[int],
    block_size: Sequence[int] = (128, 128),
    axis: int = 0,
) -> tuple[int, ...]:
    """The amax of a ``kind`` ("weight", "input", "output") tensor of ``shape``.

    ``()`` per tensor, ``(shape[axis],)`` per channel of a 2-D weight, ``(ceil(rows/b0),
    ceil(cols/b1))`` per block of a 2-D weight, ``(ceil(features/b),)`` per block of an input
    (the last block of a dim that the block size does not divide is partial).
    """
    shape = tuple(int(s) for s in shape)
    if granularity in SCALAR_GRANULARITIES:
        return ()
    if granularity == "channel":
        if len(shape) != 2:
            raise ValueError(f"per-channel amax needs a 2-D weight, got {shape}")
        return (shape[axis],)
    if granularity != "block":
        raise ValueError(f"unknown granularity {granularity!r}")
    if kind not in ("weight", "weight_clip"):
        return (math.ceil(shape[-1] / int(block_size[-1])),)
    if len(shape) != 2:
        raise ValueError(f"per-block amax needs a 2-D weight, got {shape}")
    b0, b1 = weight_block(block_size)
    return (math.ceil(shape[0] / b0), math.ceil(shape[1] / b1))
