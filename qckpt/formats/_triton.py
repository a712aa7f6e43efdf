"""Hand-written Triton kernels: per-tensor amax, the fp8 per-tensor cast and mxfp8 (FLOOR).

Used on CUDA (compute capability >= 8.9, where Triton converts float32 to FP8 with the
hardware's ``cvt.rn.satfinite``) when ``triton`` imports, the input is a contiguous bfloat16 or
float32 tensor and the outputs are contiguous; everything else stays on the torch path.
``QCKPT_TRITON=0`` (or ``_common.set_triton(False)``) turns them off. A kernel that fails to
compile or launch turns its path off for the process, with one warning.

The kernels give the same bits as the torch path (tests/gpu/test_formats_triton.py):

* Inputs are read as integer bit patterns (bfloat16 bits << 16 is the float32 value), so no
  float conversion can flush a subnormal input.
* amax is an integer max of ``bits & 0x7fffffff``: the same order as ``|x|`` for finite
  values, exact, and NaN/Inf read above every finite value, so the caller's finiteness check
  still refuses them. Per-program maxima go to a small int32 buffer (numel / 8192 entries)
  that one torch ``max`` reduces, on the device, without a host sync.
* fp8: ``code = fp8_rn(clamp(div_rn(x, scale), -fmax, fmax))`` with ``tl.div_rn`` (IEEE
  division, as eager torch) and Triton's round-to-nearest-even FP8 conversion (saturating; the
  clamp comes first anyway). The scale is the torch path's, computed on the device.
* mxfp8: the block exponent comes from the bits of the block's integer amax (exact FLOOR
  rule, clamp to [-127, 127]); codes are ``x * 2**-e`` (exact) clamped and converted.
* Subnormal inputs: such an ``x = m * 2**-149`` is replaced by the normal ``m * 2**-23``
  (exact, from the integer ``m``), divided/multiplied as above, and the result multiplied by
  ``2**-126``. Where the true result is a normal float32 this gives the same bits (rounding
  commutes with exact power-of-two scaling in the normal range); where it is below 2**-126
  both give an FP8 (signed) zero. So no flush-to-zero mode of any instruction can change a
  code. The sign is put back by bits, so -0.0 stays -0.0.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (no triton, or a broken one: the torch path is used)
    triton = None
    tl = None

# elements per program: amax and the fp8 cast (1-D), blocks of 32 per program for mxfp8
AMAX_BLOCK = 8192
CAST_BLOCK = 4096
MX_BLOCKS = 128
# FP8 conversion: False = Triton's cast (cvt.rn.satfinite on sm_89+), True = the integer
# round-to-nearest-even of ``_soft_fp8_bits`` (slower; for the CPU interpreter, whose own fp8
# cast drops mantissa carries, and as a fallback). QCKPT_TRITON_SOFT_CVT=1 selects it.
SOFT_CVT: bool = os.environ.get("QCKPT_TRITON_SOFT_CVT", "0") == "1"

_failed: dict[str, str] = {}  # kind -> why
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
    return kind + ("-soft" if SOFT_CVT and kind != "amax" else "")


def usable(kind: str) -> bool:
    return available() and _key(kind) not in _failed


def _fail(kind: str, e: Exception) -> None:
    msg = str(e).splitlines()[0] if str(e) else ""
    _failed[_key(kind)] = f"{type(e).__name__}: {str(e)[:2000]}"
    warnings.warn(
        f"qckpt.formats: the Triton {kind} kernel failed ({type(e).__name__}: {msg}); "
        "using the torch path",
        stacklevel=3,
    )


def _int_view(x: torch.Tensor) -> torch.Tensor:
    """The input's bit patterns: int16 for bfloat16, int32 for float32 (a view, no copy)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


def _fp8_consts(dtype: torch.dtype) -> tuple[float, bool]:
    from qckpt.formats._common import FP8_MAX

    return FP8_MAX[dtype], dtype == torch.float8_e4m3fn


