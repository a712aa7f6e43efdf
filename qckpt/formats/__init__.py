"""Quantization formats: ``quantize(x, fmt, **opts) -> QuantizedTensor``.

Public API
----------
* ``quantize(x, fmt, **opts)``: ``amax=`` (fp8, fp8_delayed, nvfp4; per tile for fp8_block)
  replaces the computed amax;
  the rest are the format's options. NaN/Inf input raises ``FormatError``.
* ``FORMATS``: name -> ``Format``; ``is_quantized(t)``; ``dequantize(t, dtype)``.
* ``empty(shape, fmt, nominal_dtype=, device=, **opts)``: a fresh tensor (fields as quantizing zeros
  gives; shapes only on meta); ``torch.empty_like(q, device=)`` / ``Module.to_empty`` make one.
* ``QuantizedTensor`` (``qckpt.formats.tensor``): nominal ``shape``/``dtype``; fields ``qdata``,
  ``scale`` (+ ``global_scale`` for nvfp4, ``amax_history``/``quant_scale`` for fp8_delayed),
  ``fmt``, ``opts``; ``dequantize(dtype)``, ``quantize_(src, update_state=True)``, ``copy_``,
  ``quant_state()`` / ``load_quant_state()``, ``quantized_nbytes()``.
* ``KernelPolicy(compile="auto"|"always"|"never", triton=True, soft_fp8_cast=False)``: which
  kernels run (every choice gives the same bits); ``quantize(..., policy=)`` or
  ``with kernel_policy(p):`` (``qckpt.kernel_policy``).

Formats (layouts in each module's docstring; ``scale`` is always the dequantization multiplier)
------------------------------------------------------------------------------------------------
* ``fp8``: E4M3/E5M2 codes of the nominal shape; f32 scale ``()`` (tensor) or ``(rows, 1, ..)``
  (channel). Round trip bit-exact with ``pow2_scale=True``; otherwise the codes come back via
  f32 but the recomputed scale may move an ulp (and codes too via bf16).
* ``fp8_delayed``: as fp8 per-tensor, the scale from an amax history (``quant_scale`` for the
  next quantize_); a round trip re-derives the scale from the history, not the data.
* ``mxfp8``: E4M3/E5M2 codes; uint8 E8M0 (biased) per 32 along the last dim. Bit-exact round
  trip through f32 and bf16 (bf16: except values below 2**-133 in blocks of amax < 2**-116).
* ``fp8_block``: E4M3/E5M2 codes; f32 scale per 128x128 tile (1x128 for activations).
  Bit-exact round trip with ``pow2_scale=True``.
* ``nvfp4``: uint8, two E2M1 codes per byte, low nibble first; E4M3 scale per 16 along the last
  dim and an f32 ``global_scale``. Not idempotent (float global scale, E4M3 block scales).

Padding: a block/tile that runs past the tensor's edge is scaled by its valid elements (as if
zero-padded) and nothing is stored for the padding. Quantize works in chunks of
``numerics.CHUNK_ELEMS`` elements: the temporaries are O(chunk), never a full-size FP32 copy.
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.errors import FormatError
from qckpt.formats import fp8 as _fp8  # noqa: F401  (registers fp8, fp8_delayed)
from qckpt.formats import fp8_block as _fp8_block  # noqa: F401
from qckpt.formats import mxfp8 as _mxfp8  # noqa: F401
from qckpt.formats import nvfp4 as _nvfp4  # noqa: F401
from qckpt.formats._base import FORMATS, Format
from qckpt.formats.numerics import UnsupportedOpError
from qckpt.formats.tensor import QuantizedTensor, implements, is_quantized
from qckpt.kernel_policy import KernelPolicy, current_policy, kernel_policy

__all__ = [
    "FORMATS",
    "Format",
    "FormatError",
    "QuantizedTensor",
    "UnsupportedOpError",
    "dequantize",
    "empty",
    "implements",
    "is_quantized",
    "quantize",
    "KernelPolicy",
    "current_policy",
    "kernel_policy",
]


def quantize(
    x: torch.Tensor, fmt: str, *, policy: KernelPolicy | None = None, **opts: Any
) -> QuantizedTensor:
    """Quantize high-precision ``x`` to format ``fmt``.

    ``amax=`` (a float or tensor) replaces the computed amax (calibration / export); the other
    options are the format's (see its module). ``policy`` picks the kernels (default: the one in
    scope, see :mod:`qckpt.kernel_policy`). The result's nominal dtype is ``x.dtype``.
    Raises ``FormatError`` for NaN/Inf input, an unknown format or option.
    """
    if policy is not None:
        with kernel_policy(policy):
            return quantize(x, fmt, **opts)
    if fmt not in FORMATS:
        raise FormatError(f"unknown quantization format {fmt!r}; known: {', '.join(FORMATS)}")
    if isinstance(x, QuantizedTensor):
        x = x.dequantize(x.dtype)
    spec = FORMATS[fmt]
    amax = opts.pop("amax", None)
    parsed = spec.parse_opts(opts)
    with torch.no_grad():
        x = x.detach()
        fields = spec.quantize(x, parsed, amax)
    return QuantizedTensor(fields, fmt, parsed, tuple(x.shape), x.dtype)


def empty(
    shape: tuple[int, ...] | torch.Size,
    fmt: str,
    *,
    nominal_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    **opts: Any,
) -> QuantizedTensor:
    """A fresh ``fmt`` tensor of nominal ``shape``/``nominal_dtype`` on ``device``, nothing
    quantized (``opts`` are the format's, its ``dtype`` among them).

    Its fields hold what quantizing zeros gives (zero codes, all-zero scales; a fresh
    ``fp8_delayed`` history, which its first ``quantize_`` starts). On ``device="meta"`` it is
    shapes only: a model's quantized parameters are made so, then allocated by
    ``Module.to_empty`` (``empty_like``) and filled by a checkpoint, without a high-precision
    copy ever existing. Raises ``FormatError`` for an unknown format or option.
    """
    if fmt not in FORMATS:
        raise FormatError(f"unknown quantization format {fmt!r}; known: {', '.join(FORMATS)}")
    if not nominal_dtype.is_floating_point or nominal_dtype.itemsize == 1:
        raise FormatError(
            f"{fmt}: the nominal dtype must be a high-precision float, got {nominal_dtype}"
        )
    spec = FORMATS[fmt]
    opts.pop("amax", None)
    parsed = spec.parse_opts(opts)
    shape = tuple(int(s) for s in shape)
    fields = spec.empty_fields(shape, parsed, device)
    return QuantizedTensor(fields, fmt, parsed, shape, nominal_dtype)


def dequantize(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.dequantize(dtype)`` for a QuantizedTensor; a plain tensor is returned (cast) as is."""
    if isinstance(t, QuantizedTensor):
        return t.dequantize(dtype or t.dtype)
    return t if dtype is None else t.to(dtype)


torch.serialization.add_safe_globals([QuantizedTensor])
