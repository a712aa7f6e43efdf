"""A quantized source's codes and scales straight into a destination of the same layout.

When a destination stores a source weight's layout bit for bit (same format, block size and
scale dtype, the local block cut on block boundaries), ``copy_plan`` says which pieces to copy
and ``copy_into`` copies them: no dequantize and quantize again. A scale that spans a whole dim
is decided on the whole tensor, so every rank holding a block of it decides alike.
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.formats import FORMATS
from qckpt.layouts.source_layout import QuantWeight
from qckpt.storage.slices import Fetch

_WHOLE = 0  # a dim that one scale spans entirely (per-tensor; the columns of per-channel)


def _dest_blocks(dest: Any, w: QuantWeight) -> tuple[int, int] | None:
    """The block (rows, cols) over which ``dest`` keeps one scale, when it stores ``w``'s
    layout bit for bit (same codes, same scale values); else None."""
    spec = FORMATS.get(getattr(dest, "fmt", None))
    stored = spec.stored_scheme(getattr(dest, "opts", {})) if spec is not None else None
    if stored is None or stored != w.scheme:
        return None
    if w.scheme.packed_fp4:
        # one global scale per tensor: only a destination fed by one source tensor; and it
        # must multiply, as qckpt's nvfp4 does (a dividing global scale rounds otherwise)
        return None if w.global_divides else (1, w.scheme.group)
    if w.granularity == "block":
        return w.block
    if w.granularity == "tensor":
        return (_WHOLE, _WHOLE)
    if w.granularity == "channel":
        return (1, _WHOLE) if dest.dim() == 2 else None
    return None


def _whole_tensor(dest: Any) -> bool:
    """Whether ``dest`` holds a scale made from the whole tensor (per tensor, or global)."""
    spec = FORMATS.get(getattr(dest, "fmt", None))
    return spec is not None and spec.whole_scale(getattr(dest, "opts", {})) == "tensor"


def _aligned(g0: int, g1: int, o: int, s: int, lo: int, d: int, b: int) -> bool:
    """Whether [g0, g1) cuts the source piece [o, o+s) and the destination [lo, lo+d) on the
    same block boundaries (b: block length; _WHOLE: the whole dim in both)."""
    if b == _WHOLE:
        return g0 == o == lo and g1 == o + s == lo + d
    if (g0 - o) % b or (g0 - lo) % b:
        return False
    return (g1 - g0) % b == 0 or (g1 == o + s and g1 == lo + d)


def _overlaps(pieces: list[Any], lo: tuple[int, ...], dims: tuple[int, ...]) -> list[Any]:
    """(piece, [(g0, g1) per dim]) of every piece that meets the local block [lo, lo+dims)."""
    out = []
    for p in pieces:
        cut = []
        for o, s, a, d in zip(p.offsets, p.sizes, lo, dims, strict=True):
            g0, g1 = max(o, a), min(o + s, a + d)
            if g0 >= g1:
                break
            cut.append((g0, g1))
        else:
            out.append((p, cut))
    return out


def copy_plan(
    dest: Any, pieces: list[Any], lo: tuple[int, ...], whole: tuple[int, ...] | None = None
) -> list[Any] | None:
    """The pieces to copy into ``dest`` (local block at global offsets ``lo`` of a tensor of
    shape ``whole``, default: ``dest`` is the whole tensor) when every element comes from a
    source weight stored exactly as ``dest`` stores it; else None.

    A scale that spans a whole dim (per tensor; the columns of per channel; nvfp4's global
    scale) is decided on the whole tensor, so a block is copied exactly when the whole
    tensor would be: then every rank holding a block of it decides alike."""
    if not pieces or any(getattr(p, "quant", None) is None for p in pieces):
        return None
    dims = tuple(int(s) for s in dest.shape)
    whole = dims if whole is None else tuple(int(s) for s in whole)
    if len(dims) != len(lo) or len(dims) < 2 or len(whole) != len(dims):
        return None
    hits = _overlaps(pieces, lo, dims)
    blocks = {_dest_blocks(dest, p.quant) for p, _ in hits}
    if len(blocks) != 1 or None in blocks:
        return None
    (b0, b1) = blocks.pop()
    whole_tensor = b0 == _WHOLE or _whole_tensor(dest)
    if whole_tensor and len(_overlaps(pieces, (0,) * len(whole), whole)) != 1:
        return None  # one scale for the whole tensor, several source tensors
    for p, cut in hits:
        (r0, r1), (c0, c1) = cut[-2], cut[-1]
        if b0 == _WHOLE:
            continue  # per-tensor: any rectangle of the codes keeps its one scale
        if not _aligned(r0, r1, p.offsets[-2], p.sizes[-2], lo[-2], dims[-2], b0):
            return None
        if b1 == _WHOLE:
            # one scale per row over all columns: the whole tensor's columns are this piece's
            if p.offsets[-1] != 0 or p.sizes[-1] != whole[-1]:
                return None
        elif not _aligned(c0, c1, p.offsets[-1], p.sizes[-1], lo[-1], dims[-1], b1):
            return None
    return hits


def copy_into(dest: Any, hits: list[Any], lo: tuple[int, ...], fetch: Fetch) -> None:
    """Copy the codes and scales of ``copy_plan``'s pieces into ``dest``, bit for bit."""
    with torch.no_grad():
        for p, cut in hits:
            w: QuantWeight = p.quant
            local = tuple(slice(g0 - a, g1 - a) for (g0, g1), a in zip(cut, lo, strict=True))
            (r0, r1), (c0, c1) = cut[-2], cut[-1]
            rows = (r0 - p.offsets[-2], r1 - p.offsets[-2])
            cols = (c0 - p.offsets[-1], c1 - p.offsets[-1])
            dev = dest.qdata.device
            if w.scheme.packed_fp4:
                lead, lr, lc = local[:-2], local[-2], local[-1]
                packed = fetch(w.codes, rows, (cols[0] // 2, -(-cols[1] // 2)))
                dest.qdata[(*lead, lr, slice(lc.start // 2, -(-lc.stop // 2)))].copy_(packed)
                g = w.scheme.group
                sb = fetch(w.scale, rows, (cols[0] // g, -(-cols[1] // g)))
                dest.scale[(*lead, lr, slice(lc.start // g, -(-lc.stop // g)))].copy_(sb)
                dest.global_scale.copy_(fetch(w.global_scale, None, None).reshape(()).to(dev))
                continue
            dest.qdata[local].copy_(fetch(w.codes, rows, cols))
            if w.granularity == "tensor":
                dest.scale.copy_(fetch(w.scale, None, None).to(torch.float32).reshape(()))
            elif w.granularity == "channel":
                s = fetch(w.scale, None, None).to(torch.float32).reshape(-1, 1)
                dest.scale[local[-2]].copy_(s[rows[0] : rows[1]])
            else:
                b0, b1 = w.block
                srows = (rows[0] // b0, -(-rows[1] // b0))
                scols = (cols[0] // b1, -(-cols[1] // b1))
                lr, lc = local[-2], local[-1]
                at = (
                    *local[:-2],
                    slice(lr.start // b0, -(-lr.stop // b0)),
                    slice(lc.start // b1, -(-lc.stop // b1)),
                )
                dest.scale[at].copy_(fetch(w.scale, srows, scols).to(torch.float32))
