"""NVFP4 with block scales other than the max rule's: searched per block, or given.

The calibration algorithms choose NVFP4 block scales (``mse`` searches each block's E4M3
scale, GPTQ fixes each 16-column group's scale as it reaches it) and the export writes the
codes they imply. Both sides call these functions, so the codes written are the codes the
calibration measured. The packing is :mod:`qckpt.formats.nvfp4`'s (low nibble first).

Every error is a sum in float64 of squares of float64 differences; a block's 16 squares are
added as a fixed tree of elementwise additions (8 + 8, 4 + 4, ...), so the block choice is the
same on any device. Given per-column weights ``h`` (``calibrate.mse_weighting: hessian``: the
layer's input ``H_jj``), each square is multiplied by its column's weight first (one float64
product), so the block choice minimises ``sum_j h_j (w_j - q_j)**2``; ``h`` of ones gives the
unweighted choice bit for bit (a product by 1.0 is exact).
"""

from __future__ import annotations

import torch

from qckpt.formats.numerics import f64_const, float_scale
from qckpt.formats.nvfp4 import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    e2m1_codes,
    e2m1_values,
    max_block_scales,
)
from qckpt.formats.rowblock import padded_blocks, row_chunks, rows2d

FP8 = torch.float8_e4m3fn
# E4M3 steps from the max rule's block scale: 0 first (ties keep it), then smaller, then larger
BLOCK_STEPS = (0, -1, -2, -3, -4, -5, -6, 1)
_E4M3_MIN_CODE = 0x08  # 2**-6, the smallest normal: the max rule's floor
_E4M3_MAX_CODE = 0x7E  # 448
_CHUNK = 1 << 17  # elements per chunk of the search (x 8 candidates at once)


