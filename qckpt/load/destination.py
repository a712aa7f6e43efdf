"""A load's destinations: quantized ones behind one protocol, and the checkpoint's extra axes.

``destination_of`` gives the quantized-destination protocol object of a tensor (nominal
shape/dtype/device, ``fmt``, ``quantize_``, ``quant_state`` / ``load_quant_state``,
``dequantize``): native ``QuantizedTensor`` s as they are, Transformer Engine ones through
``qckpt.formats.te``. ``prepended_axes`` / ``unwrap_prepended``: checkpoints whose tensors carry
extra leading singleton axes are planned against the checkpoint's shape and unwrapped after.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from qckpt.errors import CheckpointError


def destination_of(t: Any) -> Any:
    """The quantized-destination protocol object for ``t`` (nominal shape/dtype/device, ``fmt``,
    ``quantize_``, ``quant_state``/``load_quant_state``, ``dequantize``), or None for a plain
    tensor: native QuantizedTensors as they are, Transformer Engine ones through the adapter."""
    from qckpt.formats import is_quantized

    if is_quantized(t):
        return t
    # a TE tensor exists only once transformer_engine has been imported: asking sys.modules
    # costs nothing per call and needs no cached flag
    if "transformer_engine" in sys.modules:
        from qckpt.formats import te

        if te.is_te_quantized(t):
            return te.TEDestination(t)
    return None


def prepended_axes(ckpt_shape: Any, dest_shape: Any, name: str = "tensor") -> int:
    """How many leading axes the checkpoint shape has in front of the destination's shape.

    0 when the shapes are equal or do not end alike (the caller reports a mismatch). When the
    checkpoint shape is ``extra + dest_shape``, EVERY extra axis must be 1 (checked one by one,
    not axis 0 again and again); otherwise a one-line CheckpointError names the axis.
    """
    ckpt, dest = tuple(int(s) for s in ckpt_shape), tuple(int(s) for s in dest_shape)
    k = len(ckpt) - len(dest)
    if k <= 0 or ckpt[k:] != dest:
        return 0
    for i in range(k):
        if ckpt[i] != 1:
            raise CheckpointError(
                f"{name}: checkpoint shape {ckpt} has a non-singleton prepended axis {i} "
                f"(size {ckpt[i]}) in front of the model's shape {dest}"
            )
    return k


def unwrap_prepended(t: torch.Tensor, k: int, name: str = "tensor") -> torch.Tensor:
    """Drop ``k`` prepended singleton axes with ``view`` (never ``t[0]``, which would dequantize
    a whole MXFP8 tensor), checking ``size(i) == 1`` for every prepended axis ``i``."""
    if k == 0:
        return t
    if k > t.dim():
        raise CheckpointError(f"{name}: cannot drop {k} prepended axes from shape {tuple(t.shape)}")
    for i in range(k):
        if t.size(i) != 1:
            raise CheckpointError(
                f"{name}: prepended axis {i} has size {t.size(i)}, not 1 "
                f"(shape {tuple(t.shape)}); refusing to drop it"
            )
    return t.view(t.shape[k:])
