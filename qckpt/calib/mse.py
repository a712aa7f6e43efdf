"""``calibrate.algorithm: mse``: scales searched to minimise the quantization error.

Weights (a function of the weight alone, so the same on any rank that holds it):

* FP8 ``tensor`` / ``channel`` / ``block``: each group's (the tensor's, a row's, a block's)
  clip amax is ``r * amax`` for the ratio ``r`` of :data:`WEIGHT_RATIOS` whose squared error
  ``sum((w - dq(q(w)))**2)`` over the group is least (ties: the larger ratio; ``r = 1`` is
  max calibration, so the search is never worse than max on this measure). The scale the
  export derives is ``clip / 448``, as from an amax.
* NVFP4: per 16-block, the E4M3 block scale among the max rule's scale and its neighbours
  (:data:`qckpt.formats.nvfp4_search.BLOCK_STEPS` E4M3 steps around it) with the least squared error of the block, for
  a global scale ``clip / (6 * 448)``; the clip is ``r * amax`` for the ratio of
  :data:`GLOBAL_RATIOS` whose blocks' total error is least. The export makes the block scales
  again from the weight and the stored clip with
  :func:`qckpt.formats.nvfp4_search.nvfp4_mse_quantize` (the same
  function), so nothing but the clip is carried.
* INT4 (``group``: a row's ``g`` columns; ``channel``) and INT8 (``channel``, ``tensor``): each
  group's clip amax is ``r * amax`` for the ratio of :data:`INT_RATIOS` (1.0 down to 0.5 in
  1/64 steps: 4-bit codes gain from clipping more than E4M3 ones) with the least squared error
  of the group, ties to the larger ratio (``r = 1``: max calibration). The error is measured
  under the scale the export writes, :func:`qckpt.formats.intq.int_scale` of the clip in the
  dtype it stores (compressed-tensors: the model dtype), with the export's rounding
  (:func:`qckpt.formats.intq.int_round`); so only the clip is carried, as for FP8.
* MXFP4 / MXFP8: each 32-block's E8M0 exponent among the max rule's ``e``, ``e + 1`` and
  ``e - 1`` (:mod:`qckpt.formats.mx_search`), a function of the weight alone that the export
  makes again with the same function: nothing is carried (no clip; the file keeps max |w|).

Every error is a sum in float64 of squares of float64 differences; a block's 16 squares are
added as a fixed tree of elementwise additions (8 + 8, 4 + 4, ...), so the NVFP4 block
choice is the same on any device; a weight's FP8 sums are ``torch.sum`` on one device. INT
and MX sums are fixed trees too (:func:`qckpt.formats.numerics.tree_sum`): an MX block's 32
squares; an INT group's squares in runs of :data:`SUM_RUN` (a shorter group: its length
padded to a power of two), then the runs' sums, so an INT choice is the same on any device.

Hessian weighting (``calibrate.mse_weighting: hessian``): every weight error above becomes
``sum_j h_j (w_ij - q_ij)**2`` with ``h_j`` the mean of ``x_j**2`` over the linear's calibration
inputs (:mod:`qckpt.calib.hdiag`): each square is multiplied by its column's ``h`` (one float64
product) before the same sums, so ``h`` of ones chooses what the plain search chooses, bit for
bit. The candidates, the tie rule and what is carried do not change, except that the NVFP4
block scales and MX exponents, re-searched by the export, now depend on ``h``: the file carries
``h`` as ``{module}.hessian_diag`` (float32, the values the search used). A weight whose
inputs saw no token (a cold expert) takes the plain search and carries no ``h``.

Static inputs (FP8 or INT8 ``tensor``): from a histogram of ``|x|`` over :data:`HIST_BINS` bins with
fixed edges ``[0, amax]`` (the synced amax): counts are integers, summed exactly over ranks in
any order, and the search over :data:`INPUT_RATIOS` runs on the host from the summed counts,
so every rank finds the same clip. A bin stands for its centre; INT8 inputs are rounded as
the clients do (``round(x / s)`` saturated, ``s`` the clip's scale as stored).
"""

from __future__ import annotations

import math

import torch

from qckpt.formats.intq import int_round, int_scale
from qckpt.formats.mx_search import mx_mse_quantize
from qckpt.formats.numerics import div_f32, f64_const, tree_sum
from qckpt.formats.nvfp4_search import nvfp4_mse_quantize
from qckpt.formats.scheme import FP8_MAX, Scheme

