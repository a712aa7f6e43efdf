"""compressed-tensors ``int-quantized`` INT8 W8A8 (llm-compressor's ``W8A8`` int scheme, what
Ampere runs fast): per linear ``weight`` int8 ``[out, in]`` (codes -128..127) and
``weight_scale`` in the model dtype, ``[out, 1]`` per channel or ``[1]`` per tensor; the
inputs per token at run time (``strategy: token, dynamic: true``: no stored scale) or static
per tensor (``input_scale`` ``[1]``, amax / 127.5 in the model dtype). Symmetric: no zero
points. Codes are made under the scales as stored, as for FP8 and INT4.

INT8 weights with ``inputs: none`` (W8A16) are ``pack-quantized`` 8-bit, four codes an int32
word: the INT4 layout with the scheme's 8 bits (:class:`CompressedTensorsInt4Layout`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qckpt.errors import SchemeError
from qckpt.formats.intq import int_codes, int_scale
from qckpt.formats.scheme import scheme_of
from qckpt.layouts.compressed_tensors import CompressedTensorsInt4Layout, CompressedTensorsLayout
from qckpt.layouts.export_layout import BlockScales, ExportLayout, OutSpec, amax_scalar
from qckpt.layouts.names import CT_INT_FORMAT, INPUT_SCALE, WEIGHT_SCALE
from qckpt.recipe import QuantConfig


class CompressedTensorsInt8Layout(CompressedTensorsLayout):
    """compressed-tensors ``int-quantized`` (see the module doc): the FP8 layout's config args
    with integer codes."""

    code_type, ct_format = "int", CT_INT_FORMAT

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        ExportLayout.__init__(self, quant, model_dtype, block_scales)
        self.ws = scheme_of(quant.weights, "weight")
        self.ins = scheme_of(quant.inputs, "input")
        if not self.ins.integer:
            raise SchemeError(
                "export.format compressed-tensors writes int8 weights with int8 inputs (W8A8) "
                f"or none (W8A16); got inputs {quant.inputs.format}"
            )

    def _scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], 1) if self.ws.granularity == "channel" else (1,)

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        specs = [
            OutSpec(f"{module}.weight", torch.int8, shape),
            OutSpec(f"{module}.{WEIGHT_SCALE}", self.model_dtype, self._scale_shape(shape)),
        ]
        if not self.ins.dynamic:
            specs.append(OutSpec(f"{module}.{INPUT_SCALE}", self.model_dtype, (1,)))
        return specs

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        shape = self._scale_shape(tuple(w.shape))
        wa = amax[f"{module}.weight_amax"].reshape(shape)
        scale = int_scale(wa, self.ws.qmax, self.model_dtype)
        yield f"{module}.weight", int_codes(w, scale, self.ws.code_range, 0)
        yield f"{module}.{WEIGHT_SCALE}", scale
        if not self.ins.dynamic:
            ia = amax_scalar(amax[f"{module}.input_amax"])
            yield (
                f"{module}.{INPUT_SCALE}",
                int_scale(ia, self.ins.qmax, self.model_dtype).reshape(1),
            )

    def stacks(self) -> bool:
        return False


def int8_layout(
    quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
) -> ExportLayout:
    """INT8 weights' layout: ``int-quantized`` with int8 inputs, ``pack-quantized`` without."""
    if not scheme_of(quant.inputs, "input").quantized:
        if quant.weights.granularity != "channel":
            raise SchemeError(
                "export.format compressed-tensors writes int8 weight-only (W8A16) per channel; "
                f"got granularity {quant.weights.granularity}"
            )
        return CompressedTensorsInt4Layout(quant, model_dtype, block_scales)
    return CompressedTensorsInt8Layout(quant, model_dtype, block_scales)
