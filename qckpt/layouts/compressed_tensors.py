"""compressed-tensors (``quant_method: compressed-tensors``): both directions.

Written (``export.format: compressed-tensors``), FP8 (``format: float-quantized``):

* weights ``tensor`` -> ``weight_scale`` ``(1,)``; ``channel`` -> ``(out, 1)``; ``block`` ->
  ``(ceil(out/b0), ceil(in/b1))`` (the last block of a dim that b does not divide is padded, as
  compressed-tensors pads it: its scale covers the rows/columns that exist).
* inputs: static ``tensor`` -> ``input_scale`` ``(1,)``; the recipe's ``dynamic: true`` with
  ``granularity: tensor`` is written as per-token dynamic (``strategy: token``, what vLLM runs for
  FP8 dynamic), with ``granularity: block`` as per-group dynamic (``strategy: group``,
  ``group_size`` = the last block dim). No scale is stored for dynamic inputs.
* scales are stored in the model dtype, because that is the dtype the clients' scale parameters
  have (compressed-tensors creates them in the weight's dtype). The weight is quantized with the
  *rounded* scale, so dequantizing with what is stored gives back what we meant
  (:func:`~qckpt.layouts.export_layout.fp8_quantize`).

NVFP4 (``format: nvfp4-pack-quantized``, what llm-compressor writes for its ``NVFP4`` scheme;
weights and static inputs nvfp4): ``weight_packed`` uint8 ``[out, in/2]`` and ``weight_scale``
float8_e4m3fn ``[out, in/16]`` are ModelOpt's ``weight`` / ``weight_scale`` byte for byte
(compressed-tensors packs the even column in the low nibble too), quantized by
:mod:`qckpt.formats`; the global scales are the *reciprocals* of ModelOpt's, because
compressed-tensors divides by them (value = e2m1 * scale / global_scale):
``weight_global_scale`` float32 ``(1,)`` = ``1 / weight_scale_2`` (~ ``6 * 448 / amax``) and
``input_global_scale`` float32 ``(1,)`` = ``1 / input_scale``. Each reciprocal is correctly
rounded (in float64, then to float32), so ``scale / global_scale`` is within an ulp of
ModelOpt's ``weight_scale_2 * scale`` for the same codes. The inputs are ``dynamic: local`` in
the config (a static global scale, per-16 scales at run time), as in compressed-tensors' preset.

KV-cache scales (``quant.kv_cache: true``): ``{attn}.k_scale`` / ``v_scale`` (shape ``(1,)``) =
amax / 448 from the calibration file's ``{attn}.k_proj.output_amax`` / ``v_proj.output_amax``.

Read (a source dir): ``float-quantized`` FP8 weights per tensor, channel or block
(``code * scale``) and ``nvfp4-pack-quantized`` (``e2m1 * (scale / global_scale)``); a group
stored ``dense`` reads as plain; anything else is refused with one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from qckpt.errors import CheckpointError, ExportError, SchemeError
from qckpt.formats.scheme import (
    FP4_MAX,
    FP8_MAX,
    NVFP4_GROUP,
    Fp8Scheme,
    scheme_of,
)
from qckpt.formats.shapes import weight_block
from qckpt.layouts.export_layout import (
    EXPERT,
    MIN_AMAX,
    BlockScales,
    ExportLayout,
    OutSpec,
    amax_over,
    amax_scalar,
    fp8_quantize,
    fp8_quantize_stack,
    stack_f32,
)
from qckpt.layouts.names import (
    CT_INPUT_GLOBAL,
    CT_INT_FORMAT,
    CT_INT_PACKED_FORMAT,
    CT_MXFP4_FORMAT,
    CT_MXFP8_FORMAT,
    CT_NVFP4_FORMAT,
    CT_PACKED,
    CT_WEIGHT_GLOBAL,
    CT_WEIGHT_SHAPE,
    CT_ZERO_POINT,
    WEIGHT_SCALE,
    ct_nvfp4_args,
)
from qckpt.layouts.source_layout import (
    FP8,
    QuantWeight,
    SourceLayout,
    fp8_weights,
    int8_weights,
    int_packed_weights,
    mx_weights,
    nvfp4_weights,
)
from qckpt.recipe import QuantConfig
from qckpt.storage.slices import Index


def _weight_options(qc: dict[str, Any]) -> tuple[list[tuple[str, Any]], tuple, list, list[str]]:
    """(fp8 weight schemes, (any nvfp4 / mxfp4 / mxfp8 group), the packed integer groups as
    (bits, group size: 0 per channel), the int8 weight strategies) of a compressed-tensors
    config; refuses the rest."""
    top = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config: compressed-tensors without config_groups")
    fp8: list[tuple[str, Any]] = []
    packed: list[tuple[int, int]] = []
    int8: list[str] = []
    nvfp4 = mx = mx8 = False
    for gname, g in groups.items():
        w = (g or {}).get("weights") if isinstance(g, dict) else None
        if not w:
            continue
        fmt = g.get("format") or top
        if fmt == "dense":
            continue  # weights stored unquantized (their scales are hidden): a plain read
        bits, typ, strat = w.get("num_bits"), w.get("type"), w.get("strategy")
        where = f"quantization_config.config_groups.{gname}"
        asym = w.get("symmetric") is False
        if asym and not (fmt == CT_INT_PACKED_FORMAT and (bits, strat) == (4, "group")):
            raise CheckpointError(
                f"{where}: asymmetric weights (zero points) are read as int4 pack-quantized groups "
                "only"
            )
        if fmt in ("float-quantized", "naive-quantized") and (bits, typ) == (8, "float"):
            if strat == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, list) and len(bs) == 2):
                    raise CheckpointError(f"{where}.weights.block_structure: two ints, got {bs!r}")
                fp8.append(("block", (int(bs[0]), int(bs[1]))))
            elif strat in ("tensor", "channel"):
                fp8.append((strat, None))
            else:
                raise CheckpointError(f"{where}: fp8 weights with strategy {strat!r} are not read")
        elif fmt == "nvfp4-pack-quantized" and (bits, typ) == (4, "float"):
            if w.get("group_size") != NVFP4_GROUP:
                raise CheckpointError(
                    f"{where}: nvfp4 needs group_size 16, got {w.get('group_size')}"
                )
            nvfp4 = True
        elif fmt == CT_MXFP4_FORMAT and (bits, typ, w.get("group_size")) == (4, "float", 32):
            mx = True
        elif fmt == CT_MXFP8_FORMAT and (bits, typ, w.get("group_size")) == (8, "float", 32):
            mx8 = True
        elif fmt == CT_INT_PACKED_FORMAT and (bits, typ) in ((4, "int"), (8, "int")):
            if strat not in ("group", "channel"):
                raise CheckpointError(
                    f"{where}: int{bits} weights with strategy {strat!r} are not read"
                )
            if w.get("actorder") not in (None, "static", "weight") and strat == "group":
                raise CheckpointError(f"{where}: act-order (g_idx) weights are not read yet")
            packed.append((int(bits), int(w.get("group_size") or 0) if strat == "group" else 0))
        elif fmt == CT_INT_FORMAT and (bits, typ) == (8, "int") and strat in ("tensor", "channel"):
            int8.append(strat)
        else:
            raise CheckpointError(
                f"{where}: compressed-tensors format {fmt!r} with {bits}-bit {typ} weights "
                f"(strategy {strat}) is not a source layout qckpt reads"
            )
    if len({b for b, _ in packed}) > 1:
        raise CheckpointError(
            "quantization_config: packed integer weights of several bit widths are not read"
        )
    return fp8, (nvfp4, mx, mx8), packed, int8


def read_layout(index: Index, qc: dict[str, Any], hf_quant: Any = None) -> SourceLayout:
    """The layout of a compressed-tensors dir (``hf_quant``: unused, the registry's signature)."""
    fp8, (nvfp4, mx, mx8), packed, int8 = _weight_options(qc)
    weights: dict[str, QuantWeight] = {}
    if fp8:
        weights.update(fp8_weights(index, "_scale", fp8))
    if nvfp4:
        weights.update(nvfp4_weights(index, "weight_packed", "weight_global_scale", True))
    if mx:
        weights.update(mx_weights(index, 4))
    if mx8:
        weights.update(mx_weights(index, 8))
    if packed:
        weights.update(int_packed_weights(index, packed[0][0], [g for _, g in packed]))
    if int8:
        weights.update(int8_weights(index, int8))
    kinds = sorted({w.scale_layout for w in weights.values()})
    return SourceLayout(name="compressed-tensors", detail=", ".join(kinds), weights=weights)


CT_FP8_FORMAT = "float-quantized"
# the top-level format of a config whose groups differ (compressed-tensors' own rule)
CT_MIXED_FORMAT = "mixed-precision"


class CompressedTensorsLayout(ExportLayout):
    name = "compressed-tensors"
    # the codes' type in the config's quantization args, and the group's format
    code_type = "float"
    ct_format = CT_FP8_FORMAT

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        super().__init__(quant, model_dtype, block_scales)
        w, i = quant.weights, quant.inputs
        ws, ins = scheme_of(w, "weight"), scheme_of(i, "input")
        if not (isinstance(ws, Fp8Scheme) and isinstance(ins, Fp8Scheme)):
            raise SchemeError(
                "export.format compressed-tensors writes FP8 weights with FP8 inputs, or NVFP4 "
                f"weights with NVFP4 inputs; got weights {w.format}, inputs {i.format}"
            )
        if i.granularity == "block" and not i.dynamic:
            raise SchemeError(
                "quant.inputs: block (per-group) input scales must be dynamic in compressed-tensors"
            )

    def _scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        w = self.quant.weights
        if w.granularity == "tensor":
            return (1,)
        if w.granularity == "channel":
            return (shape[0], 1)
        return scheme_of(w, "weight").amax_shape("weight", shape)

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        i = self.quant.inputs
        if i.dynamic and i.granularity == "block" and shape[1] % i.block_size[-1]:
            # the clients quantize inputs per group along the input dim and need it to divide
            raise ExportError(
                f"{module}: quant.inputs.block_size {i.block_size[-1]} does not divide its input "
                f"dim {shape[1]}; per-group input quantization cannot run on it"
            )
        specs = [
            OutSpec(f"{module}.weight", FP8, shape),
            OutSpec(f"{module}.weight_scale", self.model_dtype, self._scale_shape(shape)),
        ]
        if not self.quant.inputs.dynamic:
            specs.append(OutSpec(f"{module}.input_scale", self.model_dtype, (1,)))
        return specs

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        g = self.quant.weights.granularity
        wa = amax[f"{module}.weight_amax"].detach().to(torch.float32).clamp_min(MIN_AMAX)
        scale = (
            amax_over(wa, FP8_MAX).reshape(self._scale_shape(tuple(w.shape))).to(self.model_dtype)
        )
        block = weight_block(self.quant.weights.block_size)
        yield f"{module}.weight", fp8_quantize(w, scale.to(torch.float32), g, block)
        yield f"{module}.weight_scale", scale
        if not self.quant.inputs.dynamic:
            ia = amax_scalar(amax[f"{module}.input_amax"])
            yield f"{module}.input_scale", amax_over(ia, FP8_MAX).reshape(1).to(self.model_dtype)

    def stacks(self) -> bool:
        return scheme_of(self.quant.weights, "weight").stacks()

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        k, rows, cols = w.shape
        shape = self._scale_shape((rows, cols))
        wa = stack_f32([amax[f"{m}.weight_amax"] for m in modules]).clamp_min(MIN_AMAX)
        scale = amax_over(wa, FP8_MAX).reshape(k, *shape).to(self.model_dtype)
        out = [fp8_quantize_stack(w, scale.to(torch.float32).reshape(k, -1), chunk_elems), scale]
        if not self.quant.inputs.dynamic:
            ia = stack_f32([amax[f"{m}.input_amax"] for m in modules]).clamp_min(MIN_AMAX)
            out.append(amax_over(ia, FP8_MAX).reshape(k, 1).to(self.model_dtype))
        return out

    def kv_specs(self, attn: str) -> list[OutSpec]:
        return [OutSpec(f"{attn}.{kv}_scale", self.model_dtype, (1,)) for kv in ("k", "v")]

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for kv in ("k", "v"):
            a = amax_scalar(amax[f"{attn}.{kv}_proj.output_amax"])
            yield f"{attn}.{kv}_scale", amax_over(a, FP8_MAX).reshape(1).to(self.model_dtype)

    def _args(self) -> tuple[dict, dict]:
        base = {
            "num_bits": 8,
            "type": self.code_type,
            "symmetric": True,
            "group_size": None,
            "block_structure": None,
        }
        w = self.quant.weights
        weights = {**base, "strategy": w.granularity, "dynamic": False}
        if w.granularity == "block":
            weights["block_structure"] = list(weight_block(w.block_size))
        i = self.quant.inputs
        if not i.dynamic:
            inputs = {**base, "strategy": "tensor", "dynamic": False}
        elif i.granularity == "tensor":
            inputs = {**base, "strategy": "token", "dynamic": True}
        else:
            inputs = {**base, "strategy": "group", "dynamic": True, "group_size": i.block_size[-1]}
        return weights, inputs

    def config_group(self, targets: list[str]) -> dict:
        """This scheme's ``config_groups`` entry, quantizing ``targets``."""
        weights, inputs = self._args()
        return {
            "targets": targets,
            "weights": weights,
            "input_activations": inputs,
            "output_activations": None,
            "format": self.ct_format,
        }

    def quantization_config(self, ignored: list[str]) -> dict:
        group = self.config_group(["Linear"])
        return self.config_with({"group_0": group}, group["format"], ignored)

    def config_with(self, groups: dict, fmt: str, ignored: list[str]) -> dict:
        """The ``quantization_config`` with ``groups``, top-level ``fmt`` and ``ignored``."""
        kv = None
        if self.quant.kv_cache:
            kv = {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor",
                "dynamic": False,
            }
        return {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": ignored,
            "kv_cache_scheme": kv,
            "global_compression_ratio": None,
        }

    def shard_metadata(self) -> dict[str, str]:
        return {
            "format": "pt",
            "qckpt_layout": "compressed-tensors",
            "quant_format": self.ct_format,
        }


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / x`` correctly rounded on every device (float64 division, rounded once)."""
    return (1.0 / x.to(torch.float64)).to(torch.float32)


class CompressedTensorsNvfp4Layout(CompressedTensorsLayout):
    """compressed-tensors ``nvfp4-pack-quantized`` (see the module doc); KV scales as FP8's."""

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        ExportLayout.__init__(self, quant, model_dtype, block_scales)
        w, i = quant.weights, quant.inputs
        ins = scheme_of(i, "input")
        # the inputs: NVFP4 with a static global scale (W4A4), or none (NVFP4A16)
        self.a16 = not ins.quantized
        nv = scheme_of(w, "weight").packed_fp4 and (ins.packed_fp4 or self.a16)
        if not nv or i.dynamic:
            raise SchemeError(
                "export.format compressed-tensors writes NVFP4 (nvfp4-pack-quantized) with "
                "inputs nvfp4 static or none (weight-only); got weights "
                f"{w.format}, inputs {i.format}{' dynamic' if i.dynamic else ''}"
            )

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        if shape[1] % NVFP4_GROUP:
            raise ExportError(
                f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}, got {shape[1]}"
            )
        f32 = torch.float32
        specs = [
            OutSpec(f"{module}.{CT_PACKED}", torch.uint8, (shape[0], shape[1] // 2)),
            OutSpec(f"{module}.{WEIGHT_SCALE}", FP8, (shape[0], shape[1] // NVFP4_GROUP)),
            OutSpec(f"{module}.{CT_WEIGHT_GLOBAL}", f32, (1,)),
        ]
        if not self.a16:
            specs.append(OutSpec(f"{module}.{CT_INPUT_GLOBAL}", f32, (1,)))
        return specs

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:

        if w.shape[1] % NVFP4_GROUP:
            raise ExportError(f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}")
        qdata, scale, gs = self.nvfp4(w, amax_scalar(amax[f"{module}.weight_amax"]), module)
        yield f"{module}.{CT_PACKED}", qdata
        yield f"{module}.{WEIGHT_SCALE}", scale
        yield f"{module}.{CT_WEIGHT_GLOBAL}", _reciprocal(gs).reshape(1)
        if self.a16:
            return
        ia = amax_scalar(amax[f"{module}.input_amax"])
        yield (
            f"{module}.{CT_INPUT_GLOBAL}",
            _reciprocal(amax_over(ia, FP4_MAX * FP8_MAX)).reshape(1),
        )

    def config_group(self, targets: list[str]) -> dict:
        group = super().config_group(targets)
        group["weights"] = ct_nvfp4_args(inputs=False)
        group["input_activations"] = None if self.a16 else ct_nvfp4_args(inputs=True)
        group["format"] = CT_NVFP4_FORMAT
        return group

    def warnings(self, modules: list[str]) -> list[str]:
        if any(EXPERT.match(m) for m in modules):
            return [
                "transformers 5.24 cannot dequantize NVFP4 MoE experts of a compressed-tensors "
                "export (it leaves them unloaded, or with dequantize=True drops their "
                "weight_global_scale): the logits are garbage there; see docs/CLIENTS.md"
            ]
        return []

    def shard_metadata(self) -> dict[str, str]:
        return {**super().shard_metadata(), "quant_format": CT_NVFP4_FORMAT}


class CompressedTensorsInt4Layout(CompressedTensorsLayout):
    """compressed-tensors ``pack-quantized`` INT4 weights (llm-compressor's ``W4A16``; INT8's
    ``W8A16`` the same with 8 bits): per linear ``weight_packed`` int32 ``[out, ceil(in / 8)]``
    (``ceil(in / 4)`` for 8 bits; :mod:`qckpt.formats.intq`),
    ``weight_scale`` in the model dtype ``[out, in / group]`` (``channel``: ``[out, 1]``) and
    ``weight_shape`` int64 ``[out, in]``; symmetric: no zero point. Asymmetric groups
    (``symmetric: false``): ``weight_zero_point`` int32 ``[ceil(out / 8), in / group]``, the
    zero points packed along the output dim, their scale and zero point from each group's min
    and max (:func:`~qckpt.formats.intq.int_asym_qparams`, from the weight written: the
    calibrated amax is a function of it) or GPTQ's. The codes are quantized with the scale as
    stored (rounded to the model dtype), as for FP8. Inputs: none."""

    def __init__(
        self, quant: QuantConfig, model_dtype: torch.dtype, block_scales: BlockScales | None = None
    ) -> None:
        ExportLayout.__init__(self, quant, model_dtype, block_scales)
        self.ws = scheme_of(quant.weights, "weight")
        self._given: dict[str, torch.Tensor] = {}
        if scheme_of(quant.inputs, "input").quantized:
            raise SchemeError(
                f"export.format compressed-tensors writes {self.ws.name} pack-quantized weights "
                "weight-only (W4A16 / W8A16); "
                f"got inputs {quant.inputs.format}: give quant.inputs {{format: none}}"
            )

    def _group(self) -> int:
        return self.ws.block[1] if self.ws.granularity == "group" else 0

    def _read_given(self, module: str) -> torch.Tensor | None:
        bs = self.block_scales
        return None if bs.given is None or not self._group() else bs.given(module)

    def guard_amax(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        # GPTQ made each group's scale from the group as it reached it, and its values may
        # pass the calibrated amax: they stay within the codes' range under those scales
        given = self._read_given(module)
        if given is None:
            return amax
        self._given[module] = given  # quantize_linear takes it next
        lo, hi = self.ws.code_range
        # asymmetric: |value| <= (hi - lo) * scale whatever the zero point
        reach = max(-lo, hi) if self.ws.symmetric else hi - lo
        return given.to(torch.float32) * float(reach)

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        g = self._group()
        if g and shape[1] % g:
            raise SchemeError(
                f"{module}: {self.ws.name} group {g} does not divide its input dim {shape[1]}; the "
                "clients' kernels need it to (a smaller group_size, or granularity: channel)"
            )
        per = 32 // self.ws.code_bits
        specs = [
            OutSpec(f"{module}.{CT_PACKED}", torch.int32, (shape[0], -(-shape[1] // per))),
            OutSpec(f"{module}.{WEIGHT_SCALE}", self.model_dtype, self._scale_shape(shape)),
            OutSpec(f"{module}.{CT_WEIGHT_SHAPE}", torch.int64, (2,)),
        ]
        if not self.ws.symmetric:
            zshape = (-(-shape[0] // per), self._scale_shape(shape)[1])
            specs.append(OutSpec(f"{module}.{CT_ZERO_POINT}", torch.int32, zshape))
        return specs

    def _scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        g = self._group()
        return (shape[0], shape[1] // g) if g else (shape[0], 1)

    def _qparams(self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]):
        """(scales as stored, int8 zero points or None) of ``module``'s weight ``w``."""
        from qckpt.formats.intq import int_asym_qparams, int_scale

        shape = self._scale_shape(tuple(w.shape))
        given = self._given.pop(module, None)
        if given is None:
            given = self._read_given(module)
        if given is not None:  # GPTQ's group scales, made as it reached each group
            if tuple(given.shape) != shape:
                raise ExportError(f"{module}: GPTQ group scales {list(given.shape)}, not {shape}")
            zp = None
            if not self.ws.symmetric:
                zp = self.block_scales.zero_points(module)
                if zp is None or tuple(zp.shape) != shape:
                    got = None if zp is None else list(zp.shape)
                    raise ExportError(f"{module}: GPTQ zero points {got}, not {shape}")
            return given.to(self.model_dtype), zp
        if not self.ws.symmetric:
            groups = w.to(torch.float32).reshape(shape[0], shape[1], -1)
            mn, mx = groups.amin(dim=-1), groups.amax(dim=-1)
            return int_asym_qparams(mn, mx, self.ws.code_range, self.model_dtype)
        wa = amax[f"{module}.weight_amax"].reshape(shape)
        return int_scale(wa, self.ws.qmax, self.model_dtype), None

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        from qckpt.formats.intq import int_codes, pack_int32, pack_int32_rows

        scale, zp = self._qparams(module, w, amax)
        codes = int_codes(w, scale, self.ws.code_range, self._group(), zp)
        yield f"{module}.{CT_PACKED}", pack_int32(codes, self.ws.code_bits)
        yield f"{module}.{WEIGHT_SCALE}", scale
        yield f"{module}.{CT_WEIGHT_SHAPE}", torch.tensor(list(w.shape), dtype=torch.int64)
        if zp is not None:
            yield f"{module}.{CT_ZERO_POINT}", pack_int32_rows(zp, self.ws.code_bits)

    def stacks(self) -> bool:
        return False

    def config_group(self, targets: list[str]) -> dict:
        g = self._group()
        weights = {
            "num_bits": self.ws.code_bits,
            "type": "int",
            "symmetric": self.ws.symmetric,
            "group_size": g or None,
            "strategy": "group" if g else "channel",
            "dynamic": False,
        }
        return {
            "targets": targets,
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
            "format": CT_INT_PACKED_FORMAT,
        }

    def shard_metadata(self) -> dict[str, str]:
        return {**super().shard_metadata(), "quant_format": CT_INT_PACKED_FORMAT}