FP8 = torch.float8_e4m3fn
WEIGHT_RATIOS = tuple(1.0 - k / 32 for k in range(16))  # 1.0 .. 0.53
GLOBAL_RATIOS = tuple(1.0 - k / 16 for k in range(6))  # 1.0 .. 0.69
INPUT_RATIOS = tuple(1.0 - k / 64 for k in range(48))  # 1.0 .. 0.27
INT_RATIOS = tuple(1.0 - k / 64 for k in range(33))  # 1.0 .. 0.5
HIST_BINS = 2048
SUM_RUN = 1024  # an INT group's squared errors are added in runs of this many (a fixed tree)
_INT_CHUNK = 1 << 20  # elements per chunk of the INT search


def _ratio_amax(amax: torch.Tensor, r: float) -> torch.Tensor:
    """float32 ``r * amax`` rounded once (the product in float64)."""
    return (amax.to(torch.float64) * r).to(torch.float32)


def fp8_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 fake quantization of float32 ``x`` with float32 ``scale`` (broadcast), as the
    export quantizes (true division, saturation at 448)."""
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32) * scale


def column_weights(h: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    """Per-column weights ``h`` (``[cols]``) as float64 of ``w``'s 2-D shape, or None."""
    if h is None:
        return None
    rows, cols = w.reshape(w.shape[0], -1).shape
    return h.to(device=w.device, dtype=torch.float64).reshape(1, cols).expand(rows, cols)


