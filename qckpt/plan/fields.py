"""The bytes a quantized parameter holds, from its format's own shape rules (no tensor made).

Each format lays out its fields (``qdata`` and its scales) from the nominal shape; the rules
live in the format modules (``Fp8BlockFormat.scale_shape``, ``NvFp4Format._shapes``, ...), and
this module asks them, so a change of a layout changes the plan with it. A unit test checks
every format against a real ``quantize`` of small tensors (edge blocks included).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def field_specs(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> FieldSpec:
    """``{field: (shape, dtype)}`` of a ``fmt`` QuantizedTensor of nominal ``shape``."""
    from qckpt.formats import FORMATS
    from qckpt.formats import fp8 as fp8_mod
    from qckpt.formats._rowblock import last_dim, nblocks
    from qckpt.formats.mxfp8 import BLOCK as MX_BLOCK

    spec = FORMATS[fmt]
    o = spec.parse_opts(dict(opts or {}))
    shape = tuple(int(s) for s in shape)
    f32 = torch.float32
    if fmt == "fp8":
        channel = o["granularity"] == "channel"
        return {
            "qdata": (shape, o["dtype"]),
            "scale": (fp8_mod._channel_scale_shape(shape) if channel else (), f32),
        }
    if fmt == "fp8_delayed":
        return {
            "qdata": (shape, o["dtype"]),
            "scale": ((), f32),
            "amax_history": ((o["history_len"],), f32),
            "quant_scale": ((), f32),
        }
    if fmt == "mxfp8":
        sshape = shape[:-1] + (nblocks(last_dim(shape), MX_BLOCK),) if shape else (1,)
        return {"qdata": (shape, o["dtype"]), "scale": (sshape, torch.uint8)}
    if fmt == "fp8_block":
        return {
            "qdata": (shape, o["dtype"]),
            "scale": (type(spec).scale_shape(shape, tuple(o["block_size"])), f32),
        }
    if fmt == "nvfp4":
        qshape, sshape = type(spec)._shapes(shape)
        return {
            "qdata": (qshape, torch.uint8),
            "scale": (sshape, torch.float8_e4m3fn),
            "global_scale": ((), f32),
        }
    raise ValueError(f"no field rule for format {fmt!r}")


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
