"""Helpers for formats with blocks along the last dim (mxfp8, nvfp4)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from qckpt.formats import numerics


def rows2d(x: torch.Tensor) -> torch.Tensor:
    """(rows, K) view of x over its last dim (a 0-d tensor is one row of one element).

    A non-contiguous x costs one copy in its own dtype."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if k == 0:
        rows = 1
        for d in x.shape[:-1]:
            rows *= d
    return x.reshape(rows, k)


def nblocks(k: int, block: int) -> int:
    return -(-k // block)


def last_dim(shape: tuple[int, ...]) -> int:
    return shape[-1] if len(shape) else 1


def padded_blocks(c: torch.Tensor, block: int) -> torch.Tensor:
    """(R, K) chunk -> float32 (R, nb, block), the partial last block padded with zeros.

    Zeros never change a block's amax, so a partial block is scaled by its valid elements only;
    the padding's codes are dropped (mxfp8) or end up as +0 nibbles (nvfp4's odd K)."""
    r, k = c.shape
    nb = nblocks(k, block)
    cf = c.to(torch.float32)
    if nb * block != k:
        cf = F.pad(cf, (0, nb * block - k))
    return cf.reshape(r, nb, block)


def row_chunks(rows: int, k: int, chunk_elems: int | None = None) -> Iterator[tuple[int, int]]:
    return numerics.chunk_ranges(rows, numerics.rows_per_chunk(k, chunk_elems))


def view_keep_last(
    shape_old: tuple[int, ...], shape_new: tuple[int, ...], fmt: str
) -> tuple[int, ...]:
    """Check that a view keeps the last dim (the block axis); returns the new leading shape."""
    # a 0-d tensor counts as one block of one element (last dim 1), like its stored layout
    if last_dim(shape_old) != last_dim(shape_new):
        raise numerics.UnsupportedOpError(
            f"{fmt}: cannot view shape {shape_old} as {shape_new} without dequantizing: "
            "the blocks run along the last dim, so a view must keep it"
        )
    return tuple(shape_new[:-1])
