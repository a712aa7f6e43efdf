"""Hand-written Triton kernels: per-tensor amax, the fp8 per-tensor cast and mxfp8 (FLOOR).

Used on CUDA (compute capability >= 8.9, where Triton converts float32 to FP8 with the
hardware's ``cvt.rn.satfinite``) when ``triton`` imports, the input is a contiguous bfloat16 or
float32 tensor and the outputs are contiguous; everything else stays on the torch path.
``KernelPolicy(triton=False)`` (:mod:`qckpt.kernel_policy`; ``QCKPT_TRITON=0`` for the CLI)
turns them off. A kernel that fails to
compile or launch turns its path off for the process, with one warning.

The kernels give the same bits as the torch path (tests/gpu/test_formats_triton.py):

* Inputs are read as integer bit patterns (bfloat16 bits << 16 is the float32 value), so no
  float conversion can flush a subnormal input.
* amax is an integer max of ``bits & 0x7fffffff``: the same order as ``|x|`` for finite
  values, exact, and NaN/Inf read above every finite value, so the caller's finiteness check
  still refuses them. Per-program maxima go to a small int32 buffer that one torch ``max``
  reduces on the device (faster on an H200 than atomics on one address).
* fp8 per-tensor: ``code = fp8_rn(clamp(x / scale, -fmax, fmax))`` with the IEEE quotient and
  Triton's round-to-nearest-even FP8 conversion (saturating; the clamp comes first anyway).
  The cast kernel makes the scale itself from the amax (``fp8._scale_from_amax``, in float64,
  bit for bit) and writes it, so a quantize is two kernels and one host sync: the NaN/Inf
  check, after the cast. A NaN/Inf amax makes the cast write nothing (no code, no scale).
* Division: a bfloat16 x divided by a scale in [2**-60, 2**60] is ``x * r`` (r = 1 / s)
  corrected by one fma residual (``fast_div``), three instructions instead of an IEEE
  division; it equals ``div_rn`` for every bfloat16 significand against every float32 one
  (tests/gpu, 2**31 quotients). float32 input, or a scale outside that range, uses
  ``tl.div_rn``.
* mxfp8: the block exponent comes from the bits of the block's integer amax (exact FLOOR
  rule, clamp to [-127, 127]); codes are ``x * 2**-e`` (exact) clamped and converted.
* Subnormal inputs: on the exact paths such an ``x = m * 2**-149`` is replaced by the normal
  ``m * 2**-23`` (exact, from the integer ``m``), divided/multiplied as above, and the result
  multiplied by ``2**-126``. Where the true result is a normal float32 this gives the same
  bits (rounding commutes with exact power-of-two scaling in the normal range); where it is
  below 2**-126 both give an FP8 (signed) zero. So no flush-to-zero mode of any instruction
  can change a code. The fast paths skip that work where it cannot matter: with a scale
  >= 2**-60 (fp8) or a block amax that is 0 or >= 2**-90 (mxfp8, per program), a subnormal x
  lands far below FP8's smallest subnormal, so whatever the multiply does with it the code is
  a zero of x's sign.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from qckpt.formats.numerics import FP8_EMAX, FP8_MAX
from qckpt.formats.rowblock import nblocks
from qckpt.kernel_policy import current_policy

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (no triton, or a broken one: the torch path is used)
    triton = None
    tl = None

# Launch shapes (bench/tune_triton.py sweeps them): elements per tile and tiles per program
# for the amax and the fp8 cast (1-D), blocks of 32 per program for mxfp8, and warps.
AMAX_BLOCK, AMAX_TILES, AMAX_WARPS = 8192, 8, 8
CAST_BLOCK, CAST_TILES, CAST_WARPS = 4096, 4, 4
MX_BLOCKS, MX_WARPS = 128, 2


# FP8 conversion: False = Triton's cast (cvt.rn.satfinite on sm_89+), True = the integer
# round-to-nearest-even of ``_soft_fp8_bits`` (slower; for the CPU interpreter, whose own fp8
# cast drops mantissa carries, and as a fallback). KernelPolicy.soft_fp8_cast selects it.
def _soft() -> bool:
    return current_policy().soft_fp8_cast


failed: dict[str, str] = {}  # kind -> why
_available: bool | None = None


def available() -> bool:
    """Triton imports and the current CUDA device converts float32 -> FP8 in hardware."""
    global _available
    if _available is None:
        ok = triton is not None and torch.cuda.is_available()
        if ok:
            try:
                ok = torch.cuda.get_device_capability() >= (8, 9)
            except Exception:  # noqa: BLE001
                ok = False
        _available = ok
    return _available


def _key(kind: str) -> str:
    return kind + ("-soft" if _soft() and kind != "amax" else "")


def usable(kind: str) -> bool:
    return available() and _key(kind) not in failed


def _fail(kind: str, e: Exception) -> None:
    msg = str(e).splitlines()[0] if str(e) else ""
    failed[_key(kind)] = f"{type(e).__name__}: {str(e)[:2000]}"
    warnings.warn(
        f"qckpt.formats: the Triton {kind} kernel failed ({type(e).__name__}: {msg}); "
        "using the torch path",
        stacklevel=3,
    )


def _int_view(x: torch.Tensor) -> torch.Tensor:
    """The input's bit patterns: int16 for bfloat16, int32 for float32 (a view, no copy)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