def pack_codes(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """``[rows, cols]`` E2M1 codes (uint8) packed two per byte, the even column low."""
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4))[:, : -(-cols // 2)]


def _e4m3_step(sb: torch.Tensor, step: int) -> torch.Tensor:
    """The E4M3 value ``step`` codes from positive ``sb`` (consecutive codes of positive
    normals are consecutive values), kept within the max rule's range [2**-6, 448]."""
    if step == 0:
        return sb
    code = sb.view(torch.uint8).to(torch.int16) + step
    code = code.clamp_(_E4M3_MIN_CODE, _E4M3_MAX_CODE).to(torch.uint8)
    return code.view(FP8)


def _block_error(
    blocks: torch.Tensor, sb: torch.Tensor, gs: torch.Tensor, inv_gs, hb=None
) -> tuple:
    """(codes, float64 squared error per block) of ``blocks`` [R, nb, 16] at block scales
    ``sb`` (E4M3 [R, nb]); the codes as the formats layer computes them. ``hb``: float64
    weights of the squares (broadcast to ``blocks``), or None."""
    sbf = sb.to(torch.float32)
    rec = inv_gs / sbf
    codes = e2m1_codes((blocks * rec.unsqueeze(-1)).clamp_(-E2M1_MAX, E2M1_MAX))
    dq = e2m1_values(codes) * (gs * sbf).unsqueeze(-1)
    d = blocks.to(torch.float64) - dq.to(torch.float64)
    sq = d * d
    if hb is not None:
        sq = sq * hb
    while sq.shape[-1] > 1:  # a fixed tree of elementwise additions: the same on every device
        half = sq.shape[-1] // 2
        sq = sq[..., :half] + sq[..., half:]
    return codes, sq[..., 0]


def nvfp4_scalars(amax: torch.Tensor, device: torch.device):
    """(gs, gs as float64, fl32(1 / gs)) for global amax ``amax``, as the formats layer."""
    gs = float_scale(amax.to(device=device, dtype=torch.float32).reshape(()), E2M1_MAX * E4M3_MAX)
    gs64 = gs.to(torch.float64)
    return gs, gs64, (1.0 / gs64).to(torch.float32)


def column_blocks(h: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """Per-column weights ``h`` (``[K]`` or ``[R, K]``) as float64 ``[.., nb, 16]`` blocks of
    ``k`` columns (padding weighs 0: a padded element is 0 and quantizes to 0 anyway)."""
    if h is None:
        return None
    h2 = h.to(torch.float64).reshape(-1, k)
    nb = -(-k // BLOCK)
    if nb * BLOCK != k:
        h2 = torch.nn.functional.pad(h2, (0, nb * BLOCK - k))
    return h2.reshape(-1, nb, BLOCK)


def nvfp4_chunk(c: torch.Tensor, gs, gs64, inv_gs, h: torch.Tensor | None = None):
    """The searched block scales, codes and error per block of a ``[R, K]`` chunk, and the
    max rule's error per block. Every candidate at once (a leading dim of
    :data:`BLOCK_STEPS`); ``argmin`` takes the first least error: the max rule on a tie.
    ``h``: per-column weights of the squared errors (``[K]``, or ``[R, K]`` a row's own), or
    None (unweighted)."""
    blocks = padded_blocks(c, BLOCK)
    bmax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)
    six64 = f64_const(E2M1_MAX, c.device)
    base = max_block_scales(bmax, six64, gs64).to(FP8)
    sbs = torch.stack([_e4m3_step(base, s).view(torch.uint8) for s in BLOCK_STEPS]).view(FP8)
    hb = column_blocks(h, c.shape[1])
    codes, err = _block_error(blocks.unsqueeze(0), sbs, gs, inv_gs, hb)
    pick = err.argmin(dim=0, keepdim=True)  # [1, R, nb]
    best_err = err.gather(0, pick)[0]
    best_sb = sbs.view(torch.uint8).gather(0, pick)[0].view(FP8)
    best_codes = codes.gather(0, pick.unsqueeze(-1).expand(1, *codes.shape[1:]))[0]
    return best_sb, best_codes, best_err, err[0]


def nvfp4_mse_quantize(w: torch.Tensor, clip: torch.Tensor, h: torch.Tensor | None = None):
    """NVFP4 of 2-D ``w`` with global amax ``clip`` and searched block scales: (packed codes
    uint8 ``[R, ceil(K/2)]``, E4M3 scales ``[R, ceil(K/16)]``, global scale float32 ``()``,
    the error (float) with searched and with max-rule block scales). The layout is the formats
    layer's nvfp4 (low nibble first). ``h``: per-column weights ``[K]`` of the squared
    errors (the input's ``H_jj``), or None."""
    x2 = rows2d(w.detach())
    r, k = x2.shape
    gs, gs64, inv_gs = nvfp4_scalars(clip, x2.device)
    packed = torch.empty((r, -(-k // 2)), dtype=torch.uint8, device=x2.device)
    scales = torch.empty((r, -(-k // BLOCK)), dtype=FP8, device=x2.device)
    err = err0 = 0.0
    hk = None if h is None else h.to(device=x2.device, dtype=torch.float64).reshape(k)
    for lo, hi in row_chunks(r, k, _CHUNK):
        sb, codes, e, e0 = nvfp4_chunk(x2[lo:hi], gs, gs64, inv_gs, hk)
        packed[lo:hi] = pack_codes(codes.reshape(hi - lo, -1), k)
        scales[lo:hi] = sb
        err, err0 = err + float(e.sum()), err0 + float(e0.sum())
    return packed, scales, gs, err, err0


def nvfp4_with_scales(w: torch.Tensor, amax: torch.Tensor, sb: torch.Tensor):
    """NVFP4 of 2-D ``w`` with global amax ``amax`` and the given E4M3 block scales ``sb``
    (``[rows, ceil(cols/16)]``): (packed codes, ``sb``, global scale), the codes as the
    formats layer computes them (``x * ((1 / gs) / sb)``, E2M1 round to nearest even)."""
    rows, cols = w.shape
    gs = float_scale(amax.to(device=w.device, dtype=torch.float32).reshape(()), E2M1_MAX * E4M3_MAX)
    inv_gs = (1.0 / gs.to(torch.float64)).to(torch.float32)
    sb = sb.to(w.device)
    blocks = padded_blocks(w.detach(), BLOCK)
    rec = inv_gs / sb.to(torch.float32)
    codes = e2m1_codes((blocks * rec.unsqueeze(-1)).clamp_(-E2M1_MAX, E2M1_MAX)).reshape(rows, -1)
    return pack_codes(codes, cols).contiguous(), sb, gs
