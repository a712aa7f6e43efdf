"""The package's own functions: ``quantize``, ``empty``, ``dequantize`` (see the package doc).

Importing this module registers every format (their modules are imported here, in the order
``FORMATS`` lists them) and needs torch; ``qckpt.formats`` itself imports it on first use of
one of its names, so its torch-free modules (``scheme``, ``shapes``, ``sizes``) import alone.
"""

from __future__ import annotations

from typing import Any

import torch

from qckpt.errors import FormatError
from qckpt.formats import fp8 as _fp8  # noqa: F401  (registers fp8, fp8_delayed)
from qckpt.formats import fp8_block as _fp8_block  # noqa: F401
from qckpt.formats import mxfp8 as _mxfp8  # noqa: F401
from qckpt.formats import nvfp4 as _nvfp4  # noqa: F401
from qckpt.formats._base import FORMATS
from qckpt.formats.tensor import QuantizedTensor
from qckpt.kernel_policy import KernelPolicy, kernel_policy


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
