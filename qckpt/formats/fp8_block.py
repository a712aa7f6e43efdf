"""``fp8_block``: FP8 with one FP32 scale per tile, as DeepSeek-V3-style checkpoints store it.

Layout
------
``qdata``: float8_e4m3fn (default) or float8_e5m2, the nominal shape.
``scale``: float32, one per ``block_size = (br, bc)`` tile of the last two dims, shape
``(*lead, ceil(M / br), ceil(N / bc))`` for an input of shape ``(*lead, M, N)`` (the
compressed-tensors block layout; DeepSeek-V3 calls it ``weight_scale_inv``). Dequantize:
``x[i, j] = qdata[i, j] * scale[i // br, j // bc]``.

Weights use 128x128 tiles (the default); activations 1x128 (``block_size=(1, 128)``). A 1-D
input is one row (shape ``(N,)`` -> scale ``(ceil(N / bc),)``); a 0-d input one element.

Scale rule: ``scale = amax_tile / fp8_max``, the correctly rounded float32 quotient (448 for
E4M3; computed in float64 and rounded once, so CPU, CUDA and compiled kernels agree bit for bit:
see ``numerics.div_f32``), codes
``clamp(x / scale, -fp8_max, fp8_max)`` cast round-to-nearest-even, as in DeepSeek-V3's
``act_quant`` (``s = amax / 448; y = x / s``). ``pow2_scale=True`` uses the MX floor rule
(``2**(floor(log2 amax) - emax)``, see ``fp8``) and is then idempotent through bfloat16.

* Padding: edge tiles (M or N not a multiple of the tile) are partial; each is scaled by its
  valid elements only (as if zero-padded); nothing is stored for the padding.
* An all-zero tile gets scale 1.0 (DeepSeek's reference divides 0 by 0: NaN) and zero codes; a
  tiny non-zero amax never gives a scale below float32's smallest normal.
* Saturation and subnormal codes as in ``fp8``. ``amax=`` takes one calibrated amax per tile
  (the scale's shape); values beyond it saturate.

Views keep the layout if they keep the last two dims (leading dims may be reshaped, size-1 dims
added or removed); ``t()`` of a 2-D tensor transposes codes and scales and swaps ``block_size``.
Round trip: with float scales not idempotent (as ``fp8``: the recomputed scale can move by an
ulp, through bfloat16 more); with ``pow2_scale=True`` bit-exact.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from qckpt.errors import FormatError
from qckpt.formats import kernels, numerics
from qckpt.formats._base import FieldSpec, Format, register
from qckpt.formats.kernels import run_block_kernel
from qckpt.formats.numerics import (
    FP8_EMAX,
    FP8_MAX,
    UnsupportedOpError,
    as_amax,
    check_finite_amax,
    check_input,
    exp2_int,
    float_scale,
    fp8_dtype,
    pow2_exponent,
)
from qckpt.formats.rowblock import nblocks

if TYPE_CHECKING:
    from qckpt.formats.tensor import QuantizedTensor


def _as3d(x: torch.Tensor) -> torch.Tensor:
    """(B, M, N) view: leading dims folded into B; a 1-D tensor is one row, 0-d one element."""
    if x.dim() == 0:
        return x.reshape(1, 1, 1)
    if x.dim() == 1:
        return x.reshape(1, 1, x.shape[0])
    m, n = x.shape[-2], x.shape[-1]
    b = 1
    for d in x.shape[:-2]:
        b *= d
    return x.reshape(b, m, n)


def _mn(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (M, N) matrix that the tiles cover (see _as3d)."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[-2], shape[-1])


def _tile_scale(
    amax: torch.Tensor, dtype: torch.dtype, pow2: bool, fmax64: torch.Tensor
) -> torch.Tensor:
    if pow2:
        s = exp2_int(pow2_exponent(amax, FP8_EMAX[dtype], emin=-126))
        return torch.where(amax > 0, s, torch.ones_like(s))
    # fmax64: fp8_max as a float64 kernel argument, so that the quotient is correctly rounded
    # in compiled code too (inductor would multiply by the reciprocal of a constant)
    return float_scale(amax, fmax64)


def _block_compute(
    c: torch.Tensor,
    br: int,
    bc: int,
    pow2: bool,
    tile_amax: torch.Tensor | None,
    fmax64: torch.Tensor,
    qdtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, N) rows (R a multiple of br, or the tail) -> (codes, (R/br, N/bc) scales, max amax).

    ``tile_amax`` (calibrated, per tile) replaces the tiles' own amax; values beyond it
    saturate. The tiles' own max is returned either way, for the NaN/Inf check."""
    r, n = c.shape
    rp, np_ = nblocks(r, br) * br, nblocks(n, bc) * bc
    cf = c.to(torch.float32)
    if (rp, np_) != (r, n):
        cf = F.pad(cf, (0, np_ - n, 0, rp - r))
    tiles = cf.reshape(rp // br, br, np_ // bc, bc)
    amax = torch.linalg.vector_norm(tiles, ord=float("inf"), dim=(1, 3))
    s = _tile_scale(amax if tile_amax is None else tile_amax, qdtype, pow2, fmax64)
    fmax = FP8_MAX[qdtype]
    q = (tiles / s[:, None, :, None]).clamp_(-fmax, fmax).to(qdtype)
    m = amax.amax() if amax.numel() else amax.new_zeros(())
    return q.reshape(rp, np_)[:r, :n], s, m


def _block_into(
    c: torch.Tensor,
    out_q: torch.Tensor,
    out_s: torch.Tensor,
    br: int,
    bc: int,
    pow2: bool,
    tile_amax: torch.Tensor | None,
    fmax64: torch.Tensor,
) -> torch.Tensor:
    """_block_compute written into out_q / out_s (whole tiles only: see run_block_kernel)."""
    q, s, m = _block_compute(c, br, bc, pow2, tile_amax, fmax64, out_q.dtype)
    out_q.copy_(q)
    out_s.copy_(s)
    return m


@dataclass(frozen=True, kw_only=True)
class Fp8BlockOptions:
    dtype: torch.dtype = torch.float8_e4m3fn
    block_size: tuple[int, int] = (128, 128)  # (rows, cols) of a tile; an int b means (b, b)
    pow2_scale: bool = False
    granularity: InitVar[str] = "block"  # accepted for symmetry; per tile only

    def __post_init__(self, granularity: str) -> None:
        bs = self.block_size
        bs = (bs, bs) if isinstance(bs, int) else tuple(int(b) for b in bs)
        if len(bs) != 2 or min(bs) < 1:
            raise FormatError(f"fp8_block: block_size must be two positive ints, got {bs}")
        object.__setattr__(self, "block_size", bs)
        object.__setattr__(self, "dtype", fp8_dtype(self.dtype))
        object.__setattr__(self, "pow2_scale", bool(self.pow2_scale))
        if granularity != "block":
            raise FormatError(f"fp8_block: granularity must be 'block', got {granularity!r}")


class Fp8BlockFormat(Format):
    name = "fp8_block"
    tensor_fields = ("qdata", "scale")

    Options = Fp8BlockOptions

    def scale_block(self, opts: dict[str, Any], dim: int, ndim: int) -> int:
        if ndim == 1:
            return int(opts["block_size"][-1])
        if ndim >= 2 and dim >= ndim - 2:
            return int(opts["block_size"][dim - (ndim - 2)])
        return 1

    def stored_scheme(self, opts: dict[str, Any]) -> Any:
        from qckpt.formats.scheme import Fp8Scheme

        if opts.get("dtype") != torch.float8_e4m3fn:
            return None
        return Fp8Scheme(granularity="block", block=tuple(opts["block_size"]))

    @staticmethod
    def scale_shape(shape: tuple[int, ...], bs: tuple[int, int]) -> tuple[int, ...]:
        if len(shape) == 0:
            return ()
        if len(shape) == 1:
            return (nblocks(shape[0], bs[1]),)
        return tuple(shape[:-2]) + (nblocks(shape[-2], bs[0]), nblocks(shape[-1], bs[1]))

    def _write(
        self,
        x: torch.Tensor,
        opts: dict[str, Any],
        amax: Any,
        qdata: torch.Tensor,
        scale: torch.Tensor,
    ) -> None:
        br, bc = opts["block_size"]
        x3 = _as3d(x)
        b, m, n = x3.shape
        a3 = None
        if amax is not None:
            # calibrated per-tile amax (the scale's shape), e.g. from a static block calibration
            a = as_amax(amax, x.device)
            if a.numel() != scale.numel():
                raise FormatError(
                    f"fp8_block: amax must have one value per tile, shape {tuple(scale.shape)}, "
                    f"got {tuple(a.shape)}"
                )
            a3 = a.reshape(b, nblocks(m, br), nblocks(n, bc))
        q3 = qdata.view(b, m, n)
        s3 = scale.view(b, nblocks(m, br), nblocks(n, bc))
        if x3.numel() == 0:
            return
        bad = torch.zeros((), device=x.device)
        fmax64 = numerics.f64_const(FP8_MAX[opts["dtype"]], x.device)
        ce = kernels.quant_chunk(x.device, _block_into)
        rows = numerics.rows_per_chunk(n, ce, multiple=br)
        for i in range(b):
            for lo, hi in numerics.chunk_ranges(m, rows):
                tile_amax = None if a3 is None else a3[i, lo // br : nblocks(hi, br)]
                got = run_block_kernel(
                    _block_into,
                    _block_compute,
                    (hi - lo) % br != 0 or n % bc != 0,
                    x3[i, lo:hi],
                    (q3[i, lo:hi], s3[i, lo // br : nblocks(hi, br)]),
                    (br, bc, opts["pow2_scale"], tile_amax, fmax64),
                    (opts["dtype"],),
                )
                bad = torch.maximum(bad, got)
        check_finite_amax(bad, self.name)

    def quantize(self, x: torch.Tensor, opts: dict[str, Any], amax: Any) -> dict[str, torch.Tensor]:
        check_input(x, self.name)
        qdata = torch.empty(x.shape, dtype=opts["dtype"], device=x.device)
        scale = torch.empty(
            self.scale_shape(tuple(x.shape), opts["block_size"]),
            dtype=torch.float32,
            device=x.device,
        )
        self._write(x, opts, amax, qdata, scale)
        return {"qdata": qdata, "scale": scale}

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        return {
            "qdata": FieldSpec(shape, opts["dtype"]),
            "scale": FieldSpec(self.scale_shape(shape, opts["block_size"]), torch.float32, 1.0),
        }

    def write_into(self, q: QuantizedTensor, x: torch.Tensor, amax: Any = None) -> bool:
        if not (q.qdata.is_contiguous() and q.scale.is_contiguous()):
            return False
        self._write(x, q.opts, amax, q.qdata, q.scale)
        return True

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        br, bc = q.opts["block_size"]
        out = torch.empty(q.shape, dtype=dtype, device=q.qdata.device)
        if out.numel() == 0:
            return out
        q3 = _as3d(q.qdata)
        b, m, n = q3.shape
        s3 = q.scale.reshape(b, nblocks(m, br), nblocks(n, bc))
        o3 = out.view(b, m, n)
        rows = numerics.rows_per_chunk(n, multiple=br)
        for i in range(b):
            for lo, hi in numerics.chunk_ranges(m, rows):
                s = s3[i, lo // br : nblocks(hi, br)]
                s = s.repeat_interleave(br, dim=0)[: hi - lo].repeat_interleave(bc, dim=1)[:, :n]
                o3[i, lo:hi].copy_(q3[i, lo:hi].to(torch.float32) * s)
        return out

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        old = tuple(q.shape)
        # the tiles live on the (M, N) matrix of _as3d: a view may reshape the leading dims only
        if _mn(old) != _mn(tuple(shape)):
            raise UnsupportedOpError(
                f"fp8_block: cannot view shape {old} as {tuple(shape)} without dequantizing: "
                "the tiles span the last two dims, so a view must keep them"
            )
        sshape = self.scale_shape(tuple(shape), q.opts["block_size"])
        return {"qdata": q.qdata.reshape(shape), "scale": q.scale.reshape(sshape)}

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        # the tiles cover the last two dims: a leading dim indexes whole (M, N) matrices
        if q.dim() < 3:
            return None
        return {"qdata": q.qdata[index], "scale": q.scale[index]}

    def transpose_fields(self, q: QuantizedTensor) -> Any:
        if q.dim() != 2:
            raise UnsupportedOpError("fp8_block: t() needs a 2-D tensor")
        # tiles of the transpose are the transposed tiles: (br, bc) becomes (bc, br)
        opts = dict(q.opts, block_size=tuple(reversed(q.opts["block_size"])))
        return {"qdata": q.qdata.t(), "scale": q.scale.t()}, opts


FP8_BLOCK = register(Fp8BlockFormat())