if triton is not None:

    @triton.jit
    def _load_f32_bits(ptrs, mask, IS_BF16: tl.constexpr):
        """float32 bit patterns (int32) of the elements at ``ptrs`` (an int16/int32 view)."""
        if IS_BF16:
            # sign extension does not matter: the high half is shifted out
            b = tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16
        else:
            b = tl.load(ptrs, mask=mask, other=0)
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
    def _amax_kernel(x_ptr, part_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        xb = _load_f32_bits(x_ptr + offs, mask, IS_BF16)
        tl.store(part_ptr + pid, tl.max(xb & 0x7FFFFFFF, axis=0))

    @triton.jit
    def _fp8_cast_kernel(
        x_ptr,
        scale_ptr,
        out_ptr,
        part_ptr,
        n,
        FMAX: tl.constexpr,
        E4M3: tl.constexpr,
        IS_BF16: tl.constexpr,
        CHECK: tl.constexpr,
        SOFT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        xb = _load_f32_bits(x_ptr + offs, mask, IS_BF16)
        if CHECK:
            tl.store(part_ptr + pid, tl.max(xb & 0x7FFFFFFF, axis=0))
        s = tl.load(scale_ptr)
        is_sub, num = _split_subnormal(xb)
        q = tl.div_rn(num, s)
        q = tl.where(is_sub, q * 1.1754943508222875e-38, q)  # * 2**-126
        tl.store(out_ptr + offs, _to_fp8(q, FMAX, E4M3, SOFT), mask=mask)

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
        g = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # block ids, row-major (R, nb)
        t = tl.arange(0, 32)
        gmask = g < n_blocks
        if EVEN_K:
            # K = 32 * nb: block g's elements are g*32 .. g*32+31
            offs = g[:, None] * 32 + t[None, :]
            mask = gmask[:, None]
        else:
            r = g // nb
            col = (g - r * nb) * 32
            offs = r[:, None] * k + col[:, None] + t[None, :]
            mask = gmask[:, None] & ((col[:, None] + t[None, :]) < k)
        xb = _load_f32_bits(x_ptr + offs, mask, IS_BF16)  # padding reads as +0
        amax = tl.max(xb & 0x7FFFFFFF, axis=1)  # per block, as float32 bits
        tl.store(part_ptr + pid, tl.max(amax, axis=0))
        e = ((amax >> 23) & 0xFF) - 127 - EMAX
        e = tl.minimum(tl.maximum(e, -127), 127)
        tl.store(s_ptr + g, (e + 127).to(tl.uint8), mask=gmask)
        # 2**-e exactly: finite amax gives e <= 127 - EMAX, so -e + 127 is in [8, 254]
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
        is_sub, num = _split_subnormal(xb)
        y = num * inv[:, None]
        y = tl.where(is_sub, y * 1.1754943508222875e-38, y)  # * 2**-126
        tl.store(q_ptr + offs, _to_fp8(y, FMAX, E4M3, SOFT), mask=mask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bits_to_f32(part: torch.Tensor) -> torch.Tensor:
    """max of per-program int32 bit patterns -> float32 scalar (NaN/Inf bits stay NaN/Inf)."""
    return part.max().view(torch.float32).reshape(())


def amax(x: torch.Tensor) -> torch.Tensor | None:
    """max |x| as a float32 scalar on x's device, or None when the kernel failed."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    grid = _cdiv(n, AMAX_BLOCK)
    part = torch.empty(grid, dtype=torch.int32, device=x.device)
    try:
        _amax_kernel[(grid,)](
            _int_view(x),
            part,
            n,
            IS_BF16=x.dtype == torch.bfloat16,
            BLOCK=AMAX_BLOCK,
            num_warps=8,
        )
    except Exception as e:  # noqa: BLE001
        _fail("amax", e)
        return None
    return _bits_to_f32(part)


def fp8_cast(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, check: bool
) -> torch.Tensor | None:
    """out <- fp8 codes of x / scale (contiguous, same numel); returns max |x| when ``check``
    (else 0), or None when the kernel failed (nothing usable was written)."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    fmax, e4m3 = _fp8_consts(out.dtype)
    grid = _cdiv(n, CAST_BLOCK)
    part = torch.empty(grid if check else 1, dtype=torch.int32, device=x.device)
    s = scale.reshape(()).to(torch.float32)
    try:
        _fp8_cast_kernel[(grid,)](
            _int_view(x),
            s,
            out.view(-1).view(torch.uint8),
            part,
            n,
            FMAX=fmax,
            E4M3=e4m3,
            IS_BF16=x.dtype == torch.bfloat16,
            CHECK=check,
            SOFT=SOFT_CVT,
            BLOCK=CAST_BLOCK,
            num_warps=4,
        )
    except Exception as e:  # noqa: BLE001
        _fail("fp8", e)
        return None
    if check:
        return _bits_to_f32(part)
    return torch.zeros((), dtype=torch.float32, device=x.device)


def mx_quantize(
    x2: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor, emax: int
) -> torch.Tensor | None:
    """mxfp8 FLOOR of the contiguous (R, K) ``x2`` into codes ``q2`` (R, K) and biased E8M0
    exponents ``s2`` (R, ceil(K / 32)); returns the max block amax (for the NaN/Inf check), or
    None when the kernel failed."""
    r, k = x2.shape
    nb = _cdiv(k, 32)
    n_blocks = r * nb
    if n_blocks == 0:
        return torch.zeros((), dtype=torch.float32, device=x2.device)
    fmax, e4m3 = _fp8_consts(q2.dtype)
    grid = _cdiv(n_blocks, MX_BLOCKS)
    part = torch.empty(grid, dtype=torch.int32, device=x2.device)
    try:
        _mx_kernel[(grid,)](
            _int_view(x2),
            q2.view(torch.uint8),
            s2,
            part,
            n_blocks,
            nb,
            k,
            EMAX=emax,
            FMAX=fmax,
            E4M3=e4m3,
            IS_BF16=x2.dtype == torch.bfloat16,
            EVEN_K=k % 32 == 0,
            SOFT=SOFT_CVT,
            BLOCKS=MX_BLOCKS,
            num_warps=4,
        )
    except Exception as e:  # noqa: BLE001
        _fail("mxfp8", e)
        return None
    return _bits_to_f32(part)


def info() -> dict[str, Any]:
    return {
        "triton": getattr(triton, "__version__", None),
        "available": available(),
        "soft_cvt": SOFT_CVT,
        "failed": dict(_failed),
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
