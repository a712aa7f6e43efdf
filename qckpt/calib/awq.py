"""AWQ's math (Lin et al., 2023) for the formats qckpt exports: per-input-channel scales from
the activations, searched on a layer group's own output error, folded into the preceding op.

A group is the linears that read one input ``x`` (q/k/v after a norm, o_proj after v_proj,
down_proj after up_proj; a MoE block's every expert behind its norm). For a grid of
exponents ``alpha`` the scales are ``s = a**alpha`` (``a``: the mean ``|x|`` of each input
channel over every calibration row that reaches the group), normalised so that the largest
and the smallest multiply to 1 (:func:`scales`); each consumer's weight ``W`` becomes
``W diag(s)`` and its input ``x / s``, so its BF16 output is unchanged, but the quantizer sees
``W diag(s)``: the channels of large activations get finer steps. ``alpha = 0`` is ``s = 1``,
max calibration, and the search keeps it on ties, so it is never worse than max on its loss.

The loss of a candidate is the consumer's output error over the calibration rows that reach
it, ``sum ||(Q(W diag(s)) diag(1/s) - W) x||**2`` (weights quantized as the export does: FP8
per tensor / channel / block, NVFP4 by the max rule), taken as ``sum((dW H) * dW)`` with
``H = X^T X`` (:func:`hessian_loss`): one pass over the data per layer, not one per
candidate. ``H`` and the sums of ``|x|`` are on :mod:`qckpt.calib.gptq`'s fixed-point grid
(integers, exact in float64 for any split of the rows over batches and ranks), so every rank
that holds a consumer computes its losses from the same numbers. Where the recipe quantizes
the consumer's input statically per tensor in FP8 (:func:`input_spec`), the loss adds what quantizing
``x / s`` costs, ``sum_c ||Q[:, c]||**2 sum e_c**2`` (:func:`input_loss`: the channels' errors
taken as uncorrelated, their squares summed per channel on a fixed-point grid, exact): a
scale that helps the weights but widens the input's range pays for it.

Scales are floats by default (the folded weights rounded to BF16 once: the folded BF16 model's
output moves by about a BF16 rounding); ``pow2`` scales are powers of two: the fold
(``norm.weight / s``, ``W * s``) is then exact in BF16 and the folded BF16 model computes the
very values of the original one (products and sums of the same mantissas), routers included,
at the price of a coarser search.
"""

from __future__ import annotations

import torch

from qckpt.calib import gptq
from qckpt.formats.scheme import SCHEMES, Scheme

GRID = 20
FLOOR = 1e-5  # a channel's mean |x| is at least this fraction of the largest (dead channels)


def Spec(fmt: str, granularity: str = "tensor", block=(128, 128)) -> Scheme:  # noqa: N802
    """The :class:`Scheme` of a tensor quantized as ``fmt`` / ``granularity`` / ``block`` (a
    weight's: NVFP4 is its global amax, blocks of 16 by the max rule). AWQ's specs are schemes;
    this spelling stays for callers that name a format."""
    return SCHEMES[fmt](granularity=granularity, block=tuple(int(b) for b in block))


def alphas(grid: int = GRID) -> list[float]:
    """The exponents searched: ``0, 1/grid, ..., (grid - 1)/grid`` (0 first: ties keep it)."""
    return [i / grid for i in range(grid)]


def scales(mean_abs: torch.Tensor, alpha: float, pow2: bool = False) -> torch.Tensor:
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