def _fp8_consts(dtype: torch.dtype) -> tuple[float, bool]:
    return FP8_MAX[dtype], dtype == torch.float8_e4m3fn


if triton is not None:

    @triton.jit
    def _load_f32_bits(ptrs, mask, IS_BF16: tl.constexpr, MASKED: tl.constexpr = True):
        """float32 bit patterns (int32) of the elements at ``ptrs`` (an int16/int32 view)."""
        if MASKED:
            b = tl.load(ptrs, mask=mask, other=0)
        else:
            b = tl.load(ptrs)
        if IS_BF16:
            # sign extension does not matter: the high half is shifted out
            b = b.to(tl.int32) << 16
        return b

    @triton.jit
    def _split_subnormal(xb):
        """(is_sub, num): ``num`` is x itself for a normal x, and ``m * 2**-23`` (with x's sign)
        for a subnormal (or zero) x = m * 2**-149; the caller multiplies that result by
        2**-126. Integer ops and one exact int -> float conversion only."""
        ax = xb & 0x7FFFFFFF
        is_sub = ax < 0x800000
        sign = xb ^ ax  # the sign bit alone
        xs = ax.to(tl.float32) * 1.1920928955078125e-07  # m * 2**-23: exact, normal or 0
        xs_b = xs.to(tl.int32, bitcast=True) | sign
        num_b = tl.where(is_sub, xs_b, xb)
        return is_sub, num_b.to(tl.float32, bitcast=True)

    @triton.jit
    def _soft_fp8_bits(y, MB: tl.constexpr, BIAS: tl.constexpr):
        """Round-to-nearest-even float32 -> FP8 bits (int32 0..255) by integer ops, for
        finite |y| <= fp8 max; MB mantissa bits, exponent bias BIAS (E4M3: 3, 7; E5M2: 2, 15).
        Mirrors ``soft_fp8_bits_torch`` (tested against torch's cast)."""
        yb = y.to(tl.int32, bitcast=True)
        sign8 = ((yb >> 31) & 1) << 7
        a = yb & 0x7FFFFFFF
        ex = a >> 23
        # normal FP8: round the mantissa to MB bits (a carry moves into the exponent)
        rn = (a + ((1 << (22 - MB)) - 1) + ((a >> (23 - MB)) & 1)) >> (23 - MB)
        code_n = rn - ((127 - BIAS) << MB)
        # FP8 subnormal: round M * 2**(ex' - 150) to a multiple of 2**(1 - BIAS - MB)
        m = tl.where(ex > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
        sh = (151 - BIAS - MB) - tl.maximum(ex, 1)
        sh = tl.minimum(tl.maximum(sh, 1), 31)
        q = m >> sh
        rem = m & ((1 << sh) - 1)
        half = 1 << (sh - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        code_s = q + up.to(tl.int32)
        code = tl.where(ex >= 128 - BIAS, code_n, code_s)
        return code | sign8

    @triton.jit
    def _to_fp8(y, FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr):
        """clamp to +-FMAX, then FP8 round-to-nearest-even, as uint8 bits."""
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        if SOFT:
            if E4M3:
                out = _soft_fp8_bits(y, 3, 7).to(tl.uint8)
            else:
                out = _soft_fp8_bits(y, 2, 15).to(tl.uint8)
        elif E4M3:
            out = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            out = y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        return out

    @triton.jit
    def _amax_kernel(
        x_ptr,
        part_ptr,
        n,
        IS_BF16: tl.constexpr,
        EVEN: tl.constexpr,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
    ):
        # the program's start goes into the pointer once (64-bit); per-element offsets are
        # 32-bit. A bfloat16's |x| order is its 15 low bits' order: shifted once per program
        start = tl.program_id(0).to(tl.int64) * (BLOCK * TILES)
        rem = n - start
        idx = tl.arange(0, BLOCK)
        m = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in tl.static_range(TILES):
            o = idx + i * BLOCK
            if EVEN:
                b = tl.load(x_ptr + start + o).to(tl.int32)
            else:
                b = tl.load(x_ptr + start + o, mask=o < rem, other=0).to(tl.int32)
            if IS_BF16:
                m = tl.maximum(m, b & 0x7FFF)
            else:
                m = tl.maximum(m, b & 0x7FFFFFFF)
        r = tl.max(m, axis=0)
        if IS_BF16:
            r = r << 16
        # one int32 for the whole tensor (zeroed by the caller): no second reduction launch
        # per-program maxima, reduced by one small torch max: measured faster on an H200 than
        # atomics on one address (tens of thousands of programs contend for it)
        tl.store(part_ptr + tl.program_id(0), r)

    @triton.jit
    def fast_div(x, s, r):
        """x / s rounded as div_rn, from r = div_rn(1, s): the product x * r is within an
        ulp or two and one fma residual corrects it (Markstein). Proven bit-exact by
        exhaustion for bfloat16 x and s in [2**-60, 2**60] only (tests/gpu). A zero or
        infinite first product is the answer: it keeps x's sign whatever a flush-to-zero did
        to the fma, and an overflow (x far beyond the scale's amax) saturates, not NaN."""
        q0 = x * r
        q = tl.fma(tl.fma(-q0, s, x), r, q0)
        return tl.where((q0 == 0.0) | (tl.abs(q0) == float("inf")), q0, q)

    @triton.jit
    def _fp8_tile(
        x_ptr,
        out_ptr,
        o,
        rem,
        s,
        r,
        m,
        FMAX: tl.constexpr,
        E4M3: tl.constexpr,
        IS_BF16: tl.constexpr,
        CHECK: tl.constexpr,
        SOFT: tl.constexpr,
        EVEN: tl.constexpr,
        FASTDIV: tl.constexpr,
    ):
        """One tile of the fp8 cast; returns the running max of |x| bits when CHECK."""
        mask = o < rem
        xb = _load_f32_bits(x_ptr + o, mask, IS_BF16, not EVEN)
        if CHECK:
            m = tl.maximum(m, xb & 0x7FFFFFFF)
        if FASTDIV:
            q = fast_div(xb.to(tl.float32, bitcast=True), s, r)
        else:
            is_sub, num = _split_subnormal(xb)
            q = tl.div_rn(num, s)
            q = tl.where(is_sub, q * 1.1754943508222875e-38, q)  # * 2**-126
        if EVEN:
            tl.store(out_ptr + o, _to_fp8(q, FMAX, E4M3, SOFT))
        else:
            tl.store(out_ptr + o, _to_fp8(q, FMAX, E4M3, SOFT), mask=mask)
        return m

    @triton.jit
    def _fp8_scale(a_bits, FMAX: tl.constexpr, EMAX: tl.constexpr, POW2: tl.constexpr):
        """fp8._scale_from_amax from the amax's float32 bits (>= 0, finite), bit for bit."""
        if POW2:
            # numerics.pow2_exponent with emin -126, then exp2_int: from the exponent bits
            e = ((a_bits >> 23) & 0xFF) - 127 - EMAX
            e = tl.minimum(tl.maximum(e, -126), 127)
            s = ((e + 127) << 23).to(tl.float32, bitcast=True)
        else:
            # numerics.float_scale: the float64 quotient clamped at float32's tiny, rounded once.
            # A subnormal amax is rebuilt from its integer significand (m * 2**-149), so no
            # flush-to-zero of a float32 operand can touch it
            sub = a_bits < 0x800000
            a_sub = a_bits.to(tl.float64) * 7.888609052210118e-31 * 1.7763568394002505e-15
            a_nrm = a_bits.to(tl.float32, bitcast=True).to(tl.float64)
            a64 = tl.where(sub, a_sub, a_nrm)
            # float64 division is IEEE in PTX (div.rn.f64); tl.div_rn takes float32 only
            q = a64 / tl.full((), FMAX, tl.float64)
            s = tl.maximum(q, 1.1754943508222875e-38).to(tl.float32)
        return tl.where(a_bits > 0, s, 1.0)

    @triton.jit
    def _fp8_tiles(
        xs,
        os,
        rem,
        s,
        r,
        m,
        FMAX: tl.constexpr,
        E4M3: tl.constexpr,
        IS_BF16: tl.constexpr,
        CHECK: tl.constexpr,
        SOFT: tl.constexpr,
        EVEN: tl.constexpr,
        FASTDIV: tl.constexpr,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
    ):
        idx = tl.arange(0, BLOCK)
        for i in tl.static_range(TILES):
            m = _fp8_tile(
                xs, os, idx + i * BLOCK, rem, s, r, m, FMAX, E4M3, IS_BF16, CHECK, SOFT, EVEN,
                FASTDIV,
            )  # fmt: skip
        return m

    @triton.jit
    def _fp8_cast_kernel(
        x_ptr,
        scale_ptr,
        amax_ptr,
        out_ptr,
        check_ptr,
        n,
        FMAX: tl.constexpr,
        EMAX: tl.constexpr,
        E4M3: tl.constexpr,
        IS_BF16: tl.constexpr,
        SCALE: tl.constexpr,
        CHECK: tl.constexpr,
        GUARD: tl.constexpr,
        SOFT: tl.constexpr,
        EVEN: tl.constexpr,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
    ):
        """SCALE 0: the scale is read from scale_ptr; 1 (amax / fmax) and 2 (power of two): it
        is made from the amax bits at amax_ptr and program 0 writes it to scale_ptr. GUARD
        (always with SCALE > 0): a NaN/Inf amax writes nothing. CHECK: each program's max |x|
        bits go to check_ptr[pid] (NaN/Inf read above every finite value)."""
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (BLOCK * TILES)
        xs = x_ptr + start
        os = out_ptr + start
        rem = n - start
        ok = pid >= 0  # a true scalar
        if GUARD:
            a_bits = tl.load(amax_ptr)
            ok = (a_bits & 0x7FFFFFFF) < 0x7F800000
        if SCALE == 0:
            s = tl.load(scale_ptr)
        else:
            s = _fp8_scale(a_bits, FMAX, EMAX, SCALE == 2)
            if ok & (pid == 0):
                tl.store(scale_ptr, s)
        m = tl.zeros((BLOCK,), dtype=tl.int32)
        if ok:
            r = tl.div_rn(1.0, s)
            # the fast division's proven range (bfloat16 input only)
            fast = (s >= 8.673617379884035e-19) & (s <= 1.152921504606847e18)
            if IS_BF16:
                if fast:
                    m = _fp8_tiles(
                        xs, os, rem, s, r, m, FMAX, E4M3, IS_BF16, CHECK, SOFT, EVEN, True,
                        BLOCK, TILES,
                    )  # fmt: skip
                else:
                    m = _fp8_tiles(
                        xs, os, rem, s, r, m, FMAX, E4M3, IS_BF16, CHECK, SOFT, EVEN, False,
                        BLOCK, TILES,
                    )  # fmt: skip
            else:
                m = _fp8_tiles(
                    xs, os, rem, s, r, m, FMAX, E4M3, IS_BF16, CHECK, SOFT, EVEN, False,
                    BLOCK, TILES,
                )  # fmt: skip
        else:
            m = m + 0x7F800000  # reads as Inf: the caller refuses the input
        if CHECK:
            tl.store(check_ptr + pid, tl.max(m, axis=0))

    @triton.jit
    def _mx_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        part_ptr,
        n_blocks,
        nb,
        k,
        EMAX: tl.constexpr,
        FMAX: tl.constexpr,
        E4M3: tl.constexpr,
        IS_BF16: tl.constexpr,
        EVEN_K: tl.constexpr,
        SOFT: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        g0 = pid.to(tl.int64) * BLOCKS
        gl = tl.arange(0, BLOCKS)  # the program's blocks, row-major (R, nb)
        t = tl.arange(0, 32)
        gmask = gl < n_blocks - g0
        if EVEN_K:
            # K = 32 * nb: block g's elements are g*32 .. g*32+31; 32-bit offsets from the
            # program's start
            base = g0 * 32
            offs = gl[:, None] * 32 + t[None, :]
            xp = x_ptr + base + offs
            qp = q_ptr + base + offs
            mask = gmask[:, None]
        else:
            g = g0 + gl
            r = g // nb
            col = (g - r * nb) * 32
            offs = r[:, None] * k + col[:, None] + t[None, :]
            xp = x_ptr + offs
            qp = q_ptr + offs
            mask = gmask[:, None] & ((col[:, None] + t[None, :]) < k)
        if IS_BF16:
            b = tl.load(xp, mask=mask, other=0).to(tl.int32)  # padding reads as +0
            amax = tl.max(b & 0x7FFF, axis=1) << 16  # per block, as float32 bits
            xb = b << 16
        else:
            xb = tl.load(xp, mask=mask, other=0)
            amax = tl.max(xb & 0x7FFFFFFF, axis=1)
        tl.store(part_ptr + pid, tl.max(amax, axis=0))
        e = ((amax >> 23) & 0xFF) - 127 - EMAX
        e = tl.minimum(tl.maximum(e, -127), 127)
        tl.store(s_ptr + g0 + gl, (e + 127).to(tl.uint8), mask=gmask)
        # 2**-e exactly: finite amax gives e <= 127 - EMAX, so -e + 127 is in [8, 254]
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        # a block whose amax is 0 or >= 2**-90 has 2**-e <= 2**98, so a subnormal x gives
        # |x * 2**-e| < 2**-28: an FP8 (signed) zero whatever the multiply does with it. Only
        # programs holding a tinier non-zero block need the exact subnormal split
        tiny = tl.max(((amax > 0) & (amax < 0x12800000)).to(tl.int32), axis=0)
        if tiny == 0:
            y = xb.to(tl.float32, bitcast=True) * inv[:, None]
        else:
            is_sub, num = _split_subnormal(xb)
            y = num * inv[:, None]
            y = tl.where(is_sub, y * 1.1754943508222875e-38, y)  # * 2**-126
        tl.store(qp, _to_fp8(y, FMAX, E4M3, SOFT), mask=mask)


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


def _max_f32(part: torch.Tensor) -> torch.Tensor:
    """max of per-program int32 bit patterns -> float32 scalar (NaN/Inf bits stay NaN/Inf)."""
    return part.max().view(torch.float32).reshape(())


def amax(x: torch.Tensor) -> torch.Tensor | None:
    """max |x| as a float32 scalar on x's device (NaN/Inf propagate), or None when the kernel
    failed."""
    n = x.numel()
    if n == 0:
        return _zero(x.device)
    per = AMAX_BLOCK * AMAX_TILES
    grid = nblocks(n, per)
    out = torch.empty(grid, dtype=torch.int32, device=x.device)
    try:
        _amax_kernel[(grid,)](
            _int_view(x),
            out,
            n,
            IS_BF16=x.dtype == torch.bfloat16,
            EVEN=n % per == 0,
            BLOCK=AMAX_BLOCK,
            TILES=AMAX_TILES,
            num_warps=AMAX_WARPS,
        )
    except Exception as e:  # noqa: BLE001
        _fail("amax", e)
        return None
    return _max_f32(out)


def fp8_cast(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    pow2: bool = False,
    check: bool = False,
) -> torch.Tensor | None:
    """out <- fp8 codes of x / scale (x, out contiguous, same numel).

    Either ``scale`` is given (``amax``, if also given, only guards: a NaN/Inf amax writes
    nothing), or it is made in the kernel from ``amax`` as fp8's per-tensor scale (``pow2``:
    its power-of-two option) and written to ``scale_out`` (float32, one element). ``check``:
    the kernel also takes max |x| (when no reduction has seen x yet).

    Returns the float32 amax the caller must refuse NaN/Inf in (the kernel's own with
    ``check``, else ``amax``), or None when the kernel failed (nothing usable was written).
    So the only host sync is the caller's check, after the cast.
    """
    if (scale is None) == (scale_out is None) or (scale is None and amax is None):
        raise ValueError("fp8_cast: give scale, or amax and scale_out")
    n = x.numel()
    if n == 0:
        return _zero(x.device) if check else amax
    fmax, e4m3 = _fp8_consts(out.dtype)

    per = CAST_BLOCK * CAST_TILES
    grid = nblocks(n, per)
    chk = torch.empty(grid, dtype=torch.int32, device=x.device) if check else None
    a_bits = amax.reshape(1).view(torch.int32) if amax is not None else None
    s_ptr = scale.reshape(1).to(torch.float32) if scale is not None else scale_out
    try:
        _fp8_cast_kernel[(grid,)](
            _int_view(x),
            s_ptr,
            a_bits if a_bits is not None else s_ptr,
            out.view(-1).view(torch.uint8),
            chk if chk is not None else s_ptr,
            n,
            FMAX=fmax,
            EMAX=FP8_EMAX[out.dtype],
            E4M3=e4m3,
            IS_BF16=x.dtype == torch.bfloat16,
            SCALE=0 if scale is not None else (2 if pow2 else 1),
            CHECK=check,
            GUARD=a_bits is not None,
            SOFT=_soft(),
            EVEN=n % per == 0,
            BLOCK=CAST_BLOCK,
            TILES=CAST_TILES,
            num_warps=CAST_WARPS,
        )
    except Exception as e:  # noqa: BLE001
        _fail("fp8", e)
        return None
    return _max_f32(chk) if chk is not None else amax


def mx_quantize(
    x2: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor, emax: int
) -> torch.Tensor | None:
    """mxfp8 FLOOR of the contiguous (R, K) ``x2`` into codes ``q2`` (R, K) and biased E8M0
    exponents ``s2`` (R, ceil(K / 32)); returns the max block amax (for the NaN/Inf check), or
    None when the kernel failed."""
    r, k = x2.shape
    nb = nblocks(k, 32)
    n_blocks = r * nb
    if n_blocks == 0:
        return _zero(x2.device)
    fmax, e4m3 = _fp8_consts(q2.dtype)
    grid = nblocks(n_blocks, MX_BLOCKS)
    out = torch.empty(grid, dtype=torch.int32, device=x2.device)
    try:
        _mx_kernel[(grid,)](
            _int_view(x2),
            q2.view(torch.uint8),
            s2,
            out,
            n_blocks,
            nb,
            k,
            EMAX=emax,
            FMAX=fmax,
            E4M3=e4m3,
            IS_BF16=x2.dtype == torch.bfloat16,
            EVEN_K=k % 32 == 0,
            SOFT=_soft(),
            BLOCKS=MX_BLOCKS,
            num_warps=MX_WARPS,
        )
    except Exception as e:  # noqa: BLE001
        _fail("mxfp8", e)
        return None
    return _max_f32(out)


def info() -> dict[str, Any]:
    return {
        "triton": getattr(triton, "__version__", None),
        "available": available(),
        "soft_cvt": _soft(),
        "failed": dict(failed),
    }


def soft_fp8_bits_torch(y: torch.Tensor, e4m3: bool) -> torch.Tensor:
    """``_soft_fp8_bits`` line for line in torch (int64 for the shifts): FP8 bits (uint8) of
    float32 ``y`` with finite |y| <= fp8 max, rounded to nearest even. For tests on CPU."""
    mb, bias = (3, 7) if e4m3 else (2, 15)
    sh_n = 23 - mb
    yb = y.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    sign8 = ((yb >> 31) & 1) << 7
    a = yb & 0x7FFFFFFF
    ex = a >> 23
    rn = (a + ((1 << (sh_n - 1)) - 1) + ((a >> sh_n) & 1)) >> sh_n
    code_n = rn - ((127 - bias) << mb)
    m = torch.where(ex > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    sh = ((151 - bias - mb) - ex.clamp_min(1)).clamp(1, 31)
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    code_s = q + up.to(torch.int64)
    code = torch.where(ex >= 128 - bias, code_n, code_s)
    return (code | sign8).to(torch.uint8)
