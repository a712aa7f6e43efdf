"""MX (MXFP4 / MXFP8) with each 32-block's E8M0 exponent searched for the least squared error.

The max rule (:mod:`qckpt.formats.mx_codes`) takes a block's exponent ``e`` from its amax
(rounded to a power of two). The search tries ``e`` (first: a tie keeps the rule's), ``e + 1``
(no element clips: under MXFP4's rounding rule a block whose amax lies in [6, 7) x 2**e clips
its largest values to 6) and ``e - 1`` (the largest values clip, the others get twice the
resolution: a heavy-tailed block's few outliers against its 31 others), each clamped to
E8M0's [-127, 127], and keeps the one with the least ``sum((w - dq(q(w)))**2)`` over the
block. Every candidate is rounded by :func:`qckpt.formats.mx_codes.mx_round` (the export's
rounding, GPTQ's too) and the codes written by :func:`qckpt.formats.mx_codes.mx_quantize` with
the chosen exponents (given exponents, as GPTQ's), so the codes written are the codes measured.

Nothing is carried from the calibration: the choice is a function of the weight alone, made
again by the export (``calibrate.algorithm: mse`` -> ``BlockScales.search``) with
:func:`mx_mse_quantize`, as NVFP4's searched block scales are. A block's 32 squared errors
(float64 squares of float64 differences) are added as a fixed tree of elementwise additions
(:func:`qckpt.formats.numerics.tree_sum`), so the choice is the same on every device.

Given per-column weights ``h`` (``calibrate.mse_weighting: hessian``: the layer's input
``H_jj``), each square is multiplied by its column's weight before the tree, so a block's
exponent minimises ``sum_j h_j (w_j - q_j)**2``. Then the choice is no longer the weight's
alone: the calibration file carries ``h`` and the export searches with it again.
"""

from __future__ import annotations

import torch

from qckpt.formats.mx_codes import E8M0_BIAS, MX_EMAX, MX_GROUP, mx_exponents, mx_quantize, mx_round
from qckpt.formats.numerics import tree_sum
from qckpt.formats.rowblock import row_chunks

# exponent steps from the max rule's: 0 first (ties keep it), then a larger scale, a smaller one
MX_STEPS = (0, 1, -1)
_CHUNK = 1 << 20  # elements per chunk of the search


def mx_block_search(
    x: torch.Tensor, bits: int, hb: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(searched unbiased exponents int32 ``[R, nb]``, their float64 squared error per block,
    the max rule's error per block) of float32 blocks ``x`` ``[R, nb, 32]``; ``hb``: float64
    weights of the squares (``[nb, 32]``, broadcast over rows), or None."""
    base = mx_exponents(x.abs().amax(dim=-1), MX_EMAX[bits])
    best_e = best_err = err0 = None
    for step in MX_STEPS:
        e = (base + step).clamp_(-E8M0_BIAS, E8M0_BIAS)
        d = x.to(torch.float64) - mx_round(x, e.unsqueeze(-1), bits).to(torch.float64)
        sq = d * d
        err = tree_sum(sq if hb is None else sq * hb)
        if best_e is None:
            best_e, best_err, err0 = e, err, err
            continue
        better = err < best_err
        best_e = torch.where(better, e, best_e)
        best_err = torch.where(better, err, best_err)
    return best_e, best_err, err0


def mx_mse_quantize(
    w: torch.Tensor, bits: int, h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(codes, biased E8M0 scales uint8 ``[rows, cols / 32]``, the error with the searched and
    with the max rule's exponents) of 2-D ``w`` whose columns 32 divide: :func:`mx_quantize`'s
    codes and scales under the exponents :func:`mx_block_search` chooses, row chunk by chunk.
    ``h``: per-column weights ``[cols]`` of the squared errors, or None."""
    rows, cols = w.shape
    hb = None
    if h is not None:
        hb = h.to(device=w.device, dtype=torch.float64).reshape(cols // MX_GROUP, MX_GROUP)
    e = torch.empty((rows, cols // MX_GROUP), dtype=torch.int32, device=w.device)
    err = err0 = 0.0
    for lo, hi in row_chunks(rows, cols, _CHUNK):
        x = w[lo:hi].detach().to(torch.float32).reshape(hi - lo, cols // MX_GROUP, MX_GROUP)
        e[lo:hi], be, b0 = mx_block_search(x, bits, hb)
        err, err0 = err + float(be.sum()), err0 + float(b0.sum())
    codes, scales = mx_quantize(w, bits, e)
    return codes, scales, err, err0
