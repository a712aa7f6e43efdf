"""A quantized source's weight as values: codes times scales, any rectangle, row chunk by chunk.

==============  =================================================================================
scheme          value
==============  =================================================================================
fp8             ``code * scale`` (per tensor, per row, or per block ``scale[i // b0, j // b1]``,
                edge blocks partial)
nvfp4           ``e2m1 * (scale / global_scale)`` (compressed-tensors) or
                ``e2m1 * (weight_scale_2 * scale)`` (ModelOpt)
mxfp4, mxfp8    ``code * 2**(scale - 127)`` (E2M1 / E4M3 codes, E8M0 scales per 32, no
                global scale); gpt-oss's experts per expert, transposed (``experts``)
int4, int8      ``code * scale`` (codes from int32 words, or int8 ones; a scale per tensor,
                per row or per group of columns); asymmetric int4 groups ``(code - zp) *
                scale``, the zero points packed into int32 words along the rows
==============  =================================================================================

The weight's ``QuantWeight.scheme`` says which (its ``packed_fp4``, its ``group``).
Each product is computed in float32 (the codes and scales are exact there) and rounded once to
the destination's dtype, which is what compressed-tensors' decompressor and DeepSeek's
``weight_dequant`` do (checked bit for bit in the tests). Dequantizing works on any rectangle of
a weight (a TP slice, one expert of a fused tensor) and row chunk by row chunk into the
destination (on its device), so the transient memory is one chunk, not one tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.errors import CheckpointError
from qckpt.layouts.source_layout import QuantWeight
from qckpt.storage.slices import Fetch

# rows of a region are dequantized in chunks of about this many elements: the float32
# temporaries of one chunk are the transient cost, whatever the tensor's size
CHUNK_ELEMS = 1 << 22


def _e2m1(packed: torch.Tensor, c0: int, c1: int, col_base: int) -> torch.Tensor:
    """float32 values of logical columns [c0, c1) from packed bytes starting at column col_base."""
    from qckpt.formats.nvfp4 import e2m1_values, unpack_e2m1

    codes = unpack_e2m1(packed)
    return e2m1_values(codes[:, c0 - col_base : c1 - col_base])


def _expand(s: torch.Tensor, b0: int, b1: int, r: tuple[int, int], c: tuple[int, int]) -> Any:
    """Block scales of rows [r0, r1) x cols [c0, c1), expanded to one per element."""
    (r0, r1), (c0, c1) = r, c
    s = s.to(torch.float32)
    s = s.repeat_interleave(b0, 0)[r0 % b0 : r0 % b0 + (r1 - r0)]
    return s.repeat_interleave(b1, 1)[:, c0 % b1 : c0 % b1 + (c1 - c0)]


def _chunk_value(
    w: QuantWeight, fetch: Fetch, r: tuple[int, int], c: tuple[int, int], dev: torch.device
) -> torch.Tensor:
    """float32 value of rows r x cols c of ``w``, computed on ``dev``."""
    (r0, r1), (c0, c1) = r, c
    if w.packed_bits:
        return _int_value(w, fetch, r, c, dev)
    if w.scheme.mx:
        return _mx_value(w, fetch, r, c, dev)
    if not w.scheme.packed_fp4:
        v = fetch(w.codes, r, c).to(dev).to(torch.float32)
        if w.granularity == "tensor":
            return v.mul_(fetch(w.scale, None, None).to(dev, torch.float32).reshape(()))
        if w.granularity == "channel":
            s = fetch(w.scale, None, None).to(dev, torch.float32).reshape(-1, 1)[r0:r1]
            return v.mul_(s)
        b0, b1 = w.block
        s = fetch(w.scale, (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))).to(dev)
        return v.mul_(_expand(s, b0, b1, r, c))
    g = w.scheme.group
    packed = fetch(w.codes, r, (c0 // 2, -(-c1 // 2))).to(dev)
    v = _e2m1(packed, c0, c1, (c0 // 2) * 2)
    sb = fetch(w.scale, r, (c0 // g, -(-c1 // g))).to(dev, torch.float32)
    gs = fetch(w.global_scale, None, None).to(dev, torch.float32).reshape(())
    # the two libraries round differently: compressed-tensors divides by its global scale,
    # ModelOpt (and qckpt's nvfp4 format) multiply by weight_scale_2
    s = sb / gs if w.global_divides else gs * sb
    return v.mul_(_expand(s, 1, g, r, c))


def _mx_value(
    w: QuantWeight, fetch: Fetch, r: tuple[int, int], c: tuple[int, int], dev: torch.device
) -> torch.Tensor:
    """float32 ``code * 2**(scale - 127)`` of MX codes (E2M1 two a byte, or E4M3) under E8M0
    scales per 32 columns."""
    from qckpt.formats.mx_codes import mx_scale_values

    (c0, c1), g = c, w.scheme.group
    if w.scheme.code_bits == 8:  # MXFP8: E4M3 codes, one a byte
        v = fetch(w.codes, r, c).to(dev).to(torch.float32)
    else:
        packed = fetch(w.codes, r, (c0 // 2, -(-c1 // 2))).to(dev)
        v = _e2m1(packed, c0, c1, (c0 // 2) * 2)
    s = mx_scale_values(fetch(w.scale, r, (c0 // g, -(-c1 // g))).to(dev))
    return v.mul_(_expand(s, 1, g, (0, r[1] - r[0]), c))


def _int_value(
    w: QuantWeight, fetch: Fetch, r: tuple[int, int], c: tuple[int, int], dev: torch.device
) -> torch.Tensor:
    """float32 ``code * scale`` of integer codes packed into int32 words (compressed-tensors
    ``pack-quantized``), per row or per ``block[1]``-column group."""
    from qckpt.formats.intq import unpack_int32

    (r0, r1), (c0, c1) = r, c
    per = 32 // w.packed_bits
    words = fetch(w.codes, r, (c0 // per, -(-c1 // per))).to(dev)
    base = (c0 // per) * per
    codes = unpack_int32(words, w.packed_bits, words.shape[1] * per)
    v = codes[:, c0 - base : c1 - base].to(torch.float32)
    if w.granularity == "channel":
        s = fetch(w.scale, None, None).to(dev, torch.float32).reshape(-1, 1)[r[0] : r[1]]
        return v.mul_(s)
    g = w.block[1]
    gc = (c0 // g, -(-c1 // g))
    s = fetch(w.scale, r, gc).to(dev)
    if w.zero_point:  # (code - zp) * scale, the zero points packed along the rows
        from qckpt.formats.intq import unpack_int32_rows

        zw = fetch(w.zero_point, (r0 // per, -(-r1 // per)), gc).to(dev)
        zp = unpack_int32_rows(zw, w.packed_bits, zw.shape[0] * per)
        zp = zp[r0 - (r0 // per) * per :][: r1 - r0]
        v.sub_(_expand(zp, 1, g, (0, r1 - r0), c))
    return v.mul_(_expand(s, 1, g, (0, r1 - r0), c))


def _experts_into(
    out: torch.Tensor,
    w: QuantWeight,
    fetch: Fetch,
    box: tuple[tuple[int, int], tuple[int, int], tuple[int, int]],
) -> torch.Tensor:
    """``out`` <- experts ``box[0]`` x logical rows ``box[1]`` x logical cols ``box[2]`` of a
    weight stored per expert transposed (``QuantWeight.experts``): for each expert, chunks of
    its stored rows (the logical cols) dequantized as a 2-D MX weight and written transposed."""
    (e0, e1), (c0, c1), (r0, r1) = box
    want = (e1 - e0, c1 - c0, r1 - r0)
    if tuple(out.shape) != want:
        raise CheckpointError(f"{w.name}: region {list(want)} read into {list(out.shape)}")
    step = max(1, CHUNK_ELEMS // max(w.shape[1], 1))
    for e in range(e0, e1):

        def expert_rows(key: str, r: Any, c: Any, e: int = e) -> torch.Tensor:
            # the stored tensor's first two axes are (expert, row): one expert's rows, every
            # group of them, as a 2-D [rows, bytes or groups] tensor
            t = fetch(key, (e, e + 1), r)
            return t.reshape(t.shape[1], -1)[:, c[0] : c[1]]

        for a in range(r0, r1, step):
            b = min(r1, a + step)
            v = _mx_value(w, expert_rows, (a, b), (c0, c1), out.device)
            out[e - e0, :, a - r0 : b - r0].copy_(v.T)
    return out


def dequantize_into(
    out: torch.Tensor,
    w: QuantWeight,
    fetch: Fetch,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    experts: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out`` (shape rows x cols, any float dtype, any device) <- the dequantized region; a
    3-D ``out`` (experts x rows x cols) for a fused experts weight (``w.experts``).

    Row chunk by row chunk: each chunk's codes are read, moved to ``out``'s device, multiplied
    by their scales in float32 and rounded once into ``out``."""
    if w.experts:
        box = (experts or (0, w.shape[0]), rows or (0, w.shape[1]), cols or (0, w.shape[2]))
        return _experts_into(out, w, fetch, box)
    rows = rows or (0, w.shape[0])
    cols = cols or (0, w.shape[1])
    nr, nc = rows[1] - rows[0], cols[1] - cols[0]
    if tuple(out.shape) != (nr, nc):
        raise CheckpointError(f"{w.name}: region {nr}x{nc} read into {tuple(out.shape)}")
    step = max(1, CHUNK_ELEMS // max(nc, 1))
    if w.granularity == "block":
        step = max(w.block[0], step // w.block[0] * w.block[0])
    for a in range(rows[0], rows[1], step):
        b = min(rows[1], a + step)
        out[a - rows[0] : b - rows[0]].copy_(_chunk_value(w, fetch, (a, b), cols, out.device))
    return out


def dequantize(w: QuantWeight, fetch: Fetch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight as a fresh CPU tensor of ``dtype``."""
    return dequantize_into(torch.empty(w.shape, dtype=dtype), w, fetch)
