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

from typing import TYPE_CHECKING, Any

from qckpt.errors import FormatError

if TYPE_CHECKING:
    from qckpt.formats._base import FORMATS, Format
    from qckpt.formats.functions import dequantize, empty, quantize
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


def __getattr__(name: str) -> Any:
    """The package's names, looked up on first use (PEP 562): importing one of its torch-free
    modules (``qckpt.formats.scheme``: ``qckpt plan``, ``qckpt check``) imports no torch. The
    first lookup registers every format (``functions`` imports them)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from qckpt import kernel_policy as _policy
    from qckpt.formats import _base, functions, numerics, tensor

    for mod in (functions, _base, tensor, numerics, _policy):
        if hasattr(mod, name):
            value = getattr(mod, name)
            globals()[name] = value  # found once: later lookups are plain attributes
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
