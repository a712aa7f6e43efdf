"""The bytes an export writes for a linear under each candidate scheme, asked of the export
layout itself (``ExportLayout.linear_specs``: codes at their stored dtype and packing, block
and per-tensor scales, global scales, static input scales, INT4's shape tensor), so the
search counts what ``qckpt export`` of the found recipe then writes. A candidate whose weights
are ``none`` writes the weight in the model dtype. A candidate the layout cannot write for a
linear (NVFP4 on an input dim not a multiple of 16, a group that does not divide it) has no
size there: the search does not offer it to that linear's unit.
"""

from __future__ import annotations

import math

import torch

from qckpt.errors import ExportError, FormatError, SchemeError
from qckpt.formats.scheme import scheme_of
from qckpt.layouts.registry import make_layout
from qckpt.recipe import QuantConfig


def candidate_quant(candidate) -> QuantConfig:  # noqa: ANN001 - a recipe CandidateConfig
    """The one-scheme QuantConfig of a candidate (no ignore: the search matched already)."""
    return QuantConfig(weights=candidate.weights, inputs=candidate.inputs, ignore=[])


def linear_bytes(
    export_format: str,
    candidates: list,
    shapes: dict[str, tuple[int, int]],
    model_dtype: torch.dtype,
) -> dict[str, list[int | None]]:
    """module -> bytes per candidate (None: not writable there); a candidate no layout of
    ``export_format`` writes at all is a one-line SchemeError naming it."""
    layouts = []
    for i, c in enumerate(candidates):
        if not scheme_of(c.weights, "weight").quantized:
            layouts.append(None)
            continue
        try:
            layouts.append(make_layout(export_format, candidate_quant(c), model_dtype))
        except (ExportError, SchemeError, FormatError) as exc:
            raise SchemeError(f"search.candidates[{i}]: {exc}") from None
    out: dict[str, list[int | None]] = {}
    for name, shape in shapes.items():
        row: list[int | None] = []
        for layout in layouts:
            if layout is None:
                row.append(math.prod(shape) * model_dtype.itemsize)
                continue
            try:
                specs = layout.linear_specs(name, tuple(shape))
            except (ExportError, SchemeError):
                row.append(None)
                continue
            row.append(sum(s.nbytes for s in specs))
        out[name] = row
    return out
