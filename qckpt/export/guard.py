"""The source-weight guard: a checkpoint weight is the one that was calibrated, or the export stops.

A weight that was calibrated gives back its calibrated amax exactly, or within the rounding of
the parameter format the calibration ran on; a larger one (or a NaN / Inf) is another
checkpoint, whose values would be clipped to scales made for other weights. ``check_source_*``
give the verdicts on the device with nothing waiting for it; ``refuse_source_weight`` makes the
one-line ``ExportError`` of a refused one.
"""

from __future__ import annotations

import math

import torch

from qckpt.errors import ExportError
from qckpt.layouts.export_layout import row_chunks, stack_f32

# a weight that was calibrated gives back its calibrated amax exactly, or within the rounding of
# the parameter format the calibration ran on (MXFP8's E4M3 elements: 2^-4 relative); more than
# this is another checkpoint, and its values would be clipped to scales made for other weights
WEIGHT_AMAX_RTOL = 0.0625


def _per_row(w: torch.Tensor, weight_amax: torch.Tensor) -> bool:
    rows = w.shape[0]
    return rows > 1 and weight_amax.numel() == rows and weight_amax.shape[0] == rows


def check_source_weight(module: str, w: torch.Tensor, weight_amax: torch.Tensor) -> torch.Tensor:
    """The source-weight guard's verdict on ``w``, left on its device: a 0-d bool tensor, True
    when :func:`refuse_source_weight` refuses ``w`` (a non-finite value, or a row or the whole
    tensor over its calibrated amax). Nothing here waits for the device (no ``bool`` of a device
    tensor, no blocking copy): the export looks at the verdicts of a batch of tensors
    with the one synchronisation that brings their outputs back (the profiled H200 export spent
    ~5 ms per 3 MB expert weight, much of it in such waits), and asks :func:`refuse_source_weight` for the message of
    the first refused one. ``module`` names it for a caller's spy; the verdict needs no name.

    One pass in row chunks (no full-size temporary); per row when the amax is per channel.
    """
    del module
    rows, cols = w.shape
    per_row = _per_row(w, weight_amax)
    # the limit is made where the amax is (the host, for the export: a few scalar ops and no
    # copy); a per-tensor limit stays a 0-d host tensor, which a CUDA comparison takes as a
    # scalar, so only a per-row limit is copied (non-blocking)
    cal = weight_amax.detach().to(torch.float32)
    limit = (cal.reshape(-1) if per_row else cal.max()) * (1 + WEIGHT_AMAX_RTOL)
    # against a finite limit, "not <=" is true exactly for a row over it, NaN or Inf (rows are
    # >= 0): one comparison instead of three ops; reading the host limit waits for nothing
    finite = limit.device.type == "cpu" and bool(torch.isfinite(limit).all())
    if per_row:
        limit = limit.to(w.device, non_blocking=True)
    bad = None
    for r0, r1 in row_chunks(rows, cols):
        part = w[r0:r1].abs().amax(dim=1).to(torch.float32)
        lim = limit[r0:r1] if per_row else limit
        if finite:
            chunk = (part <= lim).all().logical_not_()
        else:  # refuse_source_weight's comparisons exactly (a NaN limit refuses no finite row)
            chunk = (part > lim).logical_or_(~torch.isfinite(part)).any()
        bad = chunk if bad is None else bad.logical_or_(chunk)
    if bad is None:  # no rows: refuse_source_weight compares its zero maximum with the limit
        bad = (limit < 0).any().to(w.device)
    return bad


def refuse_source_weight(module: str, w: torch.Tensor, weight_amax: torch.Tensor) -> None:
    """Refuse a non-finite weight, or one larger than its calibrated amax (see above), with a
    one-line ExportError naming the first bad row; waits for the device several times, so the
    export calls it only on a tensor whose verdict (:func:`check_source_weight`) was True."""
    rows, cols = w.shape
    per_row = _per_row(w, weight_amax)
    got = torch.empty(rows if per_row else 0, dtype=torch.float32, device=w.device)
    top = torch.zeros((), dtype=torch.float32, device=w.device)
    for r0, r1 in row_chunks(rows, cols):
        part = w[r0:r1].abs().amax(dim=1).to(torch.float32)
        if not torch.isfinite(part).all():
            bad = r0 + int((~torch.isfinite(part)).nonzero()[0])
            raise ExportError(
                f"{module}.weight: not finite (NaN or Inf in row {bad}) in the checkpoint; "
                "refusing to quantize it"
            )
        if per_row:
            got[r0:r1] = part
        else:
            top = torch.maximum(top, part.max())
    cal = weight_amax.detach().to(device=w.device, dtype=torch.float32)
    if per_row:
        over = got > cal.reshape(-1) * (1 + WEIGHT_AMAX_RTOL)
        if over.any():
            r = int(over.nonzero()[0])
            _refuse_amax(module, float(got[r]), float(cal.reshape(-1)[r]), f" (row {r})")
        return
    if top > cal.max() * (1 + WEIGHT_AMAX_RTOL):
        _refuse_amax(module, float(top), float(cal.max()), "")


def _refuse_amax(module: str, got: float, cal: float, where: str) -> None:
    raise ExportError(
        f"{module}.weight: amax {got:.6g}{where} exceeds the calibrated weight amax {cal:.6g}; "
        "the checkpoint is not the one that was calibrated (calibrate it again)"
    )


def check_source_stack(
    w: torch.Tensor, weight_amax: list[torch.Tensor], chunk_elems: int
) -> torch.Tensor:
    """:func:`check_source_weight`'s verdicts on ``k`` weights ``w`` ``[k, rows, cols]`` at
    once: a ``[k]`` bool tensor on ``w``'s device, True where :func:`refuse_source_weight`
    refuses ``w[i]`` against ``weight_amax[i]``. One reduction per chunk of whole weights.

    The same verdicts: a tensor (or row) is refused when its largest magnitude is over the
    limit or not finite (a NaN or Inf anywhere makes the maximum NaN or Inf), and the limit is
    made as there, ``float32(amax) * (1 + WEIGHT_AMAX_RTOL)``. Weights whose amaxes differ in
    kind (some per row, some not) are checked one by one."""
    k, rows, cols = w.shape
    shapes = {a.shape for a in weight_amax}  # one shape, so one kind, in the usual case
    kinds = {rows > 1 and math.prod(sh) == rows and sh[:1] == (rows,) for sh in shapes}
    if len(kinds) != 1 or rows == 0 or cols == 0:
        return torch.stack([check_source_weight("", w[i], a) for i, a in enumerate(weight_amax)])
    per_row = kinds.pop()
    if per_row or all(math.prod(sh) == 1 for sh in shapes):
        cal = stack_f32(weight_amax)
    else:  # a per-tensor limit is the amax's max
        cal = torch.stack([a.detach().to(torch.float32).max() for a in weight_amax]).reshape(k, 1)
    limit = (cal * (1 + WEIGHT_AMAX_RTOL)).to(w.device, non_blocking=True)
    step = max(1, chunk_elems // (rows * cols))
    parts = []
    for i0 in range(0, k, step):
        i1 = min(k, i0 + step)
        a = w[i0:i1].abs()
        part = (a.amax(dim=2) if per_row else a.amax(dim=(1, 2)).reshape(-1, 1)).to(torch.float32)
        del a
        # "over the limit or not finite" is refuse_source_weight's test (a NaN limit refuses
        # no finite row); whatever the limit, the same verdict as check_source_weight's
        bad = (part > limit[i0:i1]).logical_or_(~torch.isfinite(part)).any(dim=1)
        parts.append(bad)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
