"""``mxfp8``: OCP Microscaling (MX) v1.0 FP8, blocks of 32 along the last dim.

Layout
------
``qdata``: float8_e4m3fn (default; ``dtype=torch.float8_e5m2`` also), the nominal shape.
``scale``: uint8, the E8M0 shared exponent *biased by 127* (code c means ``2**(c - 127)``;
code 255, NaN, is never written), shape ``(*shape[:-1], ceil(K / 32))``. Dequantize:
``x = qdata.float() * 2**(scale - 127)`` per block. (A 0-d tensor is one block of one element.)

Scale rule (the spec's, torchao's FLOOR mode): ``e = floor(log2(amax_block)) - emax`` with
emax = 8 (E4M3) / 15 (E5M2), clamped to ``[-127, 127]``; codes are
``clamp(x / 2**e, -fp8_max, fp8_max)`` cast round-to-nearest-even. ``amax / 2**e`` lies in
``[256, 512)`` (E4M3): the part above 448 saturates to 448 (< 12.5% error on those elements).

* Padding: when K is not a multiple of 32 the last block is partial; it is scaled by its own
  valid elements (as if zero-padded) and no padding is stored: ``qdata`` keeps K columns.
* An all-zero block gets code 0 (2**-127, a positive scale) and zero codes.
* Elements below the E4M3 normal range become FP8 subnormals; E8M0 has no subnormals.
* ``amax=`` is not an option: MX scales are per block and always computed (current scaling).

``scale_rounding="rceil"`` (the rule of NVIDIA's MXFP8 kernels, cuBLAS and Transformer Engine:
``cvt.rp.satfinite.ue8m0``): ``e = ceil(log2(amax_block / fp8_max))``, computed exactly from the
bits of the correctly rounded float32 quotient (the same bits on CPU and CUDA:
``numerics.div_f32``), clamped to ``[-127, 127]``. Nothing saturates, but it is *not*
idempotent: a block whose largest element rounds down to code 224 (``amax / 2**e`` in
(224, 232)) dequantizes to an amax of exactly ``224 * 2**e = 448 * 2**(e-1)``, which
re-quantizes with half the scale and doubled codes (tested). That is the mechanism behind Megatron-LM #6666's non-idempotent MXFP8 round trip;
the default FLOOR rule has no such case. RCEIL matches torchao's ``ScaleCalculationMode.RCEIL``
bit for bit except for blocks clamped to code 0 (torchao then multiplies by 1.0).

Deliberate difference from torchao's ``to_mx`` (FLOOR): for a block whose exponent clamps to
-127 (amax < 2**-119, e.g. all zeros) torchao divides by 2**-126 (it clamps the FP32 scale to the
smallest normal) while storing code 0 (2**-127), so its codes and its scale disagree by 2x; we
divide by the stored 2**-127 (by multiplying with the exact 2**127), so dequantize matches. All
other blocks agree bit for bit (tests/unit/test_formats_ref.py).

Round trip: ``quantize(dequantize(q)) == q`` bit for bit through float32, and through bfloat16
(each code times a power of two is exact in bfloat16; the block's max code lies in [256, 448]
so the recomputed exponent is the same) with one exception: a block with exponent below -124
(amax < 2**-116) can hold codes whose value is below bfloat16's smallest subnormal 2**-133;
bfloat16 flushes those (tested). Views keep the layout only if they keep the last dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qckpt.errors import FormatError
from qckpt.formats import kernels, numerics
from qckpt.formats._base import FieldSpec, Format, register
from qckpt.formats.kernels import run_block_kernel
from qckpt.formats.numerics import (
    FP8_EMAX,
    FP8_MAX,
    check_finite_amax,
    check_input,
    div_f32,
    exp2_int,
    fp8_dtype,
)
from qckpt.formats.rowblock import (
    last_dim,
    nblocks,
    padded_blocks,
    row_chunks,
    rows2d,
    view_keep_last,
)

BLOCK = 32

if TYPE_CHECKING:
    from qckpt.formats.tensor import QuantizedTensor


def _mx_compute(
    c: torch.Tensor, emax: int, rceil: bool, fmax64: torch.Tensor, qdtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (R, K) chunk -> (codes (R, K), biased exponents uint8 (R, nb), max block amax)."""
    r, k = c.shape
    fmax = FP8_MAX[qdtype]
    blocks = padded_blocks(c, BLOCK)
    # inf-norm = max|x| without an |x| temporary; NaN/Inf propagate (checked by the caller)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)
    if rceil:
        # 2**ceil(log2(amax / fp8_max)), exactly from the bits of the FP32 quotient: its
        # exponent, plus one if any mantissa bit is set; a subnormal/zero quotient -> -127
        # (fl32(amax / fp8_max), correctly rounded on CUDA and compiled too: numerics.div_f32;
        # a reciprocal multiply can round up to 2**-126 where the quotient is subnormal)
        bits = div_f32(amax, fmax64).view(torch.int32)
        ebits = (bits >> 23) & 0xFF
        e = ebits - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        e = torch.where(ebits == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    else:
        bits = amax.view(torch.int32)
        e = (((bits >> 23) & 0xFF) - 127 - emax).clamp(-127, 127)
    # multiply by the exact 2**-e (always a normal float32 here) rather than divide by 2**e,
    # which is subnormal at e = -127 and flushed to zero by some GPU code paths
    inv = exp2_int(-e)  # -e is in [-119, 127]: exact and normal
    q = (blocks * inv.unsqueeze(-1)).clamp_(-fmax, fmax).to(qdtype)
    m = amax.amax() if amax.numel() else amax.new_zeros(())
    return q.reshape(r, -1)[:, :k], (e + 127).to(torch.uint8), m


def _mx_into(
    c: torch.Tensor,
    out_q: torch.Tensor,
    out_s: torch.Tensor,
    emax: int,
    rceil: bool,
    fmax64: torch.Tensor,
) -> torch.Tensor:
    """_mx_compute written into out_q / out_s (K a multiple of 32: see run_block_kernel)."""
    q, s, m = _mx_compute(c, emax, rceil, fmax64, out_q.dtype)
    out_q.copy_(q)
    out_s.copy_(s)
    return m


@dataclass(frozen=True, kw_only=True)
class MxFp8Options:
    dtype: torch.dtype = torch.float8_e4m3fn
    block_size: int = BLOCK  # fixed by OCP MX v1.0
    scale_rounding: str = "floor"  # or "rceil"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", fp8_dtype(self.dtype))
        if self.scale_rounding not in ("floor", "rceil"):
            raise FormatError(
                f"mxfp8: scale_rounding must be 'floor' or 'rceil', got {self.scale_rounding!r}"
            )
        if self.block_size != BLOCK:
            raise FormatError(f"mxfp8: block_size is {BLOCK} (OCP MX v1.0), got {self.block_size}")


class MxFp8Format(Format):
    name = "mxfp8"
    tensor_fields = ("qdata", "scale")

    Options = MxFp8Options
    ignored_opts = ("granularity",)

    def scale_block(self, opts: dict[str, Any], dim: int, ndim: int) -> int:
        return BLOCK if dim == ndim - 1 else 1

    def _write(
        self, x: torch.Tensor, opts: dict[str, Any], qdata: torch.Tensor, scale: torch.Tensor
    ) -> None:
        x2 = rows2d(x)
        q2 = qdata.view(x2.shape)
        k = x2.shape[1]
        s2 = scale.view(x2.shape[0], nblocks(k, BLOCK))
        if k == 0:
            return
        if opts["scale_rounding"] == "floor" and kernels.use_triton(x2, "mxfp8", q2, s2):
            from qckpt.formats import triton_kernels

            m = triton_kernels.mx_quantize(x2, q2, s2, FP8_EMAX[opts["dtype"]])
            if m is not None:
                check_finite_amax(m, self.name)
                return
        bad = torch.zeros((), device=x.device)
        ce = kernels.quant_chunk(x.device, _mx_into)
        fmax64 = numerics.f64_const(FP8_MAX[opts["dtype"]], x.device)
        args = (FP8_EMAX[opts["dtype"]], opts["scale_rounding"] == "rceil", fmax64)
        for a, b in row_chunks(x2.shape[0], k, ce):
            m = run_block_kernel(
                _mx_into,
                _mx_compute,
                k % BLOCK != 0,
                x2[a:b],
                (q2[a:b], s2[a:b]),
                args,
                (opts["dtype"],),
            )
            bad = torch.maximum(bad, m)
        check_finite_amax(bad, self.name)

    def quantize(self, x: torch.Tensor, opts: dict[str, Any], amax: Any) -> dict[str, torch.Tensor]:
        check_input(x, self.name)
        if amax is not None:
            raise FormatError("mxfp8: amax= is not supported (scales are per 32-element block)")
        shape = tuple(x.shape)
        qdata = torch.empty(shape, dtype=opts["dtype"], device=x.device)
        sshape = shape[:-1] + (nblocks(last_dim(shape), BLOCK),) if shape else (1,)
        scale = torch.empty(sshape, dtype=torch.uint8, device=x.device)
        self._write(x, opts, qdata, scale)
        return {"qdata": qdata, "scale": scale}

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        sshape = shape[:-1] + (nblocks(last_dim(shape), BLOCK),) if shape else (1,)
        # E8M0 code 0 (2**-127): the scale of an all-zero block
        return {"qdata": FieldSpec(shape, opts["dtype"]), "scale": FieldSpec(sshape, torch.uint8)}

    def write_into(self, q: QuantizedTensor, x: torch.Tensor, amax: Any = None) -> bool:
        if amax is not None or not (q.qdata.is_contiguous() and q.scale.is_contiguous()):
            return False
        self._write(x, q.opts, q.qdata, q.scale)
        return True

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(q.shape)
        out = torch.empty(shape, dtype=dtype, device=q.qdata.device)
        q2 = rows2d(q.qdata)
        k = q2.shape[1]
        if k == 0 or q2.shape[0] == 0:
            return out
        nb = nblocks(k, BLOCK)
        s2 = q.scale.reshape(q2.shape[0], nb)
        o2 = out.view(q2.shape)
        for a, b in row_chunks(q2.shape[0], k):
            blocks = padded_blocks(q2[a:b], BLOCK)
            e = s2[a:b].to(torch.int32) - 127
            # 2**e exactly; code 0 (2**-127) is a float32 subnormal: 2**-126 * 0.5
            s = torch.where(e < -126, exp2_int(e + 1) * 0.5, exp2_int(e))
            v = blocks * s.unsqueeze(-1)
            o2[a:b].copy_(v.view(b - a, -1)[:, :k])
        return out

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        lead = view_keep_last(tuple(q.shape), tuple(shape), self.name)
        nb = q.scale.shape[-1]
        return {"qdata": q.qdata.reshape(shape), "scale": q.scale.reshape(lead + (nb,))}

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        # blocks run along the last dim only: any other dim indexes whole rows of blocks
        if q.dim() < 2:
            return None
        return {"qdata": q.qdata[index], "scale": q.scale[index]}


MXFP8 = register(MxFp8Format())
