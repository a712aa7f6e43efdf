"""The bytes a tensor holds, nothing allocated and no torch imported.

A quantized parameter: its format's fields (``qdata`` and its scales) laid out from the
nominal shape by ``qckpt.formats.sizes``, the torch-free twin of each format's own
``field_specs`` (``tests/unit/test_format_sizes.py`` holds the two equal, and
``tests/unit/test_plan.py`` both against a real ``quantize`` of small tensors, edge blocks
included). :func:`field_specs` is the format's own layout on the meta device, the reference.
"""

from __future__ import annotations

import math
from typing import Any

from qckpt.formats.sizes import quantized_nbytes as _format_nbytes


def field_specs(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> dict:
    """``{field: (shape, torch dtype)}`` of a ``fmt`` QuantizedTensor of nominal ``shape``: the
    format's own empty constructor on the meta device (imports torch; the tests' reference)."""
    from qckpt.formats import empty

    q = empty(tuple(int(s) for s in shape), fmt, device="meta", **dict(opts or {}))
    return {k: (tuple(v.shape), v.dtype) for k, v in q.fields().items()}


def quantized_nbytes(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> int:
    """Bytes a ``fmt`` parameter of nominal ``shape`` holds (codes, scales, state), as
    ``QuantizedTensor.quantized_nbytes()`` counts them."""
    return _format_nbytes(fmt, tuple(int(s) for s in shape), opts)


def plain_nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of a plain tensor; ``dtype`` is a torch dtype or a :class:`qckpt.plan.spec.DType`
    (anything with an ``itemsize``)."""
    return math.prod(int(s) for s in shape) * dtype.itemsize
