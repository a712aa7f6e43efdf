"""MX codes as the exports write them: E2M1 (MXFP4) or E4M3 (MXFP8) values under one E8M0
(power of two) scale per 32 values of a row, no global scale (OCP MX v1.0's element and scale
types).

Scale rule: the block's amax rounded to a power of two (up where its mantissa is at least
1.75, i.e. the float32 bits plus ``1 << 21`` with the mantissa masked off), minus the element's largest power of two (2 for E2M1, 8 for E4M3):
``e = floor(log2(round_pow2(amax))) - emax``, clamped to [-127, 127] and
stored biased (``e + 127``, uint8). This is compressed-tensors' (llm-compressor's MXFP4
scheme) and torchao's ``ScaleCalculationMode.EVEN``; it saturates less than the spec's floor
rule (``amax / 2**e`` lies in [3.5, 7) instead of [4, 8): values above 6 clip to 6). Codes are
``e2m1(clamp(x / 2**e, -6, 6))``, ties to even, two a byte, the even column in the low
nibble. The divisor is ``2**e`` floored at 2**-126 as torchao's is (only an all-but-zero block,
amax below 2**-124, differs from its stored 2**-127). Checked bit for bit against torchao's
``to_mx`` and compressed-tensors' MXFP4 compressor in the tests.

MXFP8 takes the same rounding of the amax (compressed-tensors' rule for every MX element type;
torchao's EVEN mode differs there: it rounds with E4M3's mantissa), so ``amax / 2**e`` lies in
[224, 448) and nothing saturates; codes ``e4m3(x / 2**e)``, round to nearest even.
"""

from __future__ import annotations

import torch

from qckpt.formats.numerics import exp2_int
from qckpt.formats.nvfp4 import e2m1_codes, e2m1_round, e2m1_values, pack_e2m1, unpack_e2m1

MX_GROUP = 32
E2M1_EMAX = 2  # floor(log2(6))
E4M3_EMAX = 8  # floor(log2(448))
E8M0_BIAS = 127
# the element's largest power of two, by its bits (MXFP4: E2M1, MXFP8: E4M3)
MX_EMAX = {4: E2M1_EMAX, 8: E4M3_EMAX}


def mx_exponents(amax: torch.Tensor, emax: int = E2M1_EMAX) -> torch.Tensor:
    """int32 unbiased E8M0 exponents of blocks whose largest magnitudes are ``amax``."""
    bits = amax.detach().to(torch.float32).abs().contiguous().view(torch.int32)
    rounded = (bits + (1 << 21)) & 0x7F800000
    return (((rounded >> 23) - 127) - emax).clamp_(-E8M0_BIAS, E8M0_BIAS)


def mx_divisor(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2**e``, floored at 2**-126 (the quantize's divisor)."""
    return exp2_int(e)


def mx_scale_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 ``2**(code - 127)`` of stored E8M0 codes (uint8), exactly (2**-127 included)."""
    e = codes.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def mx_round(x: torch.Tensor, e: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``x`` (float32) rounded to the ``bits``-bit element (E2M1 or E4M3) under ``2**e``
    (broadcast) and back, as the export does."""
    d = mx_divisor(e)
    if bits == 8:
        y = (x / d).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
        return y * d
    return e2m1_round((x / d).clamp_(-6.0, 6.0)) * d


def mx_quantize(
    w: torch.Tensor, bits: int, e: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, biased E8M0 scales uint8 ``[rows, cols / 32]``) of a 2-D weight whose columns
    32 divide: for ``bits`` 4 E2M1 codes packed two a byte ``[rows, cols / 2]``, for 8 E4M3
    codes ``[rows, cols]``; ``e``: given unbiased exponents (GPTQ's), else by the rule of the
    module doc."""
    rows, cols = w.shape
    x = w.detach().to(torch.float32).reshape(rows, cols // MX_GROUP, MX_GROUP)
    if e is None:
        e = mx_exponents(x.abs().amax(dim=-1), MX_EMAX[bits])
    y = x / mx_divisor(e).unsqueeze(-1)
    if bits == 8:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(rows, cols)
    else:
        codes = pack_e2m1(e2m1_codes(y.clamp_(-6.0, 6.0)).reshape(rows, cols))
    return codes, (e + E8M0_BIAS).to(torch.uint8)


def mxfp8_input(x: torch.Tensor) -> torch.Tensor:
    """An input quantized to MXFP8 per 32 along its last dim at run time (float32 values),
    by the weights' rule."""
    xf = x.to(torch.float32)
    b = xf.unflatten(-1, (xf.shape[-1] // MX_GROUP, MX_GROUP))
    e = mx_exponents(b.abs().amax(dim=-1), E4M3_EMAX).unsqueeze(-1)
    return mx_round(b, e, 8).flatten(-2)


def mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of packed codes under their stored E8M0 scales (one per 32 columns)."""
    codes = unpack_e2m1(packed)
    s = mx_scale_values(scale).repeat_interleave(MX_GROUP, dim=-1)[:, : codes.shape[1]]
    return e2m1_values(codes) * s
