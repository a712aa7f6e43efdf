"""``nvfp4``: NVIDIA FP4: E2M1 elements in blocks of 16, E4M3 block scales, FP32 global scale.

Layout
------
``qdata``: uint8, two E2M1 codes per byte, **low nibble first**: element ``2j`` of a row is in
bits 0-3 of byte ``j``, element ``2j+1`` in bits 4-7. Shape ``(*shape[:-1], ceil(K / 2))``.
An E2M1 code is ``sign << 3 | magnitude``, magnitudes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6.
``scale``: float8_e4m3fn block scales, shape ``(*shape[:-1], ceil(K / 16))``.
``global_scale``: float32 ``()``: ``amax / (6 * 448)`` of the whole tensor (``amax=`` replaces
the computed amax; an all-zero tensor gets 1.0). Both divisions by constants (this one and
``amax_block / 6`` below) give the correctly rounded float32 quotient on every device, eager or
compiled (``numerics.div_f32``: CUDA torch would multiply by a rounded reciprocal instead). Dequantize:
``x = e2m1(code) * (global_scale * float(scale_block))``.

Quantize (the NVIDIA two-level recipe, bit-exact with torchao's ``nvfp4_quantize`` given a
per-tensor scale):

* ``s_b = e4m3(clamp((amax_block / 6) / global_scale, 2**-6, 448))``: round-to-nearest-even.
  The floor 2**-6 (E4M3's smallest normal) keeps every block scale positive: an all-zero block
  gets 2**-6 and zero codes; a block far below the tensor's amax (< 2**-6 / 448 of it) is
  scaled coarser than ideal. E4M3 subnormal block scales are never produced.
* ``codes = e2m1(clamp(x * ((1 / global_scale) / s_b), -6, 6))``, round-to-nearest-even (ties to
  the even code), saturating at +-6. The sign is kept for values that round to zero (-0 is code
  8), as in torchao.

Padding: blocks of 16 run along the last dim; a partial last block is scaled by its valid
elements (as if zero-padded); for odd K the last byte's high nibble is 0 (+0). Nothing else is
stored. Views keep the layout only if they keep the last dim; no transpose.

Round trip: not idempotent in general. The global scale is a float ratio: re-deriving it from the
dequantized tensor gives ``6 * s_b_max * gs`` rounded, so gs can move in its last bits, and block
scales near an E4M3 rounding boundary then round the other way; codes follow. Through bfloat16
the dequantized values themselves are rounded too (a code times a non-power-of-two scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qckpt.errors import FormatError
from qckpt.formats import kernels, numerics
from qckpt.formats._base import FieldSpec, Format, register
from qckpt.formats.kernels import run_block_kernel, tensor_amax
from qckpt.formats.numerics import as_amax, check_finite_amax, check_input, div_f32, float_scale
from qckpt.formats.rowblock import (
    last_dim,
    nblocks,
    padded_blocks,
    row_chunks,
    rows2d,
    view_keep_last,
)

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

if TYPE_CHECKING:
    from qckpt.formats.tensor import QuantizedTensor


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 in [-6, 6] -> uint8 E2M1 codes (0..15), round to nearest, ties to even code.

    Magnitude code = number of rounding boundaries passed. At the boundaries 0.25, 1.25, 2.5, 5
    the even code is below (ties go down: strict >); at 0.75, 1.75, 3.5 it is above (>=).
    """
    a = y.abs()
    m = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return m | (torch.signbit(y).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[rows, 2k]`` -> bytes ``[rows, k]``, the even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_e2m1`'s bytes ``[rows, k]`` -> uint8 codes ``[rows, 2k]``."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) -> float32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    v = lut[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -v, v)


# e2m1_codes' rounding boundaries for a strict ``>``: the ``>=`` ones (0.75, 1.75, 3.5) moved
# to the float32 just below, so that ``a > b'`` is ``a >= b`` for every float32 ``a``
_E2M1_STRICT_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    got = _E2M1_TABLES.get(device)
    if got is None:
        b = torch.tensor(_E2M1_STRICT_BOUNDS, dtype=torch.float32)
        below = torch.nextafter(b, torch.tensor(-1.0))
        b = torch.where(torch.tensor([False, True, False, True, False, True, False]), below, b)
        got = (b.to(device), torch.tensor(E2M1_VALUES, dtype=torch.float32).to(device))
        _E2M1_TABLES[device] = got
    return got


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """``e2m1_values(e2m1_codes(y))`` bit for bit (signed zeros included) in four kernels
    instead of some thirty: GPTQ's column loop rounds one column at a time, so its time is
    the number of kernels it launches. ``y``: float32 in [-6, 6]."""
    bounds, values = _e2m1_tables(y.device)
    return torch.copysign(values[torch.bucketize(y.abs(), bounds)], y)


def e4m3_round_normal(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` in [2**-6, 448] rounded to the nearest E4M3 value, ties to even, as float32.

    Done by hand so that the float8 cast after it is exact and the same on every path (no
    float8 conversion of an arbitrary float32 inside a compiled kernel). For a normal float32 of
    biased exponent ``E`` the E4M3 step is 2**(E - 130): scale by its inverse (exact, a power of
    two), round to an integer in [8, 16] (``torch.round`` is ties-to-even, ``nearbyint`` in
    Triton), scale back. (The H200 difference first blamed on the cast, amax 11776 giving
    0.0234375 for CPU's 0.021484375, was the folded casts described in ``max_block_scales``.)"""
    e = (v.view(torch.int32) >> 23) & 0xFF
    inv_step = ((257 - e) << 23).view(torch.float32)
    step = ((e - 3) << 23).view(torch.float32)
    return torch.round(v * inv_step) * step


def max_block_scales(amax: torch.Tensor, six64: torch.Tensor, gs64: torch.Tensor) -> torch.Tensor:
    """The max rule's block scales ``e4m3(clamp(fl32(fl32(amax / 6) / gs), 2**-6, 448))`` as
    float32 E4M3 values, for block amaxes ``amax`` (float32, never negative); ``six64`` and
    ``gs64`` are float64 tensors made outside any compiled kernel (see ``numerics.div_f32``).
    The one definition the quantizer and the calibration searches (mse, gptq) share.

    The first quotient must be rounded to float32 before the second division. Inductor's
    ``pointless_convert`` pass (torch 2.11) folds the float64 -> float32 -> float64 casts
    between the two div_f32 calls into nothing, which divides once in float64 instead: a block
    of amax 11776 under gs 0x47aaaaab then lands exactly on an E4M3 tie (11.5 * 2**-9, rounded
    up to 0.0234375) where the two roundings give 11.4999990 * 2**-9 (0.021484375). The clamp
    at 0 (an identity here) is a float32 op between the casts, so the pattern no longer
    matches."""
    amax6 = div_f32(amax, six64).clamp_min(0.0)
    return e4m3_round_normal(div_f32(amax6, gs64).clamp(E4M3_TINY, E4M3_MAX))


def _nvfp4_compute(
    c: torch.Tensor, gs64: torch.Tensor, inv_gs: torch.Tensor, six64: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R, K) chunk -> (packed codes (R, ceil(K/2)), E4M3 scales (R, nb), max block amax).

    Every float32 quotient here is the correctly rounded one on every device, eager or
    compiled: ``gs64`` is the global scale as float64 and ``six64`` 6.0 as a float64 argument
    (``numerics.div_f32``); ``inv_gs`` is ``fl32(1 / global_scale)``, made by the caller outside
    the kernel. Inside a compiled CUDA kernel ``1.0 / gs`` is a reciprocal that inductor does
    not round as IEEE division (Triton's approximate ``/``; found on the H200 with torch 2.11,
    where 0.9 % of the codes of an 11008 x 4096 weight differed from CPU), while a tensor
    quotient follows the ``division_rounding`` option. No float8 -> float64 cast either: Triton
    has none (the kernel fails to compile)."""
    r, k = c.shape
    blocks = padded_blocks(c, BLOCK)  # (R, nb, 16) float32
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1)
    sb32 = max_block_scales(amax, six64, gs64)
    sb = sb32.to(torch.float8_e4m3fn)  # exact: sb32 is already an E4M3 value
    # the reciprocal form ((1 / gs) / s_b), not x / (gs * s_b): NVIDIA's kernels and torchao
    # compute it so, and the E2M1 rounding of a value on a boundary depends on it. A float64
    # quotient (div_f32) is IEEE in Triton whatever inductor's division option does.
    rec = div_f32(inv_gs, sb32.to(torch.float64))
    codes = e2m1_codes((blocks * rec.unsqueeze(-1)).clamp_(-E2M1_MAX, E2M1_MAX)).reshape(r, -1)
    packed = pack_e2m1(codes)
    m = amax.amax() if amax.numel() else amax.new_zeros(())
    return packed[:, : -(-k // 2)], sb, m


def _nvfp4_into(
    c: torch.Tensor,
    out_q: torch.Tensor,
    out_s: torch.Tensor,
    gs64: torch.Tensor,
    inv_gs: torch.Tensor,
    six64: torch.Tensor,
) -> torch.Tensor:
    """_nvfp4_compute written into out_q / out_s (K a multiple of 16: see run_block_kernel)."""
    q, s, m = _nvfp4_compute(c, gs64, inv_gs, six64)
    out_q.copy_(q)
    out_s.copy_(s)
    return m


@dataclass(frozen=True, kw_only=True)
class NvFp4Options:
    block_size: int = BLOCK  # fixed by the format

    def __post_init__(self) -> None:
        if self.block_size != BLOCK:
            raise FormatError(f"nvfp4: block_size is {BLOCK}, got {self.block_size}")


class NvFp4Format(Format):
    name = "nvfp4"
    tensor_fields = ("qdata", "scale", "global_scale")

    Options = NvFp4Options
    ignored_opts = ("granularity",)

    def scale_block(self, opts: dict[str, Any], dim: int, ndim: int) -> int:
        return BLOCK if dim == ndim - 1 else 1

    def whole_scale(self, opts: dict[str, Any]) -> str | None:
        return "tensor"  # the float32 global scale

    def stored_scheme(self, opts: dict[str, Any]) -> Any:
        from qckpt.formats.scheme import Nvfp4Scheme

        return Nvfp4Scheme()

    def _write(
        self,
        x: torch.Tensor,
        amax: Any,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        gscale: torch.Tensor,
    ) -> None:
        if amax is None:
            a = tensor_amax(x)
            check_finite_amax(a, self.name)
            check = False
        else:
            a = as_amax(amax, x.device).reshape(())
            check = True
        gs = float_scale(a, E2M1_MAX * E4M3_MAX)
        gscale.copy_(gs)
        x2 = rows2d(x)
        k = x2.shape[1]
        if k == 0:
            return
        q2 = qdata.view(x2.shape[0], -(-k // 2))
        s2 = scale.view(x2.shape[0], nblocks(k, BLOCK))
        bad = torch.zeros((), device=x.device)
        six64 = numerics.f64_const(E2M1_MAX, x.device)
        gs64 = gs.to(torch.float64)
        # eager, outside any compiled kernel: a float64 reciprocal is IEEE on every device, and
        # rounded once to float32 it equals CPU torch's float32 1 / gs (div_f32's argument)
        inv_gs = (1.0 / gs64).to(torch.float32)
        ce = kernels.quant_chunk(x.device, _nvfp4_into)
        for lo, hi in row_chunks(x2.shape[0], k, ce):
            m = run_block_kernel(
                _nvfp4_into,
                _nvfp4_compute,
                k % BLOCK != 0,
                x2[lo:hi],
                (q2[lo:hi], s2[lo:hi]),
                (gs64, inv_gs, six64),
            )
            bad = torch.maximum(bad, m)
        if check:
            check_finite_amax(bad, self.name)

    @staticmethod
    def _shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        k = last_dim(shape)
        lead = shape[:-1] if shape else ()
        return lead + (-(-k // 2),), lead + (nblocks(k, BLOCK),)

    def quantize(self, x: torch.Tensor, opts: dict[str, Any], amax: Any) -> dict[str, torch.Tensor]:
        check_input(x, self.name)
        qshape, sshape = self._shapes(tuple(x.shape))
        qdata = torch.empty(qshape, dtype=torch.uint8, device=x.device)
        scale = torch.empty(sshape, dtype=torch.float8_e4m3fn, device=x.device)
        gscale = torch.empty((), dtype=torch.float32, device=x.device)
        self._write(x, amax, qdata, scale, gscale)
        return {"qdata": qdata, "scale": scale, "global_scale": gscale}

    def field_specs(self, shape: tuple[int, ...], opts: dict[str, Any]) -> dict[str, FieldSpec]:
        qshape, sshape = self._shapes(shape)
        return {
            "qdata": FieldSpec(qshape, torch.uint8),
            # an all-zero block's scale is E4M3's smallest normal
            "scale": FieldSpec(sshape, torch.float8_e4m3fn, E4M3_TINY),
            "global_scale": FieldSpec((), torch.float32, 1.0),
        }

    def write_into(self, q: QuantizedTensor, x: torch.Tensor, amax: Any = None) -> bool:
        if not all(t.is_contiguous() for t in (q.qdata, q.scale)):
            return False
        self._write(x, amax, q.qdata, q.scale, q.global_scale)
        return True

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(q.shape)
        out = torch.empty(shape, dtype=dtype, device=q.qdata.device)
        k = last_dim(shape)
        rows = out.numel() // k if k else 0
        if rows == 0:
            return out
        nb = nblocks(k, BLOCK)
        q2 = q.qdata.reshape(rows, -(-k // 2))
        s2 = q.scale.reshape(rows, nb)
        o2 = out.view(rows, k)
        gs = q.global_scale.to(torch.float32)
        for lo, hi in row_chunks(rows, k):
            p = q2[lo:hi]
            codes = torch.stack([p & 0xF, p >> 4], dim=-1).view(hi - lo, -1)
            vals = torch.nn.functional.pad(e2m1_values(codes), (0, nb * BLOCK - codes.shape[1]))
            s = gs * s2[lo:hi].to(torch.float32)
            v = vals.view(hi - lo, nb, BLOCK) * s.unsqueeze(-1)
            o2[lo:hi].copy_(v.view(hi - lo, -1)[:, :k])
        return out

    def view_fields(self, q: QuantizedTensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        lead = view_keep_last(tuple(q.shape), tuple(shape), self.name)
        return {
            "qdata": q.qdata.reshape(lead + (q.qdata.shape[-1],)),
            "scale": q.scale.reshape(lead + (q.scale.shape[-1],)),
            "global_scale": q.global_scale,
        }

    def select_fields(self, q: QuantizedTensor, index: int) -> dict[str, torch.Tensor] | None:
        if q.dim() < 2:
            return None
        return {"qdata": q.qdata[index], "scale": q.scale[index], "global_scale": q.global_scale}


NVFP4 = register(NvFp4Format())
