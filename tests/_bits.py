"""Exact comparison of quantized fields, shared by the GPU format tests."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit patterns to compare (1-byte fields as uint8, 4-byte ones as int32: -0.0 != 0.0,
    NaN == NaN); other sizes as they are."""
    t = t.contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8)
    if t.element_size() == 4:
        return t.view(torch.int32)
    return t
