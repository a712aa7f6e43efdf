"""The formats' numbers: FP8 constants, chunking, finiteness checks, exact division.

Conventions every format follows:

* ``scale`` is always the *dequantization* multiplier: ``x ~= code * scale`` (so an FP8
  export's ``weight_scale`` is ``scale`` as is, e.g. ``amax / 448``).
* A scale is never zero, negative, NaN or Inf: an all-zero tensor / block gets a documented
  positive scale (1.0 for float scales, 2**-127 for E8M0 scales) and all-zero codes.
* Work is done in chunks of about ``CHUNK_ELEMS`` elements, so the temporaries of a quantize
  are O(chunk) (a few FP32 copies of one chunk), never a full-size FP32 copy of the input.

Which kernels compute them (compiled, Triton) is :mod:`qckpt.formats.kernels`'; the export and
calibration share the division and scale rules here (``div_f32``, ``float_scale``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch

from qckpt.errors import FormatError

# Chunk size in elements. 16 Mi elements keeps each kernel large enough to saturate a GPU while
# the FP32 temporaries of one chunk stay at a few x 64 MiB. Tests shrink it to hit chunk edges.
CHUNK_ELEMS: int = 1 << 24


FP8_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


# max finite value and the unbiased exponent of its leading bit (emax) per FP8 dtype
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


FP8_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}


# smallest positive normal float32: a floor for computed float scales so that a tiny but
# non-zero amax never produces a zero (or subnormal, slow on some hardware) scale.
F32_TINY = torch.finfo(torch.float32).tiny


class UnsupportedOpError(FormatError, NotImplementedError):
    """An op (or a view) that a QuantizedTensor of some format cannot do without dequantizing.

    It is both a ``FormatError`` (the CLI's one-line error) and a ``NotImplementedError``
    (what torch code expects from an unsupported op).
    """


def fp8_dtype(value: Any) -> torch.dtype:
    """Accept ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or their short names."""
    if isinstance(value, torch.dtype):
        if value in FP8_MAX:
            return value
    elif isinstance(value, str) and value.lower() in FP8_DTYPES:
        return FP8_DTYPES[value.lower()]
    raise FormatError(
        f"unsupported fp8 dtype {value!r}: use torch.float8_e4m3fn or torch.float8_e5m2"
    )


# set by defer_finite_checks: the finiteness checks collected instead of made at once
_DEFERRED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "qckpt_deferred_finite_checks", default=None
)


@contextlib.contextmanager
def defer_finite_checks() -> Iterator[list[tuple[torch.Tensor, str]]]:
    """Within the block, :func:`check_finite_amax` appends ``(amax max, format)`` to the list
    it yields instead of reading the number on the host. A check is a device-to-host copy,
    which waits for everything queued on the stream: a streaming load that checked each
    destination as it quantized it stalled its calling thread once per destination, and the
    reads queued behind it (measured on an H200: fp8 stream 1.21x a plain BF16 load). The
    caller checks the list later (:func:`first_not_finite`, one wait for all)."""
    pending: list[tuple[torch.Tensor, str]] = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def finite_checks_deferred() -> bool:
    """Whether a :func:`defer_finite_checks` block is open here (its checks are collected)."""
    return _DEFERRED.get() is not None


def first_not_finite(pending: list[tuple[torch.Tensor, str]]) -> tuple[int, str] | None:
    """The index of the first deferred check that fails and its message, or None: one
    device-to-host copy for the whole list (per device)."""
    bad: list[int] = []
    by_dev: dict[torch.device, list[int]] = {}
    for i, (a, _) in enumerate(pending):
        by_dev.setdefault(a.device, []).append(i)
    for idx in by_dev.values():
        flags = torch.stack([pending[i][0].to(torch.float32) for i in idx]).isfinite()
        bad.extend(i for i, ok in zip(idx, flags.tolist(), strict=True) if not ok)
    if not bad:
        return None
    i = min(bad)
    what = "NaN" if math.isnan(float(pending[i][0])) else "Inf"
    return i, f"cannot quantize to {pending[i][1]}: the input contains {what} values"


def check_finite_amax(amax: torch.Tensor, fmt: str) -> None:
    """Refuse NaN/Inf input. ``amax`` reductions propagate NaN and Inf, so one small check
    after the reduction covers the whole input without an extra full pass. Inside
    :func:`defer_finite_checks` the check is collected, not made."""
    if amax.numel() == 0:
        return
    pending = _DEFERRED.get()
    if pending is not None:
        pending.append((amax.max(), fmt))  # a new tensor: later writes to amax cannot change it
        return
    # one number to the host (max propagates NaN; an amax is >= 0, so no -Inf to miss)
    v = float(amax if amax.numel() == 1 else amax.max())
    if not math.isfinite(v):
        bad = "NaN" if math.isnan(v) else "Inf"
        raise FormatError(f"cannot quantize to {fmt}: the input contains {bad} values")


def check_input(x: torch.Tensor, fmt: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"cannot quantize to {fmt}: expected a tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise FormatError(
            f"cannot quantize to {fmt}: input dtype {x.dtype} is not a high-precision float"
        )


def chunk_ranges(n: int, step: int) -> Iterator[tuple[int, int]]:
    step = max(1, int(step))
    for s in range(0, n, step):
        yield s, min(n, s + step)


def rows_per_chunk(row_elems: int, chunk_elems: int | None = None, multiple: int = 1) -> int:
    """Rows per chunk so that a chunk holds about ``chunk_elems`` elements (at least one row),
    rounded down to a multiple of ``multiple`` (block formats chunk whole block rows)."""
    ce = CHUNK_ELEMS if chunk_elems is None else chunk_elems
    rows = max(1, ce // max(1, row_elems))
    if multiple > 1:
        rows = max(multiple, rows // multiple * multiple)
    return rows


def flat_view(x: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``x``; a non-contiguous input costs one copy in its own dtype (never FP32)."""
    return x.reshape(-1)


def abs_amax(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max |x| as float32, without a full-size |x| temporary (inf-norm reduces in one kernel).

    The inf-norm propagates NaN and returns Inf for Inf input, which the finiteness check needs.
    """
    return torch.linalg.vector_norm(x, ord=math.inf, dim=dim).to(torch.float32)


def pow2_exponent(amax: torch.Tensor, emax: int, emin: int = -127) -> torch.Tensor:
    """OCP MX shared-exponent rule: floor(log2(amax)) - emax, clamped to [emin, 127]
    (E8M0's range is [-127, 127]).

    floor(log2) is read from the float32 exponent bits, which is exact (no log2 rounding). A
    subnormal or zero amax reads as -127 - emax, so it lands on the floor ``emin``.
    """
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    return (e - emax).clamp(emin, 127)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, for integer e in [-126, 127] (clamped to it).

    Built from the exponent bits rather than ``ldexp``/``exp2``: compiled GPU code may evaluate
    those with an approximate ``ex2`` instruction that also flushes subnormals."""
    e = e.to(torch.int32).clamp(-126, 127)
    return ((e + 127) << 23).view(torch.float32)


def f64_const(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-d float64 tensor on ``device``: a divisor for :func:`div_f32`.

    Pass it *into* a compiled kernel as an argument (never build it inside): inductor turns a
    division by a constant into a multiplication by its reciprocal."""
    return torch.full((), value, dtype=torch.float64, device=device)


def div_f32(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``fl32(a / d)``, the correctly rounded float32 quotient, the same bits on every device,
    eager or compiled, for float32 ``a`` and a float64 tensor ``d`` holding a float32 value.

    Why not ``a / 448.0``: CPU torch divides, but CUDA torch computes ``tensor / python_scalar``
    as ``tensor * fl32(1 / scalar)`` (ATen's CPU-scalar optimization in div_true_kernel_cuda)
    and inductor (GPU) does the same for any constant divisor; that product is off by one ulp
    for about half of all inputs (``1/448`` is not a float32). Here the quotient is computed
    in float64 by a true division (the divisor is a device tensor, not a constant; float64
    division is IEEE in eager CUDA and in Triton) and rounded once to float32. That double
    rounding is innocuous: for +-*/ with p-bit operands, an intermediate of >= 2p + 2 bits
    (53 >= 2 * 24 + 2) rounds to the correctly rounded p-bit result (Figueroa), including ties
    and float32 subnormal results (float64 has no subnormals in this range).
    """
    return (a.to(torch.float64) / d).to(torch.float32)


def float_scale(amax: torch.Tensor, qmax: float | torch.Tensor) -> torch.Tensor:
    """amax / qmax as a float32 scale; 1.0 where amax == 0; never below float32's tiny.

    Bit-identical to float32 ``(amax / qmax).clamp_min(tiny)`` on CPU, on every device (see
    :func:`div_f32`; the clamp is applied in float64 first, which rounds the same since
    rounding is monotone and ``tiny`` is a float32). Inside a compiled kernel pass ``qmax`` as
    an :func:`f64_const` argument."""
    amax = amax.to(torch.float32)
    d = qmax if isinstance(qmax, torch.Tensor) else f64_const(qmax, amax.device)
    s = (amax.to(torch.float64) / d).clamp_min(F32_TINY).to(torch.float32)
    return torch.where(amax > 0, s, torch.ones_like(s))


def as_amax(amax: Any, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(amax, dtype=torch.float32, device=device)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise FormatError(f"amax must be finite and >= 0, got {t.flatten()[:4].tolist()}")
    return t


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sums along the last dim of float64 ``x``, as a fixed tree of elementwise additions
    (the dim padded with zeros to a power of two, then halves added: ``x[:h] + x[h:]``, ...):
    each addition is one correctly rounded IEEE operation, so the sums are the same bits on
    every device, whatever its own reduction order (``torch.sum``'s is not fixed)."""
    n = x.shape[-1]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
