"""Quantization formats: ``quantize(x, fmt, **opts) -> QuantizedTensor``.

Formats (``FORMATS``): ``fp8``, ``fp8_delayed`` (see ``qckpt.formats.fp8``), ``mxfp8``,
``fp8_block``, ``nvfp4`` (each documented in its module). Every format stores ``qdata`` (codes)
and ``scale`` (the dequantization multiplier), ``nvfp4`` also ``global_scale`` and
``fp8_delayed`` also ``amax_history``.
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
from qckpt.formats._common import UnsupportedOpError, set_compile
from qckpt.formats.tensor import QuantizedTensor, implements, is_quantized

__all__ = [
    "FORMATS",
    "Format",
    "FormatError",
    "QuantizedTensor",
    "UnsupportedOpError",
    "dequantize",
    "implements",
    "is_quantized",
    "quantize",
    "set_compile",
]


def quantize(x: torch.Tensor, fmt: str, **opts: Any) -> QuantizedTensor:
    """Quantize high-precision ``x`` to format ``fmt``.

    ``amax=`` (a float or tensor) replaces the computed amax (calibration / export); the other
    options are the format's (see its module). The result's nominal dtype is ``x.dtype``.
    Raises ``FormatError`` for NaN/Inf input, an unknown format or option.
    """
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


def dequantize(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.dequantize(dtype)`` for a QuantizedTensor; a plain tensor is returned (cast) as is."""
    if isinstance(t, QuantizedTensor):
        return t.dequantize(dtype or t.dtype)
    return t if dtype is None else t.to(dtype)


torch.serialization.add_safe_globals([QuantizedTensor])
