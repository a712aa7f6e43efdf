"""The bytes of each native format's fields and its scale blocks, without torch (``qckpt plan``).

A twin of each format's ``field_specs`` and ``scale_block`` (``fp8.py``, ``fp8_block.py``,
``mxfp8.py``, ``nvfp4.py``): shapes and item sizes from the nominal shape and the options, so a
plan sizes quantized parameters without importing torch. ``tests/unit/test_format_sizes.py``
holds every format's twin equal to its own ``field_specs`` and ``scale_block`` over edge shapes
and options: a layout changed on one side and not the other fails there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qckpt.errors import FormatError

# an FP8 code, an E8M0 / E4M3 scale, two packed E2M1 codes: one byte; a float32 scale: four
_CODE, _F32 = 1, 4
MX_BLOCK = 32  # mxfp8's block along the last dim (OCP MX v1.0)
NVFP4_BLOCK = 16

Fields = dict[str, tuple[tuple[int, ...], int]]  # field -> (shape, itemsize)


def _nblocks(k: int, block: int) -> int:
    return -(-k // block)


def _last(shape: tuple[int, ...]) -> int:
    return shape[-1] if shape else 1


def _block_size(opts: dict[str, Any]) -> tuple[int, int]:
    bs = opts.get("block_size", 128)
    return (int(bs), int(bs)) if isinstance(bs, int) else (int(bs[0]), int(bs[-1]))


def _fp8(shape: tuple[int, ...], opts: dict[str, Any]) -> Fields:
    channel = opts.get("granularity", "tensor") == "channel"
    scale = ((shape[0],) + (1,) * (len(shape) - 1)) if channel and shape else ()
    return {"qdata": (shape, _CODE), "scale": (scale, _F32)}


def _fp8_delayed(shape: tuple[int, ...], opts: dict[str, Any]) -> Fields:
    history = (int(opts.get("history_len", 16)),)
    return {
        "qdata": (shape, _CODE), "scale": ((), _F32), "amax_history": (history, _F32),
        "quant_scale": ((), _F32),
    }  # fmt: skip


def _fp8_block(shape: tuple[int, ...], opts: dict[str, Any]) -> Fields:
    br, bc = _block_size(opts)
    if not shape:
        scale: tuple[int, ...] = ()
    elif len(shape) == 1:
        scale = (_nblocks(shape[0], bc),)
    else:
        scale = tuple(shape[:-2]) + (_nblocks(shape[-2], br), _nblocks(shape[-1], bc))
    return {"qdata": (shape, _CODE), "scale": (scale, _F32)}


def _mxfp8(shape: tuple[int, ...], opts: dict[str, Any]) -> Fields:
    scale = shape[:-1] + (_nblocks(_last(shape), MX_BLOCK),) if shape else (1,)
    return {"qdata": (shape, _CODE), "scale": (scale, _CODE)}


def _nvfp4(shape: tuple[int, ...], opts: dict[str, Any]) -> Fields:
    k = _last(shape)
    lead = shape[:-1] if shape else ()
    return {
        "qdata": (lead + (-(-k // 2),), _CODE),
        "scale": (lead + (_nblocks(k, NVFP4_BLOCK),), _CODE),
        "global_scale": ((), _F32),
    }


def _no_block(opts: dict[str, Any], dim: int, ndim: int) -> int:
    return 1


def _fp8_block_along(opts: dict[str, Any], dim: int, ndim: int) -> int:
    bs = _block_size(opts)
    if ndim == 1:
        return bs[-1]
    if ndim >= 2 and dim >= ndim - 2:
        return bs[dim - (ndim - 2)]
    return 1


def _last_dim_block(block: int) -> Callable[[dict[str, Any], int, int], int]:
    return lambda opts, dim, ndim: block if dim == ndim - 1 else 1


_FIELDS: dict[str, Callable[[tuple[int, ...], dict[str, Any]], Fields]] = {
    "fp8": _fp8, "fp8_delayed": _fp8_delayed, "fp8_block": _fp8_block, "mxfp8": _mxfp8,
    "nvfp4": _nvfp4,
}  # fmt: skip
_BLOCKS: dict[str, Callable[[dict[str, Any], int, int], int]] = {
    "fp8": _no_block, "fp8_delayed": _no_block, "fp8_block": _fp8_block_along,
    "mxfp8": _last_dim_block(MX_BLOCK), "nvfp4": _last_dim_block(NVFP4_BLOCK),
}  # fmt: skip


def _known(fmt: str) -> None:
    if fmt not in _FIELDS:
        raise FormatError(f"unknown quantization format {fmt!r}; known: {', '.join(_FIELDS)}")


def field_shapes(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> Fields:
    """``{field: (shape, itemsize)}`` of a ``fmt`` tensor of nominal ``shape``."""
    _known(fmt)
    return _FIELDS[fmt](tuple(int(s) for s in shape), dict(opts or {}))


def quantized_nbytes(fmt: str, shape: tuple[int, ...], opts: dict[str, Any] | None = None) -> int:
    """Bytes a ``fmt`` tensor of nominal ``shape`` holds (``QuantizedTensor.quantized_nbytes``)."""
    return sum(math.prod(s) * size for s, size in field_shapes(fmt, shape, opts).values())


def scale_block(fmt: str, opts: dict[str, Any] | None, dim: int, ndim: int) -> int:
    """The length of the blocks ``dim`` (of ``ndim``) is cut into, one scale each (1: none)."""
    _known(fmt)
    return _BLOCKS[fmt](dict(opts or {}), dim, ndim)