def weight_amax(w: torch.Tensor, spec: Scheme) -> torch.Tensor:
    """The max-calibration amax of a 2-D weight for ``spec`` (float32)."""
    a = w.detach().abs().to(torch.float32)
    if spec.scalar_amax:
        return a.amax()
    if spec.granularity == "channel":
        return a.amax(dim=1)
    b0, b1 = spec.block
    rows, cols = a.shape
    pad = (0, (-cols) % b1, 0, (-rows) % b0)
    a = torch.nn.functional.pad(a, pad)
    return a.reshape(a.shape[0] // b0, b0, a.shape[1] // b1, b1).amax(dim=(1, 3))


def fake_quant(w: torch.Tensor, spec: Scheme, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` (2-D) quantized and dequantized (float32) with ``amax`` (max calibration's when
    None), by the export's rule (:mod:`qckpt.calib.gptq`'s quantizer): FP8 per tensor / row /
    block, NVFP4 with per-16 E4M3 block scales along the last dim."""
    w = w.detach().to(torch.float32)
    amax = weight_amax(w, spec) if amax is None else amax
    cq = gptq.ColumnQuantizer(spec, amax, tuple(w.shape))
    return gptq.round_to_nearest(w.clone(), cq)


def input_spec(scheme: Scheme) -> Scheme | None:
    """The input quantization the loss includes: static per-tensor FP8; None for the rest.
    NVFP4 inputs are left out on the evidence: on the shared Llama the term made NVFP4 W4A4
    worse (+1.780 % against +1.588 % without it, max +1.764 %), while for static FP8 inputs
    it took W8A8 from +0.199 % to +0.129 % (max +0.118 %); dynamic FP8 is scaled per token."""
    return scheme if scheme.static_tensor_scale else None


def input_error_sums(
    x: torch.Tensor, s: torch.Tensor, ispec: Scheme, xs_amax: float, bits: int
) -> torch.Tensor:
    """Per input channel, the squared quantization error of ``x / s`` (quantized by
    ``ispec`` under the amax ``xs_amax`` of ``x / s``) summed over the rows, in units of
    ``(2 * xs_amax)**2 / 2**bits``: int64, exact in any split."""
    xs = x.detach().reshape(-1, x.shape[-1]).to(torch.float32) / s.to(x.device, torch.float32)
    if xs_amax <= 0 or xs.shape[0] == 0:
        return torch.zeros(xs.shape[-1], dtype=torch.int64, device=x.device)
    q = fake_quant(xs, ispec, torch.tensor(xs_amax, dtype=torch.float32))
    e = (q - xs).to(torch.float64) / (2.0 * xs_amax)
    v = torch.round(e * e * float(2**bits)).clamp_(0, float(2**bits))
    return v.to(torch.int64).sum(dim=0)


def input_loss(q: torch.Tensor, sums: torch.Tensor, xs_amax: float, bits: int) -> float:
    """The output error the input's quantization adds, ``sum_c ||Q[:, c]||**2 * sum e_c**2``
    (channels' errors taken as uncorrelated), from :func:`input_error_sums`' totals."""
    unit = (2.0 * xs_amax) ** 2 / float(2**bits)
    cols = q.to(torch.float64).square().sum(dim=0)
    return unit * float((cols * sums.to(cols.device, torch.float64)).sum())


def folded(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``W diag(s)`` as the folded checkpoint holds it: in ``w``'s dtype (float32 values)."""
    return (w.detach().to(torch.float32) * s.to(w.device, torch.float32)).to(w.dtype).float()


def candidate(w: torch.Tensor, s: torch.Tensor, spec: Scheme) -> torch.Tensor:
    """The consumer's effective weight for scales ``s``: ``Q(W diag(s))``, float32 (its input
    is ``x / s``)."""
    return fake_quant(folded(w, s), spec)


def hessian_loss(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, h: torch.Tensor) -> float:
    """The output error ``sum over rows of ||(Q diag(1/s) - W) x||**2`` of a consumer whose
    inputs' ``X^T X`` is ``h`` (on the grid: in its squared units), for ``q`` = ``Q(W diag(s))``
    (its input is ``x / s``): ``sum((dW h) * dW)``, float64."""
    s64 = s.to(device=q.device, dtype=torch.float64)
    d = q.to(torch.float64) / s64 - w.detach().to(device=q.device, dtype=torch.float64)
    return float(((d @ h.to(device=d.device, dtype=torch.float64)) * d).sum())


def best(losses: list[float]) -> int:
    """The candidate of least loss; ties: the smallest alpha (0 first: max calibration)."""
    return min(range(len(losses)), key=lambda k: (losses[k], k))


def search_linear(
    x: torch.Tensor, w: torch.Tensor, spec: Scheme, *, grid: int = GRID, pow2: bool = False
) -> tuple[int, list[float], torch.Tensor]:
    """One linear's search on one process (the math of the pass without its exchanges):
    (the chosen candidate's index, the output error of every candidate, its scales)."""
    rows = x.detach().reshape(-1, x.shape[-1])
    amax = float(rows.abs().max())
    bits = gptq.grid_bits(rows.shape[0])
    xi = gptq.fixed_point(rows, amax, bits)
    a = mean_abs(xi.abs().sum(dim=0), rows.shape[0], amax, bits)
    h = xi.t() @ xi
    unit = (amax / 2.0**bits) ** 2
    losses, all_s = [], []
    for alpha in alphas(grid):
        s = scales(a, alpha, pow2)
        losses.append(unit * hessian_loss(w, candidate(w, s, spec), s, h))
        all_s.append(s)
    k = best(losses)
    return k, losses, all_s[k]


def mean_abs(sums: torch.Tensor, count: int, amax: float, bits: int) -> torch.Tensor:
    """The per-channel mean ``|x|`` (float64, host) from the sums of ``|x|`` on the grid of
    :func:`qckpt.calib.gptq.fixed_point` (integers: exact in any order)."""
    if count <= 0 or amax <= 0:
        return torch.zeros(sums.numel(), dtype=torch.float64)
    return sums.to("cpu", torch.float64) * (amax / float(2**bits)) / count


# -- folding -----------------------------------------------------------------------------------


def scale_columns_(w: torch.Tensor, s: torch.Tensor) -> None:
    """``w[..., j] *= s[j]`` in place (the consumer side of a fold), rounded to ``w``'s dtype."""
    w.copy_((w.to(torch.float32) * s.to(w.device, torch.float32)).to(w.dtype))


def divide_rows_(w: torch.Tensor, s: torch.Tensor) -> None:
    """``w[i, ...] /= s[i]`` in place (the producer side: a norm's weight, v/up rows, a bias)."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.copy_((w.to(torch.float32) / s.to(w.device, torch.float32).reshape(shape)).to(w.dtype))