def weight_groups(w: torch.Tensor, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``[groups, elems]``: the tensor (one group), its rows, or its blocks (padded
    with zeros, which quantize to zero at any scale)."""
    return _grouped(w.detach().to(torch.float32), granularity, block)


def _grouped(x: torch.Tensor, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """:func:`weight_groups`'s layout of ``x`` in its own dtype."""
    if granularity == "tensor":
        return x.reshape(1, -1)
    if granularity == "channel":
        return x.reshape(x.shape[0], -1)
    r, c = x.shape
    b0, b1 = block
    n0, n1 = -(-r // b0), -(-c // b1)
    x = torch.nn.functional.pad(x, (0, n1 * b1 - c, 0, n0 * b0 - r))
    return x.reshape(n0, b0, n1, b1).permute(0, 2, 1, 3).reshape(n0 * n1, b0 * b1)


def fp8_weight_clip(
    w: torch.Tensor,
    amax: torch.Tensor,
    granularity: str,
    block: tuple[int, int] = (128, 128),
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, float]:
    """The clip amax of ``w`` (the shape of ``amax``) and the error at max and at the clip
    (sums over the tensor). ``amax``: max calibration's, at the same granularity; ``h``:
    per-column weights of the squares (``[cols]``), or None."""
    g = weight_groups(w, granularity, block)
    hw = column_weights(h, w)
    hg = None if hw is None else _grouped(hw, granularity, block)
    a = amax.detach().to(device=g.device, dtype=torch.float32).reshape(-1)
    best_err = best = None
    err_max = 0.0
    for r in WEIGHT_RATIOS:
        clip = _ratio_amax(a, r)
        scale = div_f32(clip.clamp_min(1e-12), f64_const(FP8_MAX, g.device)).reshape(-1, 1)
        d = g - fp8_dequantize(g, scale)
        sq = d.to(torch.float64) ** 2
        err = (sq if hg is None else sq * hg).sum(dim=1)
        if best is None:
            best, best_err, err_max = clip, err, float(err.sum())
            continue
        better = err < best_err
        best = torch.where(better, clip, best)
        best_err = torch.where(better, err, best_err)
    return best.reshape(amax.shape).cpu(), err_max, float(best_err.sum())


def nvfp4_weight_clip(
    w: torch.Tensor, amax: torch.Tensor, h: torch.Tensor | None = None
) -> tuple[torch.Tensor, float, float]:
    """The global clip amax of ``w`` (ratios :data:`GLOBAL_RATIOS`, each with searched block
    scales) and the error at max calibration (max-rule block scales) and at the choice;
    ``h``: per-column weights of the squares, or None."""
    a = amax.detach().to(torch.float32).reshape(())
    best, best_err, err_max = a, math.inf, None
    for r in GLOBAL_RATIOS:
        clip = _ratio_amax(a, r)
        *_, err, err0 = nvfp4_mse_quantize(w, clip, h)
        if err_max is None:
            err_max = err0
        if err < best_err:
            best, best_err = clip, err
    return best.cpu(), float(err_max), float(best_err)


def _runs(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[groups, n]`` as ``[groups * runs, run]`` (zero padded: a zero quantizes to zero) and
    the runs per group: one power-of-two run for a group up to :data:`SUM_RUN`, else runs of it."""
    groups, n = g.shape
    run = SUM_RUN if n > SUM_RUN else 1 << max(0, (n - 1).bit_length())
    runs = -(-n // run)
    if runs * run != n:
        g = torch.nn.functional.pad(g, (0, runs * run - n))
    return g.reshape(groups * runs, run), runs


def int_weight_clip(
    w: torch.Tensor,
    amax: torch.Tensor,
    scheme: Scheme,
    scale_dtype: torch.dtype,
    h: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float, float]:
    """The clip amax of integer weight ``w`` (the shape of ``amax``, max calibration's at the
    scheme's calibrated granularity) and the error at max and at the clip (sums over the
    tensor), each group's error under ``int_scale(clip)`` in ``scale_dtype``; ``h``:
    per-column weights of the squares, or None."""
    g = weight_groups(w, scheme.calib_granularity, scheme.block)
    a = amax.detach().to(device=g.device, dtype=torch.float32).reshape(-1)
    x, runs = _runs(g)
    hw = column_weights(h, w)
    hx = None if hw is None else _runs(_grouped(hw, scheme.calib_granularity, scheme.block))[0]
    clips = [_ratio_amax(a, r) for r in INT_RATIOS]
    run_err = torch.empty((len(clips), x.shape[0]), dtype=torch.float64, device=g.device)
    step = max(1, _INT_CHUNK // x.shape[1])
    for i, clip in enumerate(clips):
        s = int_scale(clip, scheme.qmax, scale_dtype).to(torch.float32)
        s = s.repeat_interleave(runs).reshape(-1, 1)
        for lo in range(0, x.shape[0], step):
            c = x[lo : lo + step]
            d = c.to(torch.float64) - int_round(c, s[lo : lo + step], scheme.code_range).double()
            sq = d * d
            run_err[i, lo : lo + step] = tree_sum(sq if hx is None else sq * hx[lo : lo + step])
    err = tree_sum(run_err.reshape(len(clips), -1, runs))  # [ratios, groups]
    best, best_err = clips[0], err[0]
    for clip, e in zip(clips[1:], err[1:], strict=True):
        better = e < best_err  # ties: the larger ratio, tried first
        best = torch.where(better, clip, best)
        best_err = torch.where(better, e, best_err)
    return best.reshape(amax.shape).cpu(), float(err[0].sum()), float(best_err.sum())


def mx_weight_error(
    w: torch.Tensor, bits: int, h: torch.Tensor | None = None
) -> tuple[float, float]:
    """The error of MX weight ``w`` at the max rule's exponents and at the searched ones
    (``h``: per-column weights of the squares, or None)."""
    *_, err, err0 = mx_mse_quantize(w.detach(), bits, h)
    return err0, err


# -- inputs: histograms with fixed edges ---------------------------------------------------------


def histogram(x: torch.Tensor, amax: float, bins: int = HIST_BINS) -> torch.Tensor:
    """int64 counts of ``|x|`` in ``bins`` equal bins over ``[0, amax]`` (values at or past
    ``amax`` in the last bin), on ``x``'s device."""
    a = x.detach().reshape(-1).abs().to(torch.float32)
    idx = (a * (bins / amax)).floor_().clamp_(0, bins - 1).to(torch.int64)
    return torch.bincount(idx, minlength=bins)


def input_clip(
    counts: torch.Tensor,
    amax: float,
    scheme: Scheme | None = None,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[float, float, float]:
    """The clip amax of a static per-tensor input from its summed histogram (host, float64:
    the same on every rank), with the estimated error at max and at the clip: FP8, or the
    integer ``scheme``'s codes under its scale in ``scale_dtype`` (INT8)."""
    n = counts.to(torch.float64).cpu()
    bins = n.numel()
    v = (torch.arange(bins, dtype=torch.float64) + 0.5) * (amax / bins)
    v32 = v.to(torch.float32)
    best, best_err, err_max = amax, math.inf, None
    for r in INPUT_RATIOS:
        clip = _ratio_amax(torch.tensor(amax), r)
        if scheme is not None and scheme.integer:
            scale = int_scale(clip, scheme.qmax, scale_dtype).to(torch.float32)
            d = v - int_round(v32, scale, scheme.code_range).to(torch.float64)
        else:
            scale = div_f32(clip.clamp_min(1e-12), f64_const(FP8_MAX, torch.device("cpu")))
            d = v - fp8_dequantize(v32, scale).to(torch.float64)
        err = float((n * d * d).sum())
        if err_max is None:
            err_max = err
        if err < best_err:
            best, best_err = float(clip), err
    return best, float(err_max), float(best_err)
