"""compressed-tensors' MX formats. ``mxfp4-pack-quantized`` MXFP4 weights (llm-compressor's ``MXFP4A16``):
per linear ``weight_packed`` uint8 ``[out, in / 2]`` (E2M1 codes, the even column in the low
nibble) and ``weight_scale`` uint8 ``[out, in / 32]`` (E8M0 exponents, biased by 127), no
global scale, made by :mod:`qckpt.formats.mx_codes`; weight-only (vLLM runs it with Marlin on
Hopper, and natively on MI35x / Blackwell). GPTQ's per-group exponents, when the calibration
made them, are written as given; an mse calibration's are searched again from the weight
(:func:`qckpt.formats.mx_search.mx_mse_quantize`, the calibration's own search).

``mxfp8-quantized`` MXFP8 (llm-compressor's ``MXFP8``): ``weight`` float8_e4m3fn ``[out, in]``
and ``weight_scale`` uint8 ``[out, in / 32]``; inputs MXFP8 per 32 at run time (W8A8, what
Blackwell runs; Hopper runs it weight-only) or none (MXFP8A16)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qckpt.errors import ExportError, SchemeError
from qckpt.formats.mx_codes import (
    E8M0_BIAS,
    MX_GROUP,
    mx_quantize,
    mx_scale_values,
)
from qckpt.formats.mx_search import mx_mse_quantize
from qckpt.formats.scheme import scheme_of
from qckpt.layouts.compressed_tensors import CompressedTensorsLayout
from qckpt.layouts.export_layout import BlockScales, ExportLayout, OutSpec
from qckpt.layouts.names import CT_MXFP4_FORMAT, CT_MXFP8_FORMAT, CT_PACKED, WEIGHT_SCALE
from qckpt.recipe import QuantConfig


class CompressedTensorsMxfp4Layout(CompressedTensorsLayout):
    """compressed-tensors ``mxfp4-pack-quantized`` (see the module doc)."""

    # the codes' leaf and their bytes per logical column (two E2M1 codes a byte)
    codes_leaf, codes_dtype, per_byte, fmt = CT_PACKED, torch.uint8, 2, CT_MXFP4_FORMAT

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        ExportLayout.__init__(self, quant, model_dtype, block_scales)
        self._given: dict[str, torch.Tensor] = {}
        self.ws = scheme_of(quant.weights, "weight")
        self.ins = scheme_of(quant.inputs, "input")
        self._check_inputs()

    def _check_inputs(self) -> None:
        if self.ins.quantized:
            raise SchemeError(
                "export.format compressed-tensors writes mxfp4 weights weight-only (MXFP4A16); "
                f"got inputs {self.quant.inputs.format}: give quant.inputs {{format: none}}"
            )

    def _read_given(self, module: str) -> torch.Tensor | None:
        bs = self.block_scales
        return None if bs.given is None else bs.given(module)

    def guard_amax(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        # GPTQ made each group's exponent from the group as it reached it: its values stay
        # within the largest code x those scales, which may pass the source's amax
        given = self._read_given(module)
        if given is None:
            return amax
        self._given[module] = given
        return (mx_scale_values(given) * self.ws.qmax).max()

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        if shape[1] % MX_GROUP:
            raise SchemeError(
                f"{module}: {self.ws.name} needs the input dim divisible by {MX_GROUP}, got "
                f"{shape[1]}"
            )
        return [
            OutSpec(
                f"{module}.{self.codes_leaf}",
                self.codes_dtype,
                (shape[0], shape[1] // self.per_byte),
            ),
            OutSpec(f"{module}.{WEIGHT_SCALE}", torch.uint8, (shape[0], shape[1] // MX_GROUP)),
        ]

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        given = self._given.pop(module, None)
        if given is None:
            given = self._read_given(module)
        e = None
        if given is not None:
            want = (w.shape[0], w.shape[1] // MX_GROUP)
            if tuple(given.shape) != want:
                raise ExportError(f"{module}: GPTQ MX scales {list(given.shape)}, not {want}")
            e = given.to(device=w.device, dtype=torch.int32) - E8M0_BIAS
        if e is None and self.block_scales.search:  # an mse calibration: searched exponents
            h = self.block_scales.weights_of(module, w.shape[1])
            codes, scale, *_ = mx_mse_quantize(w, self.ws.code_bits, h)
        else:
            codes, scale = mx_quantize(w, self.ws.code_bits, e)
        yield f"{module}.{self.codes_leaf}", codes
        yield f"{module}.{WEIGHT_SCALE}", scale

    def _weight_args(self) -> dict:
        return {
            "num_bits": self.ws.code_bits,
            "type": "float",
            "symmetric": True,
            "group_size": MX_GROUP,
            "strategy": "group",
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }

    def stacks(self) -> bool:
        return False

    def config_group(self, targets: list[str]) -> dict:
        inputs = None
        if self.ins.quantized:
            inputs = {**self._weight_args(), "dynamic": True}
        return {
            "targets": targets,
            "weights": self._weight_args(),
            "input_activations": inputs,
            "output_activations": None,
            "format": self.fmt,
        }

    def shard_metadata(self) -> dict[str, str]:
        return {**super().shard_metadata(), "quant_format": self.fmt}


class CompressedTensorsMxfp8Layout(CompressedTensorsMxfp4Layout):
    """compressed-tensors ``mxfp8-quantized`` (see the module doc)."""

    codes_leaf, codes_dtype, per_byte, fmt = "weight", torch.float8_e4m3fn, 1, CT_MXFP8_FORMAT

    def _check_inputs(self) -> None:
        if self.ins.quantized and not (self.ins.mx and self.ins.code_bits == 8):
            raise SchemeError(
                "export.format compressed-tensors writes mxfp8 weights with mxfp8 inputs or "
                f"none; got inputs {self.quant.inputs.format}"
            )
