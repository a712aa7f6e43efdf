"""The bytes a quantized parameter holds, from its format's own layout (nothing allocated).

Each format lays out its fields (``qdata`` and its scales) from the nominal shape;
``formats.empty(..., device="meta")`` builds that layout as shapes only, the way a meta build
makes a model's quantized parameters, so a change of a layout changes the plan with it. A unit
test checks every format against a real ``quantize`` of small tensors (edge blocks included).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def field_specs(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> FieldSpec:
    """``{field: (shape, dtype)}`` of a ``fmt`` QuantizedTensor of nominal ``shape``: the
    format's own empty constructor on the meta device (shapes only, nothing allocated)."""
    from qckpt.formats import empty

    q = empty(tuple(int(s) for s in shape), fmt, device="meta", **dict(opts or {}))
    return {k: (tuple(v.shape), v.dtype) for k, v in q.fields().items()}


def quantized_nbytes(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> int:
    """Bytes a ``fmt`` parameter of nominal ``shape`` holds (codes, scales, state), as
    ``QuantizedTensor.quantized_nbytes()`` counts them."""
    key = tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (opts or {}).items())
    )
    return _nbytes(fmt, tuple(int(s) for s in shape), key)


@functools.lru_cache(maxsize=4096)  # a model repeats a few shapes many times
def _nbytes(fmt: str, shape: tuple[int, ...], opts: tuple[tuple[str, Any], ...]) -> int:
    specs = field_specs(fmt, shape, dict(opts))
    return sum(math.prod(s) * dtype.itemsize for s, dtype in specs.values())


def plain_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * dtype.itemsize
