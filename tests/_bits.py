"""Exact comparison of tensors and quantized fields, shared by the format, load and GPU tests."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit patterns to compare, as integers of the element's size (-0.0 != 0.0,
    NaN == NaN); the shape is kept, so ``torch.equal`` still compares shapes."""
    t = t.detach().contiguous()
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )
