"""compressed-tensors' writers: which :class:`~qckpt.layouts.export_layout.ExportLayout` writes a
weight scheme (:data:`WRITERS`, the one table a new scheme's writer is added to), and the mixed
layout of a ``quant.schemes`` recipe (one ``config_groups`` entry per scheme)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from qckpt.errors import SchemeError
from qckpt.formats.scheme import (
    Fp8Scheme,
    Int4Scheme,
    Int8Scheme,
    Mxfp4Scheme,
    Mxfp8Scheme,
    Nvfp4Scheme,
    scheme_of,
)
from qckpt.layouts.compressed_tensors import (
    CT_MIXED_FORMAT,
    CompressedTensorsInt4Layout,
    CompressedTensorsLayout,
    CompressedTensorsNvfp4Layout,
)
from qckpt.layouts.ct_int8 import int8_layout
from qckpt.layouts.ct_mx import CompressedTensorsMxfp4Layout, CompressedTensorsMxfp8Layout
from qckpt.layouts.export_layout import EXPERT, BlockScales, ExportLayout
from qckpt.layouts.mixed import MixedLayout, build_parts
from qckpt.recipe import QuantConfig

# the family's writer per weight scheme (its class: the scheme is asked, never named)
WRITERS: dict[type, Callable[..., ExportLayout]] = {
    Fp8Scheme: CompressedTensorsLayout,
    Nvfp4Scheme: CompressedTensorsNvfp4Layout,
    Int4Scheme: CompressedTensorsInt4Layout,
    Int8Scheme: int8_layout,
    Mxfp4Scheme: CompressedTensorsMxfp4Layout,
    Mxfp8Scheme: CompressedTensorsMxfp8Layout,
}


def export_layout(
    quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
) -> ExportLayout:
    """The compressed-tensors layout of ``quant``, by its weights' scheme (:data:`WRITERS`)."""
    ws = scheme_of(quant.weights, "weight")
    cls = WRITERS.get(type(ws))
    if cls is None:
        raise SchemeError(
            f"export.format compressed-tensors writes no {ws.describe()} weights "
            "(unquantized linears: leave them out of quant.schemes' targets, or in quant.ignore)"
            if not ws.quantized
            else f"export.format compressed-tensors writes no {ws.describe()} weights"
        )
    return cls(quant, model_dtype, block_scales)


def ct_targets(modules: list[str]) -> list[str]:
    """A group's ``targets`` for the linears it quantizes, as vLLM resolves them: the module
    names (vLLM matches a fused ``qkv_proj`` / ``gate_up_proj`` when every part's name is a
    target), and one anchored ``re:`` pattern per MoE experts module (vLLM looks its
    ``FusedMoE`` up by expert 0's names; the experts of one module always share a scheme)."""
    out: list[str] = []
    seen: set[str] = set()
    for m in modules:
        hit = EXPERT.match(m)
        t = f"re:^{re.escape(hit['experts'])}\\.\\d+\\.[^.]+$" if hit else m
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


class CompressedTensorsMixedLayout(MixedLayout):
    """compressed-tensors with several schemes: one ``config_groups`` entry per scheme in use
    (``group_0``, ``group_1``, ... in recipe order), each with its own ``format``; the top-level
    ``format`` is the groups' one format, or ``mixed-precision`` when they differ."""

    def _groups(self) -> dict[str, dict]:
        return {
            f"group_{n}": part.config_group(ct_targets(mods))  # type: ignore[attr-defined]
            for n, (_, part, mods) in enumerate(self.members())
        }

    def quant_format(self) -> str:
        fmts = list(dict.fromkeys(g["format"] for g in self._groups().values()))
        return fmts[0] if len(fmts) == 1 else CT_MIXED_FORMAT

    def quantization_config(self, ignored: list[str]) -> dict:
        return self.first.config_with(self._groups(), self.quant_format(), ignored)  # type: ignore[attr-defined]


def mixed_layout(
    quant: QuantConfig,
    model_dtype: torch.dtype,
    block_scales: BlockScales | None,
    assignment: dict[str, int | None],
) -> ExportLayout:
    """The compressed-tensors layout of a ``quant.schemes`` recipe (``assignment``: each linear's
    entry index, None for the model dtype)."""
    parts = build_parts(quant, export_layout, model_dtype, block_scales, assignment)
    return CompressedTensorsMixedLayout(quant, model_dtype, parts, assignment)
