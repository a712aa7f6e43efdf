"""AWQ's math (Lin et al., 2023) for the formats qckpt exports: per-input-channel scales from
the activations, searched on a layer group's own output error, folded into the preceding op.

A group is the linears that read one input ``x`` (q/k/v after a norm, o_proj after v_proj,
down_proj after up_proj; a MoE block's every expert behind its norm). For a grid of
exponents ``alpha`` the scales are ``s = a**alpha`` (``a``: the mean ``|x|`` of each input
channel over every calibration row that reaches the group), normalised to a geometric mean of
the extremes of 1 (:func:`scales`); each consumer's weight ``W`` becomes ``W diag(s)`` and its
input ``x / s``, so its BF16 output is unchanged, but the quantizer sees ``W diag(s)``: the
channels of large activations get finer steps. ``alpha = 0`` gives ``s = 1``, max calibration.

Everything here is deterministic and exact where ranks must agree:

* activation statistics: ``|x|`` on a fixed-point grid (:func:`abs_sums`, integers of at most
  ``bits`` bits from a synced amax), summed as int64: exact in any order and any split;
* the search's losses: each row's squared output error (float64, a function of the row and the
  weights alone) rounded to a multiple of a unit (:func:`loss_unit`, from a bound on any row's
  error) and summed as int64 (:func:`fixed_sum`): the same integer for any split of the rows;
* the scales themselves: float64 on the host from those integers.

``pow2`` scales (the default) are powers of two: the fold (``norm.weight / s``,
``W * s``) is then exact in BF16 and the folded BF16 model computes the very values of the
original one (products and sums of the same mantissas), routers included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qckpt.calib import gptq

GRID = 20
FLOOR = 1e-5  # a channel's mean |x| is at least this fraction of the largest (dead channels)


@dataclass(frozen=True)
class Spec:
    """How a tensor is quantized: format, granularity (weights: tensor / channel / block;
    NVFP4: its global amax, blocks of 16 by the max rule) and the weight block."""

    fmt: str
    granularity: str = "tensor"
    block: tuple[int, int] = (128, 128)


def alphas(grid: int = GRID) -> list[float]:
    """The exponents searched: ``0, 1/grid, ..., (grid - 1)/grid`` (0 first: ties keep it)."""
    return [i / grid for i in range(grid)]


def scales(mean_abs: torch.Tensor, alpha: float, pow2: bool = True) -> torch.Tensor:
    """float64 scales ``a**alpha`` normalised by ``sqrt(max * min)`` (``a``: ``mean_abs``,
    floored at :data:`FLOOR` of its largest); ``pow2``: each rounded to the nearest power of
    two (in log2). ``alpha == 0`` or no activation: all ones."""
    a = mean_abs.detach().to(device="cpu", dtype=torch.float64)
    top = float(a.max()) if a.numel() else 0.0
    if alpha == 0.0 or not top > 0.0:
        return torch.ones_like(a)
    s = a.clamp_min(top * FLOOR).pow(alpha)
    s = s / torch.sqrt(s.max() * s.min())
    if pow2:
        s = torch.exp2(torch.round(torch.log2(s)))
    return s


def pooled(a: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """o_proj's per-input-channel statistic ``[heads * head_dim]`` pooled over the query heads
    that read one KV head (GQA: HF's ``repeat_kv`` maps head ``h`` to KV head ``h // rep``):
    ``[kv_heads * head_dim]``, what one row of v_proj can carry."""
    rep = heads // kv_heads
    return a.reshape(kv_heads, rep, head_dim).mean(dim=1).reshape(-1)


def expand_heads(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse layout of :func:`pooled`: each KV head's values for its query heads."""
    rep = heads // kv_heads
    return t.reshape(kv_heads, 1, head_dim).expand(kv_heads, rep, head_dim).reshape(-1)


# -- quantization as the export does it --------------------------------------------------------


def weight_amax(w: torch.Tensor, spec: Spec) -> torch.Tensor:
    """The max-calibration amax of a 2-D weight for ``spec`` (float32)."""
    a = w.detach().abs().to(torch.float32)
    if spec.fmt == "nvfp4" or spec.granularity == "tensor":
        return a.amax()
    if spec.granularity == "channel":
        return a.amax(dim=1)
    b0, b1 = spec.block
    rows, cols = a.shape
    pad = (0, (-cols) % b1, 0, (-rows) % b0)
    a = torch.nn.functional.pad(a, pad)
    return a.reshape(a.shape[0] // b0, b0, a.shape[1] // b1, b1).amax(dim=(1, 3))


def fake_quant(w: torch.Tensor, spec: Spec, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` (2-D) quantized and dequantized (float32) with ``amax`` (max calibration's when
    None), by the export's rule (:mod:`qckpt.calib.gptq`'s quantizer): FP8 per tensor / row /
    block, NVFP4 with per-16 E4M3 block scales along the last dim."""
    w = w.detach().to(torch.float32)
    amax = weight_amax(w, spec) if amax is None else amax
    gran = "tensor" if spec.fmt == "nvfp4" else spec.granularity
    cq = gptq.ColumnQuantizer(spec.fmt, gran, amax, tuple(w.shape), spec.block)
    return gptq.round_to_nearest(w.clone(), cq)


def input_spec(fmt: str, granularity: str) -> Spec | None:
    """The input quantization the search includes: NVFP4 (dynamic 16-blocks under a calibrated
    global scale) or static per-tensor FP8; None for the rest (dynamic FP8: per batch)."""
    if fmt == "nvfp4":
        return Spec("nvfp4")
    if fmt == "fp8" and granularity == "tensor":
        return Spec("fp8")
    return None


def folded(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``W diag(s)`` as the folded checkpoint holds it: in ``w``'s dtype (float32 values)."""
    return (w.detach().to(torch.float32) * s.to(w.device, torch.float32)).to(w.dtype).float()


def candidate(w: torch.Tensor, s: torch.Tensor, spec: Spec) -> torch.Tensor:
    """The consumer's effective weight for scales ``s``: ``Q(W diag(s))``, float32 (its input
    is ``x / s``)."""
    return fake_quant(folded(w, s), spec)


def candidate_output(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    ispec: Spec | None,
    xs_amax: float,
) -> torch.Tensor:
    """The group consumer's output on rows ``x`` with effective weight ``q`` (from
    :func:`candidate`) and its input ``x / s``, quantized by ``ispec`` (global amax
    ``xs_amax``: the synced amax of ``x / s``) when given."""
    xs = x.to(torch.float32) / s.to(x.device, torch.float32)
    if ispec is not None and xs_amax > 0:
        amax = torch.tensor(xs_amax, dtype=torch.float32)
        xs = fake_quant(xs, ispec, amax)
    return xs @ q.t()


def row_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each row's squared error, float64 (a function of the row alone)."""
    d = (y - ref).to(torch.float64)
    return (d * d).sum(dim=1)


def best(losses: list[float]) -> int:
    """The candidate of least loss; ties: the smallest alpha (0 first: max calibration)."""
    return min(range(len(losses)), key=lambda k: (losses[k], k))


def search_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    spec: Spec,
    *,
    grid: int = GRID,
    pow2: bool = True,
    ispec: Spec | None = None,
) -> tuple[int, list[float], torch.Tensor]:
    """One linear's search on one process (the math of the pass without its exchanges):
    (the chosen candidate's index, the loss of every candidate, its scales)."""
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    a = rows.abs().to(torch.float64).mean(dim=0)
    top = rows.abs().amax(dim=0).to(torch.float64)
    ref = rows @ w.to(torch.float32).t()
    losses, all_s = [], []
    for alpha in alphas(grid):
        s = scales(a, alpha, pow2)
        y = candidate_output(rows, candidate(w, s, spec), s, ispec, float((top / s).max()))
        losses.append(float(row_errors(y, ref).sum()))
        all_s.append(s)
    k = best(losses)
    return k, losses, all_s[k]


# -- exact sums --------------------------------------------------------------------------------


def stat_bits(rows: int) -> int:
    """Bits per fixed-point value so that ``rows`` of them sum below 2**62."""
    return max(1, 62 - math.ceil(math.log2(max(rows, 1) + 1)))


def abs_sums(x: torch.Tensor, amax: float, bits: int) -> torch.Tensor:
    """int64 per-channel sums of ``round(|x| / amax * 2**bits)`` over the rows of ``x``
    (``[rows, channels]``): exact in any split, on any device."""
    if amax <= 0 or x.shape[0] == 0:
        return torch.zeros(x.shape[-1], dtype=torch.int64, device=x.device)
    g = float(2**bits) / amax
    v = torch.round(x.detach().reshape(-1, x.shape[-1]).abs().to(torch.float64) * g)
    return v.clamp_(0, float(2**bits)).to(torch.int64).sum(dim=0)


def mean_abs(sums: torch.Tensor, count: int, amax: float, bits: int) -> torch.Tensor:
    """The per-channel mean ``|x|`` (float64, host) from :func:`abs_sums`' totals."""
    if count <= 0 or amax <= 0:
        return torch.zeros(sums.numel(), dtype=torch.float64)
    return sums.to("cpu", torch.float64) * (amax / float(2**bits)) / count


def loss_unit(w_sq: float, q_sq: float, dim: int, x_amax: float, xs_amax: float, bits: int):
    """The unit of a consumer's fixed-point row errors: ``bound / 2**bits``, ``bound`` at least
    any row's squared error (``||(y_q - y)_row|| <= ||Q||_F ||x_q|| + ||W||_F ||x||``, each
    ``|x|`` under its amax, a quantized input under twice its own)."""
    bound = (math.sqrt(w_sq * dim) * x_amax + math.sqrt(q_sq * dim) * 2.0 * xs_amax) ** 2
    return bound / float(2**bits) if bound > 0 else 1.0


def fixed_sum(err: torch.Tensor, unit: float, bits: int) -> int:
    """The rows' errors in units of ``unit`` (each rounded, at most ``2**bits``), summed exactly."""
    if err.numel() == 0:
        return 0
    v = torch.round(err.to(torch.float64) / unit).clamp_(0, float(2**bits))
    return int(v.to(torch.int64).sum())


# -- folding -----------------------------------------------------------------------------------


def scale_columns_(w: torch.Tensor, s: torch.Tensor) -> None:
    """``w[..., j] *= s[j]`` in place (the consumer side of a fold), rounded to ``w``'s dtype."""
    w.copy_((w.to(torch.float32) * s.to(w.device, torch.float32)).to(w.dtype))


def divide_rows_(w: torch.Tensor, s: torch.Tensor) -> None:
    """``w[i, ...] /= s[i]`` in place (the producer side: a norm's weight, v/up rows, a bias)."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.copy_((w.to(torch.float32) / s.to(w.device, torch.float32).reshape(shape)).to(w.dtype))
