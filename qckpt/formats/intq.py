"""Integer codes: quantize with given scales, and compressed-tensors' int32 packing.

``pack-quantized`` stores B-bit codes as unsigned values (code + 2**(B-1)) packed densely along
the input dim into int32 words, the first column in the lowest bits (for B = 4: 8 codes a word,
column 8k + i at bits 4i..4i+3); a row whose column count is not a multiple of 32 / B ends in a
partial word. Zero points (asymmetric weights) are packed the same way along the output dim
instead (``[ceil(rows / 8), groups]`` for B = 4). Checked bit for bit against compressed-tensors' ``pack_to_int32`` /
``unpack_from_int32`` in the tests.
"""

from __future__ import annotations

import torch

from qckpt.formats.numerics import div_f32, f64_const


def int_scale(amax: torch.Tensor, qmax: float, dtype: torch.dtype) -> torch.Tensor:
    """The scales ``amax / qmax`` of rows or groups whose largest magnitudes are ``amax``,
    correctly rounded in float32, then to ``dtype`` (the one the export stores; codes are made
    under the scale as stored). The export's rule and GPTQ's, so the two cannot drift."""
    a = amax.detach().to(torch.float32).clamp_min(1e-12)
    return div_f32(a, f64_const(qmax, a.device)).to(dtype)


def int_asym_qparams(
    wmin: torch.Tensor, wmax: torch.Tensor, code_range: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales in ``dtype``, int8 zero points) of groups whose smallest and largest values are
    ``wmin`` / ``wmax``, as compressed-tensors' ``calculate_qparams`` makes them for asymmetric
    int codes ``lo..hi`` from float32 min / max: the range widened to hold 0, ``scale = (max -
    min) / (hi - lo)`` (float32, correctly rounded on every device), ``zp = round(clamp(lo - min
    / scale, lo, hi))`` (ties to even) from that float32 scale; then the scale rounded to the
    stored dtype (the codes are made under the stored one). An all-zero group (range 0) gets
    float32's eps as its scale, as there, and the zero point ``lo`` (there: 0 / 0)."""
    lo, hi = code_range
    mn = wmin.detach().to(torch.float32).clamp(max=0.0)
    mx = wmax.detach().to(torch.float32).clamp(min=0.0)
    s = div_f32(mx - mn, f64_const(float(hi - lo), mn.device))
    s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
    zp = torch.round((lo - mn / s).clamp_(lo, hi)).to(torch.int8)
    return s.to(dtype), zp


def int_round(
    x: torch.Tensor,
    scale: torch.Tensor,
    code_range: tuple[int, int],
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` rounded to its integer codes under ``scale`` (broadcast; float32) and back:
    ``clamp(round(x / scale), lo, hi) * scale``, ties to even, as :func:`int_codes`; with a
    ``zero_point`` (float32, broadcast): ``(clamp(round(x / scale + zp), lo, hi) - zp) *
    scale``."""
    lo, hi = code_range
    if zero_point is None:
        return torch.round(x / scale).clamp_(lo, hi) * scale
    return (torch.round(x / scale + zero_point).clamp_(lo, hi) - zero_point) * scale


def int_codes(
    w: torch.Tensor,
    scale: torch.Tensor,
    code_range: tuple[int, int],
    group: int,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 codes ``clamp(round(w / scale), lo, hi)`` of a 2-D weight, ``scale`` one per row
    or one for all (``group`` 0), or per ``group`` columns of a row; the division in float32,
    ties to even. ``zero_point`` (one per group): ``clamp(round(w / scale + zp), lo, hi)``, the
    sum in float32 before the rounding (compressed-tensors' order)."""
    rows, cols = w.shape
    lo, hi = code_range
    x = w.to(torch.float32)
    s = scale.to(device=w.device, dtype=torch.float32)
    if group:
        q = x.reshape(rows, cols // group, group) / s.reshape(rows, -1, 1)
        if zero_point is not None:
            q += zero_point.to(device=w.device, dtype=torch.float32).reshape(rows, -1, 1)
        q = q.reshape(rows, cols)
    else:
        q = x / (s.reshape(()) if s.numel() == 1 else s.reshape(rows, 1))
    return torch.round(q).clamp_(lo, hi).to(torch.int8)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[rows, ceil(cols * bits / 32)]`` of int8 ``codes`` (see the module doc);
    ``bits`` divides 32."""
    rows, cols = codes.shape
    per = 32 // bits
    words = -(-cols // per)
    u = (codes.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, words * per - cols)).reshape(rows, words, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    packed = (u << shifts).sum(dim=-1)
    # the word's 32 bits as int32: two's complement wraps the top bit
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def pack_int32_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[ceil(rows * bits / 32), cols]`` of int8 ``codes`` packed along the rows
    (compressed-tensors' ``packed_dim=0``: its zero points), the first row in the lowest bits."""
    return pack_int32(codes.t().contiguous(), bits).t().contiguous()


def unpack_int32_rows(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int8 codes ``[rows, cols]`` of words packed along the rows (:func:`pack_int32_rows`)."""
    return unpack_int32(packed.t(), bits, rows).t()


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int8 codes ``[rows, cols]`` of int32 words (the inverse of :func:`pack_int32`)."""
    per = 32 // bits
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
    u = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    u = u.reshape(packed.shape[0], -1)[:, :cols]
    return (u - (1 << (bits - 1))).to(torch.int8)
