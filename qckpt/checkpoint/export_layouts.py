"""The two export layouts: what each quantized linear becomes, and the config that describes it.

compressed-tensors FP8 (``format: float-quantized``):

* weights ``tensor`` -> ``weight_scale`` ``(1,)``; ``channel`` -> ``(out, 1)``; ``block`` ->
  ``(ceil(out/b0), ceil(in/b1))`` (the last block of a dim that b does not divide is padded, as
  compressed-tensors pads it: its scale covers the rows/columns that exist).
* inputs: static ``tensor`` -> ``input_scale`` ``(1,)``; the recipe's ``dynamic: true`` with
  ``granularity: tensor`` is written as per-token dynamic (``strategy: token``, what vLLM runs for
  FP8 dynamic), with ``granularity: block`` as per-group dynamic (``strategy: group``,
  ``group_size`` = the last block dim). No scale is stored for dynamic inputs.
* scales are stored in the model dtype, because that is the dtype the clients' scale parameters
  have (compressed-tensors creates them in the weight's dtype). The weight is quantized with the
  *rounded* scale, so dequantizing with what is stored gives back what we meant. That is why
  this layout quantizes here (:func:`fp8_quantize`) and not through ``qckpt.formats``, which
  derives a float32 scale from the amax and has no option to quantize with a given scale.

compressed-tensors NVFP4 (``format: nvfp4-pack-quantized``, what llm-compressor writes for its
``NVFP4`` scheme; weights and static inputs nvfp4): ``weight_packed`` uint8 ``[out, in/2]`` and
``weight_scale`` float8_e4m3fn ``[out, in/16]`` are ModelOpt's ``weight`` / ``weight_scale``
byte for byte (compressed-tensors packs the even column in the low nibble too), quantized by
:mod:`qckpt.formats`; the global scales are the *reciprocals* of ModelOpt's, because
compressed-tensors divides by them (value = e2m1 * scale / global_scale):
``weight_global_scale`` float32 ``(1,)`` = ``1 / weight_scale_2`` (~ ``6 * 448 / amax``) and
``input_global_scale`` float32 ``(1,)`` = ``1 / input_scale``. Each reciprocal is correctly
rounded (in float64, then to float32), so ``scale / global_scale`` is within an ulp of
ModelOpt's ``weight_scale_2 * scale`` for the same codes. The inputs are ``dynamic: local`` in
the config (a static global scale, per-16 scales at run time), as in compressed-tensors' preset.

ModelOpt (``hf_quant_config.json`` + ``quant_method: modelopt``), field for field what ModelOpt
0.47's own ``export_hf_checkpoint`` writes for the same model (the producer aside; fixtures and the
script that made them in ``tests/fixtures/modelopt/``; the fields are in :mod:`layout_names`):

* ``FP8``: per-tensor weights and static per-tensor inputs; ``weight_scale`` and ``input_scale``
  are float32 scalars ``amax / 448``.
* ``FP8_PER_CHANNEL_PER_TOKEN``: per-channel weights (``weight_scale`` float32 ``[out]``) and
  dynamic per-token inputs (no ``input_scale``); the recipe's ``granularity: channel`` weights
  with ``dynamic: true`` per-tensor inputs.
* ``NVFP4``: (quantized by :mod:`qckpt.formats`, whose nvfp4 layout is ModelOpt's)
  ``weight`` uint8 ``[out, in/2]`` (two E2M1 codes a byte, the even column in the low
  nibble), ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2`` float32 scalar
  ``amax / (6 * 448)``, ``input_scale`` float32 scalar ``input_amax / (6 * 448)``. Unverified on
  a GPU: Hopper cannot run NVFP4 (see docs/CLIENTS.md).

MoE scales (``export.moe_scales``): ``shared`` (the default) writes what vLLM uses and ModelOpt
writes: one per-tensor weight scale (NVFP4: one ``weight_scale_2``) for an expert's gate and up,
from the larger of their two amaxes, and one static input scale per projection over all experts
of a layer (the max). ``per_expert`` writes each expert linear's own calibrated scales, for
clients that keep gate and up apart. Per-channel and per-block weight scales are never shared.

KV-cache scales (``quant.kv_cache: true``): ``k_scale`` / ``v_scale`` = amax / 448 from the
calibration file's ``{attn}.k_proj.output_amax`` and ``{attn}.v_proj.output_amax``. compressed-
tensors names them ``{attn}.k_scale`` (shape ``(1,)``), ModelOpt ``{attn}.k_proj.k_scale`` (scalar).
When the calibration file lacks them the export fails before writing anything rather than
writing a default scale of 1.0 the user did not ask for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import qckpt
from qckpt.calib.shapes import config_amax_shape, weight_block
from qckpt.checkpoint.layout_names import (  # noqa: F401 - re-exported: the one place for layouts
    CT_INPUT_GLOBAL,
    CT_NVFP4_FORMAT,
    CT_PACKED,
    CT_WEIGHT_GLOBAL,
    EMBEDDING_LEAVES,
    FP4_MAX,
    FP8_MAX,
    FUSED_GROUPS,
    INPUT_SCALE,
    KV_SCALES,
    MO_ALGOS,
    MO_FP8,
    MO_FP8_PCPT,
    MO_NVFP4,
    MODELOPT_FILE,
    MODELOPT_KV_SCHEME,
    MOE_PER_EXPERT,
    MOE_SHARED,
    NVFP4_GROUP,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    ct_nvfp4_args,
    modelopt_config_groups,
)
from qckpt.errors import ExportError
from qckpt.formats._common import div_f32, f64_const
from qckpt.models.naming import expert_roles
from qckpt.recipe import QuantConfig

FP8 = torch.float8_e4m3fn
# rows are quantized in chunks of about this many elements, so the float32 temporaries of the
# quantize math stay small next to the tensor itself (peak memory ~ the largest tensor)
CHUNK_ELEMS = 1 << 22
# a zero amax (an all-zero weight, an input never seen non-zero) would give a zero scale, and
# clients divide by the scale: keep it positive, the quantized values are zero either way
MIN_AMAX = 1e-12
# a per-expert linear in checkpoint naming: {...}.experts.{e}.{proj}
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


@dataclass(frozen=True)
class OutSpec:
    """One tensor the export writes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Layout:
    """The export layout of one recipe; every shape is known before any tensor is read."""

    name: str = ""
    # NVFP4 block scales: the max rule (False) or searched per block (True: a calibration
    # made with calibrate.algorithm mse; :func:`qckpt.calib.mse.nvfp4_mse_quantize`)
    block_search: bool = False
    # module -> the E4M3 block scales to write (a gptq calibration's), or None: the rule above
    given_block_scales = None

    def nvfp4(self, w: torch.Tensor, amax: torch.Tensor, module: str = ""):
        """(packed codes, E4M3 block scales, float32 global scale) of ``w`` with global amax
        ``amax``, the block scales given (:attr:`given_block_scales`) or as
        :attr:`block_search` says."""
        given = None if self.given_block_scales is None else self.given_block_scales(module)
        if given is not None:
            from qckpt.calib.gptq import nvfp4_with_scales

            return nvfp4_with_scales(w, amax, given)
        if self.block_search:
            from qckpt.calib.mse import nvfp4_mse_quantize

            qdata, scale, gs, *_ = nvfp4_mse_quantize(w, amax)
            return qdata, scale, gs
        from qckpt.formats import quantize

        q = quantize(w, "nvfp4", amax=amax)
        return q.qdata, q.scale, q.global_scale

    def __init__(self, quant: QuantConfig, model_dtype: torch.dtype) -> None:
        self.quant = quant
        self.model_dtype = model_dtype

    # -- planning -----------------------------------------------------------------------------
    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        raise NotImplementedError

    def needed_amax(self, module: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """Calibration keys a linear needs, with the amax shape each must have."""
        w = self.quant.weights
        out: list[tuple[str, tuple[int, ...]]] = []
        if w.format == "nvfp4" or w.granularity == "tensor":
            out.append((f"{module}.weight_amax", ()))
        elif w.granularity == "channel":
            out.append((f"{module}.weight_amax", (shape[0],)))
        else:
            out.append((f"{module}.weight_amax", config_amax_shape(w, "weight", shape)))
        if not self.quant.inputs.dynamic:
            out.append((f"{module}.input_amax", ()))
        return out

    def kv_specs(self, attn: str) -> list[OutSpec]:
        raise NotImplementedError

    def stacks(self) -> bool:
        """Whether :meth:`quantize_stack` can quantize several linears of one shape at once."""
        return False

    # -- writing ------------------------------------------------------------------------------
    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        """:meth:`quantize_linear` of ``k`` linears of one shape (``w`` ``[k, rows, cols]``,
        ``modules`` their names) at once, where :meth:`stacks` says so: one tensor per output
        of :meth:`linear_specs`, in its order, each ``[k, *spec.shape]``; ``out[j][i]`` has the
        bytes ``quantize_linear(modules[i], w[i], amax)``'s ``j``-th output has. The quantized
        weights are on ``w``'s device, the scales on the host (made there from the amaxes)."""
        raise NotImplementedError

    def quantization_config(self, ignored: list[str]) -> dict:
        raise NotImplementedError

    def extra_files(self, ignored: list[str]) -> dict[str, dict]:
        return {}

    def ignore_entries(self, ignored: list[str], embeddings: list[str]) -> list[str]:
        """The config's ignore list from the ignored linears (and the model's embeddings)."""
        return sorted(ignored)

    def warnings(self, modules: list[str]) -> list[str]:
        """What the known clients cannot serve in this export (see docs/CLIENTS.md)."""
        return []

    def shard_metadata(self) -> dict[str, str]:
        raise NotImplementedError


def _amax_scalar(a: torch.Tensor) -> torch.Tensor:
    return a.detach().to(torch.float32).reshape(()).clamp_min(MIN_AMAX)


def _over(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """float32 ``amax / qmax``, correctly rounded on every device: CUDA torch turns a division
    by a Python number into a multiplication by its reciprocal, one ulp off for about half of
    all values (see ``qckpt.formats._common.div_f32``)."""
    return div_f32(amax.to(torch.float32), f64_const(qmax, amax.device))


def _row_chunks(rows: int, cols: int, align: int = 1) -> Iterator[tuple[int, int]]:
    step = max(align, (CHUNK_ELEMS // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def fp8_quantize(
    w: torch.Tensor, scale: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``w / scale`` saturated to E4M3, chunk by chunk (scale: float32, tensor/channel/block).

    Each chunk is converted into one reused float32 buffer, divided and clamped in place, and
    converted into the output by the copy: no full-size temporaries. (A single mixed-dtype
    ``torch.div(bf16, f32, out=f32)`` would save a pass but runs ~3x slower on CPU.)
    """
    rows, cols = w.shape
    out = torch.empty((rows, cols), dtype=FP8, device=w.device)
    b0, b1 = block
    # on w's device: a CPU 0-d divisor would make CUDA torch multiply by its reciprocal instead
    # of dividing (one ulp off for many values), and the GPU result would differ from the CPU's;
    # non-blocking: a blocking copy waits for every kernel queued before it (a CPU source's
    # bytes are staged by the time the call returns)
    scale = scale.to(device=w.device, dtype=torch.float32, non_blocking=True)
    buf = torch.empty(0, dtype=torch.float32, device=w.device)
    for r0, r1 in _row_chunks(rows, cols, b0 if granularity == "block" else 1):
        n = r1 - r0
        if buf.numel() < n * cols:
            buf = torch.empty(n * cols, dtype=torch.float32, device=w.device)
        x = buf[: n * cols].view(n, cols)
        x.copy_(w[r0:r1])
        if granularity == "tensor":
            x.div_(scale.reshape(()))
        elif granularity == "channel":
            x.div_(scale.reshape(-1, 1)[r0:r1])
        else:
            s = scale[r0 // b0 : math.ceil(r1 / b0)]
            if n % b0 == 0 and cols % b1 == 0:
                # whole blocks: broadcast each block's scale over a 4-D view, no expanded copy
                x.view(n // b0, b0, cols // b1, b1).div_(s.view(n // b0, 1, cols // b1, 1))
            else:  # a partial last block: expand the scales over the chunk
                x.div_(s.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :cols])
        x.clamp_(-FP8_MAX, FP8_MAX)
        out[r0:r1].copy_(x)
    return out


class CompressedTensorsLayout(Layout):
    name = "compressed-tensors"

    def __init__(self, quant: QuantConfig, model_dtype: torch.dtype) -> None:
        super().__init__(quant, model_dtype)
        w, i = quant.weights, quant.inputs
        if w.format != "fp8" or i.format != "fp8":
            raise ExportError(
                "export.format compressed-tensors writes FP8 weights with FP8 inputs, or NVFP4 "
                f"weights with NVFP4 inputs; got weights {w.format}, inputs {i.format}"
            )
        if i.granularity == "block" and not i.dynamic:
            raise ExportError(
                "quant.inputs: block (per-group) input scales must be dynamic in compressed-tensors"
            )

    def _scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        w = self.quant.weights
        if w.granularity == "tensor":
            return (1,)
        if w.granularity == "channel":
            return (shape[0], 1)
        return config_amax_shape(w, "weight", shape)

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
        scale = _over(wa, FP8_MAX).reshape(self._scale_shape(tuple(w.shape))).to(self.model_dtype)
        block = weight_block(self.quant.weights.block_size)
        yield f"{module}.weight", fp8_quantize(w, scale.to(torch.float32), g, block)
        yield f"{module}.weight_scale", scale
        if not self.quant.inputs.dynamic:
            ia = _amax_scalar(amax[f"{module}.input_amax"])
            yield f"{module}.input_scale", _over(ia, FP8_MAX).reshape(1).to(self.model_dtype)

    def stacks(self) -> bool:
        w = self.quant.weights
        return w.format == "fp8" and w.granularity in ("tensor", "channel")

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        k, rows, cols = w.shape
        shape = self._scale_shape((rows, cols))
        wa = _stack_f32([amax[f"{m}.weight_amax"] for m in modules]).clamp_min(MIN_AMAX)
        scale = _over(wa, FP8_MAX).reshape(k, *shape).to(self.model_dtype)
        out = [fp8_quantize_stack(w, scale.to(torch.float32).reshape(k, -1), chunk_elems), scale]
        if not self.quant.inputs.dynamic:
            ia = _stack_f32([amax[f"{m}.input_amax"] for m in modules]).clamp_min(MIN_AMAX)
            out.append(_over(ia, FP8_MAX).reshape(k, 1).to(self.model_dtype))
        return out

    def kv_specs(self, attn: str) -> list[OutSpec]:
        return [OutSpec(f"{attn}.{kv}_scale", self.model_dtype, (1,)) for kv in ("k", "v")]

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for kv in ("k", "v"):
            a = _amax_scalar(amax[f"{attn}.{kv}_proj.output_amax"])
            yield f"{attn}.{kv}_scale", _over(a, FP8_MAX).reshape(1).to(self.model_dtype)

    def _args(self) -> tuple[dict, dict]:
        base = {
            "num_bits": 8,
            "type": "float",
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

    def quantization_config(self, ignored: list[str]) -> dict:
        weights, inputs = self._args()
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
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": inputs,
                    "output_activations": None,
                    "format": "float-quantized",
                }
            },
            "ignore": ignored,
            "kv_cache_scheme": kv,
            "global_compression_ratio": None,
        }

    def shard_metadata(self) -> dict[str, str]:
        return {
            "format": "pt",
            "qckpt_layout": "compressed-tensors",
            "quant_format": "float-quantized",
        }


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / x`` correctly rounded on every device (float64 division, rounded once)."""
    return (1.0 / x.to(torch.float64)).to(torch.float32)


class CompressedTensorsNvfp4Layout(CompressedTensorsLayout):
    """compressed-tensors ``nvfp4-pack-quantized`` (see the module doc); KV scales as FP8's."""

    def __init__(self, quant: QuantConfig, model_dtype: torch.dtype) -> None:
        Layout.__init__(self, quant, model_dtype)
        w, i = quant.weights, quant.inputs
        if w.format != "nvfp4" or i.format != "nvfp4" or i.dynamic:
            raise ExportError(
                "export.format compressed-tensors writes NVFP4 (nvfp4-pack-quantized) with "
                f"weights and static inputs nvfp4; got weights {w.format}, inputs {i.format}"
                f"{' dynamic' if i.dynamic else ''}"
            )

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        if shape[1] % NVFP4_GROUP:
            raise ExportError(
                f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}, got {shape[1]}"
            )
        f32 = torch.float32
        return [
            OutSpec(f"{module}.{CT_PACKED}", torch.uint8, (shape[0], shape[1] // 2)),
            OutSpec(f"{module}.{WEIGHT_SCALE}", FP8, (shape[0], shape[1] // NVFP4_GROUP)),
            OutSpec(f"{module}.{CT_WEIGHT_GLOBAL}", f32, (1,)),
            OutSpec(f"{module}.{CT_INPUT_GLOBAL}", f32, (1,)),
        ]

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:

        if w.shape[1] % NVFP4_GROUP:
            raise ExportError(f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}")
        qdata, scale, gs = self.nvfp4(w, _amax_scalar(amax[f"{module}.weight_amax"]), module)
        ia = _amax_scalar(amax[f"{module}.input_amax"])
        yield f"{module}.{CT_PACKED}", qdata
        yield f"{module}.{WEIGHT_SCALE}", scale
        yield f"{module}.{CT_WEIGHT_GLOBAL}", _reciprocal(gs).reshape(1)
        yield f"{module}.{CT_INPUT_GLOBAL}", _reciprocal(_over(ia, FP4_MAX * FP8_MAX)).reshape(1)

    def quantization_config(self, ignored: list[str]) -> dict:
        cfg = super().quantization_config(ignored)
        group = cfg["config_groups"]["group_0"]
        group["weights"] = ct_nvfp4_args(inputs=False)
        group["input_activations"] = ct_nvfp4_args(inputs=True)
        group["format"] = CT_NVFP4_FORMAT
        cfg["format"] = CT_NVFP4_FORMAT
        return cfg

    def warnings(self, modules: list[str]) -> list[str]:
        if any(_EXPERT.match(m) for m in modules):
            return [
                "transformers 5.24 cannot dequantize NVFP4 MoE experts of a compressed-tensors "
                "export (it leaves them unloaded, or with dequantize=True drops their "
                "weight_global_scale): the logits are garbage there; see docs/CLIENTS.md"
            ]
        return []

    def shard_metadata(self) -> dict[str, str]:
        return {**super().shard_metadata(), "quant_format": CT_NVFP4_FORMAT}


class ModelOptLayout(Layout):
    name = "modelopt"

    def __init__(self, quant: QuantConfig, model_dtype: torch.dtype) -> None:
        super().__init__(quant, model_dtype)
        w, i = quant.weights, quant.inputs
        fp8 = w.format == "fp8" and i.format == "fp8" and i.granularity == "tensor"
        if fp8 and w.granularity == "tensor" and not i.dynamic:
            self.algo = MO_FP8
        elif fp8 and w.granularity == "channel" and i.dynamic:
            self.algo = MO_FP8_PCPT
        elif w.format == "nvfp4" and i.format == "nvfp4" and not i.dynamic:
            self.algo = MO_NVFP4
        else:
            raise ExportError(
                "export.format modelopt writes FP8 (per-tensor weights, static per-tensor inputs), "
                "FP8_PER_CHANNEL_PER_TOKEN (per-channel weights, dynamic per-tensor inputs) or "
                f"NVFP4 (weights and static inputs nvfp4); got weights {w.format}/{w.granularity}, "
                f"inputs {i.format}/{i.granularity}{' dynamic' if i.dynamic else ''}"
            )

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        f32 = torch.float32
        if self.algo == MO_FP8:
            return [
                OutSpec(f"{module}.weight", FP8, shape),
                OutSpec(f"{module}.{WEIGHT_SCALE}", f32, ()),
                OutSpec(f"{module}.{INPUT_SCALE}", f32, ()),
            ]
        if self.algo == MO_FP8_PCPT:
            return [
                OutSpec(f"{module}.weight", FP8, shape),
                OutSpec(f"{module}.{WEIGHT_SCALE}", f32, (shape[0],)),
            ]
        if shape[1] % NVFP4_GROUP:
            raise ExportError(
                f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}, got {shape[1]}"
            )
        return [
            OutSpec(f"{module}.weight", torch.uint8, (shape[0], shape[1] // 2)),
            OutSpec(f"{module}.{WEIGHT_SCALE}", FP8, (shape[0], shape[1] // NVFP4_GROUP)),
            OutSpec(f"{module}.{WEIGHT_SCALE_2}", f32, ()),
            OutSpec(f"{module}.{INPUT_SCALE}", f32, ()),
        ]

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        # ModelOpt's scales are float32 and derived from the amax exactly as qckpt.formats
        # derives them (amax / 448, amax / (6 * 448)), so the formats layer does the math
        from qckpt.formats import quantize

        if self.algo == MO_FP8_PCPT:
            wa = amax[f"{module}.weight_amax"].detach().to(torch.float32).clamp_min(MIN_AMAX)
            scale = _over(wa, FP8_MAX).reshape(-1)
            yield f"{module}.weight", fp8_quantize(w, scale, "channel")
            yield f"{module}.{WEIGHT_SCALE}", scale
            return
        wa = _amax_scalar(amax[f"{module}.weight_amax"])
        ia = _amax_scalar(amax[f"{module}.input_amax"])
        if self.algo == MO_FP8:
            q = quantize(w, "fp8", granularity="tensor", amax=wa)
            yield f"{module}.weight", q.qdata
            yield f"{module}.{WEIGHT_SCALE}", q.scale.to(torch.float32).reshape(())
            yield f"{module}.{INPUT_SCALE}", _over(ia, FP8_MAX)
            return
        if w.shape[1] % NVFP4_GROUP:
            raise ExportError(f"{module}: NVFP4 needs the input dim divisible by {NVFP4_GROUP}")
        qdata, scale, gs = self.nvfp4(w, wa, module)
        yield f"{module}.weight", qdata
        yield f"{module}.{WEIGHT_SCALE}", scale
        yield f"{module}.{WEIGHT_SCALE_2}", gs.to(torch.float32).reshape(())
        yield f"{module}.{INPUT_SCALE}", _over(ia, FP4_MAX * FP8_MAX)

    def stacks(self) -> bool:
        return self.algo == MO_FP8_PCPT

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        k = w.shape[0]
        wa = _stack_f32([amax[f"{m}.weight_amax"] for m in modules]).clamp_min(MIN_AMAX)
        scale = _over(wa, FP8_MAX).reshape(k, -1)
        return [fp8_quantize_stack(w, scale, chunk_elems), scale]

    def kv_specs(self, attn: str) -> list[OutSpec]:
        return [OutSpec(f"{attn}.{kv}_proj.{kv}_scale", torch.float32, ()) for kv in ("k", "v")]

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for kv in ("k", "v"):
            yield (
                f"{attn}.{kv}_proj.{kv}_scale",
                _over(_amax_scalar(amax[f"{attn}.{kv}_proj.output_amax"]), FP8_MAX),
            )

    def warnings(self, modules: list[str]) -> list[str]:
        if self.algo == MO_FP8_PCPT and any(_EXPERT.match(m) for m in modules):
            return [
                "vLLM 0.26 cannot load FP8_PER_CHANNEL_PER_TOKEN MoE experts (its ModelOpt MoE "
                "method takes per-tensor scales; ModelOpt's own export fails the same way): use "
                "export.format compressed-tensors for per-channel MoE weights"
            ]
        return []

    def ignore_entries(self, ignored: list[str], embeddings: list[str]) -> list[str]:
        # ModelOpt lists the embeddings with the modules it left unquantized
        return sorted(set(ignored) | set(embeddings))

    def _producer(self) -> dict:
        return {"name": "qckpt", "version": qckpt.__version__}

    def quantization_config(self, ignored: list[str]) -> dict:
        # config.json is what vLLM reads (it prefers it to hf_quant_config.json): "ignore", and
        # the KV-cache scheme as a dict; a flat "exclude_modules" there is not read at all
        cfg: dict = {}
        groups = modelopt_config_groups(self.algo)
        if groups is not None:
            cfg["config_groups"] = groups
        cfg["ignore"] = list(ignored)
        if self.quant.kv_cache:
            cfg["kv_cache_scheme"] = dict(MODELOPT_KV_SCHEME)
        cfg["producer"] = self._producer()
        cfg["quant_algo"] = self.algo
        cfg["quant_method"] = "modelopt"
        return cfg

    def extra_files(self, ignored: list[str]) -> dict[str, dict]:
        q: dict = {"exclude_modules": list(ignored)}
        if self.algo == MO_NVFP4:
            q["group_size"] = NVFP4_GROUP
        q["kv_cache_quant_algo"] = "FP8" if self.quant.kv_cache else None
        q["quant_algo"] = self.algo
        return {MODELOPT_FILE: {"producer": self._producer(), "quantization": q}}

    def shard_metadata(self) -> dict[str, str]:
        return {"format": "pt", "qckpt_layout": "modelopt", "quant_format": self.algo}


def make_layout(export_format: str, quant: QuantConfig, model_dtype: torch.dtype) -> Layout:
    if export_format == "compressed-tensors":
        if quant.weights.format == "nvfp4":
            return CompressedTensorsNvfp4Layout(quant, model_dtype)
        return CompressedTensorsLayout(quant, model_dtype)
    if export_format == "modelopt":
        return ModelOptLayout(quant, model_dtype)
    raise ExportError(
        f"export.format: unknown layout {export_format!r} (compressed-tensors | modelopt)"
    )


def share_moe_amax(
    amax: dict[str, torch.Tensor],
    modules: list[str],
    quant: QuantConfig,
    model_type: str,
    *,
    values: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The amaxes behind ``export.moe_scales: shared`` (see the module doc); a new dict.
    ``values``: one-value amaxes already read as floats (the plan's check makes them), by key.

    Per-tensor weight amax (FP8 ``tensor``, NVFP4's global amax): an expert's gate and up both
    get the larger of the two. Static input amax: every expert of a layer gets the max over the
    layer's experts, one for gate/up (they read the same input) and one for down.
    """
    roles = expert_roles(model_type)
    per_tensor_w = quant.weights.format == "nvfp4" or quant.weights.granularity == "tensor"
    static_in = not quant.inputs.dynamic
    pairs: dict[tuple[str, str], list[str]] = {}  # (experts, e) -> gate/up modules
    layer_in: dict[tuple[str, str], list[str]] = {}  # (experts, "gate_up"|"down") -> modules
    for m in modules:
        hit = _EXPERT.match(m)
        role = roles.get(hit["proj"]) if hit else None
        if role is None:
            continue
        side = "down" if role == "down" else "gate_up"
        if side == "gate_up":
            pairs.setdefault((hit["experts"], hit["e"]), []).append(m)
        layer_in.setdefault((hit["experts"], side), []).append(m)
    out = dict(amax)
    got = values or {}
    ties: list[tuple[list[str], int]] = []  # (keys tied, the one whose value they all get)

    def tie(names: list[str], kind: str) -> None:
        keys = [k for k in (f"{n}.{kind}_amax" for n in names) if k in amax]
        if len(keys) > 1:
            # the largest as a Python float (exact for float32 amaxes; NaN wins, as in a
            # tensor max): thousands of expert pairs, a stack and a max each cost seconds, and
            # so did three tensor ops per amax (18k experts: 0.9 s)
            vals = [got[k] if k in got else float(amax[k]) for k in keys]
            i = next((j for j, v in enumerate(vals) if v != v), None)
            if i is None:
                i = max(range(len(vals)), key=vals.__getitem__)
            ties.append((keys, i))

    if per_tensor_w:
        for names in pairs.values():
            tie(names, "weight")
    if static_in:
        for names in layer_in.values():
            tie(names, "input")
    # each tie's value as its own float32 0-d tensor; from the floats in one call when every
    # winner's value is known finite (``values`` come from a finiteness check), else a clone
    # of the winner (a NaN keeps its bits)
    known = all(keys[i] in got for keys, i in ties)
    if known and ties:
        tops = torch.tensor([got[keys[i]] for keys, i in ties], dtype=torch.float32).unbind()
    else:
        tops = [amax[keys[i]].detach().float().reshape(()).clone() for keys, i in ties]
    for (keys, _), top in zip(ties, tops, strict=True):
        shaped = {(): top}
        for k in keys:
            shape = tuple(amax[k].shape)
            t = shaped.get(shape)
            if t is None:
                t = shaped[shape] = top.reshape(shape)
            out[k] = t
    return out


# a weight that was calibrated gives back its calibrated amax exactly, or within the rounding of
# the parameter format the calibration ran on (MXFP8's E4M3 elements: 2^-4 relative); more than
# this is another checkpoint, and its values would be clipped to scales made for other weights
WEIGHT_AMAX_RTOL = 0.0625


def _per_row(w: torch.Tensor, weight_amax: torch.Tensor) -> bool:
    rows = w.shape[0]
    return rows > 1 and weight_amax.numel() == rows and weight_amax.shape[0] == rows


def check_source_weight(module: str, w: torch.Tensor, weight_amax: torch.Tensor) -> torch.Tensor:
    """The source-weight guard's verdict on ``w``, left on its device: a 0-d bool tensor, True
    when :func:`refuse_source_weight` refuses ``w`` (a non-finite value, or a row or the whole
    tensor over its calibrated amax). Nothing here waits for the device (no ``bool`` of a device
    tensor, no blocking copy): the export looks at the verdicts of a batch of tensors
    with the one synchronisation that brings their outputs back (the profiled H200 export spent
    ~5 ms per 3 MB expert weight, much of it in such waits), and asks :func:`refuse_source_weight` for the message of
    the first refused one. ``module`` names it for a caller's spy; the verdict needs no name.

    One pass in row chunks (no full-size temporary); per row when the amax is per channel.
    """
    del module
    rows, cols = w.shape
    per_row = _per_row(w, weight_amax)
    # the limit is made where the amax is (the host, for the export: a few scalar ops and no
    # copy); a per-tensor limit stays a 0-d host tensor, which a CUDA comparison takes as a
    # scalar, so only a per-row limit is copied (non-blocking)
    cal = weight_amax.detach().to(torch.float32)
    limit = (cal.reshape(-1) if per_row else cal.max()) * (1 + WEIGHT_AMAX_RTOL)
    # against a finite limit, "not <=" is true exactly for a row over it, NaN or Inf (rows are
    # >= 0): one comparison instead of three ops; reading the host limit waits for nothing
    finite = limit.device.type == "cpu" and bool(torch.isfinite(limit).all())
    if per_row:
        limit = limit.to(w.device, non_blocking=True)
    bad = None
    for r0, r1 in _row_chunks(rows, cols):
        part = w[r0:r1].abs().amax(dim=1).to(torch.float32)
        lim = limit[r0:r1] if per_row else limit
        if finite:
            chunk = (part <= lim).all().logical_not_()
        else:  # refuse_source_weight's comparisons exactly (a NaN limit refuses no finite row)
            chunk = (part > lim).logical_or_(~torch.isfinite(part)).any()
        bad = chunk if bad is None else bad.logical_or_(chunk)
    if bad is None:  # no rows: refuse_source_weight compares its zero maximum with the limit
        bad = (limit < 0).any().to(w.device)
    return bad


def refuse_source_weight(module: str, w: torch.Tensor, weight_amax: torch.Tensor) -> None:
    """Refuse a non-finite weight, or one larger than its calibrated amax (see above), with a
    one-line ExportError naming the first bad row; waits for the device several times, so the
    export calls it only on a tensor whose verdict (:func:`check_source_weight`) was True."""
    rows, cols = w.shape
    per_row = _per_row(w, weight_amax)
    got = torch.empty(rows if per_row else 0, dtype=torch.float32, device=w.device)
    top = torch.zeros((), dtype=torch.float32, device=w.device)
    for r0, r1 in _row_chunks(rows, cols):
        part = w[r0:r1].abs().amax(dim=1).to(torch.float32)
        if not torch.isfinite(part).all():
            bad = r0 + int((~torch.isfinite(part)).nonzero()[0])
            raise ExportError(
                f"{module}.weight: not finite (NaN or Inf in row {bad}) in the checkpoint; "
                "refusing to quantize it"
            )
        if per_row:
            got[r0:r1] = part
        else:
            top = torch.maximum(top, part.max())
    cal = weight_amax.detach().to(device=w.device, dtype=torch.float32)
    if per_row:
        over = got > cal.reshape(-1) * (1 + WEIGHT_AMAX_RTOL)
        if over.any():
            r = int(over.nonzero()[0])
            _refuse_amax(module, float(got[r]), float(cal.reshape(-1)[r]), f" (row {r})")
        return
    if top > cal.max() * (1 + WEIGHT_AMAX_RTOL):
        _refuse_amax(module, float(top), float(cal.max()), "")


def _refuse_amax(module: str, got: float, cal: float, where: str) -> None:
    raise ExportError(
        f"{module}.weight: amax {got:.6g}{where} exceeds the calibrated weight amax {cal:.6g}; "
        "the checkpoint is not the one that was calibrated (calibrate it again)"
    )


# --------------------------------------------------------------------------------------------
# stacks: k linears of one shape quantized together (the export's bulk path)


def fp8_quantize_stack(w: torch.Tensor, scale: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """:func:`fp8_quantize` of ``k`` weights at once: ``w`` ``[k, rows, cols]`` (any strides),
    ``scale`` float32 ``[k]`` (per tensor) or ``[k, rows]`` (per channel). The element-wise math
    is :func:`fp8_quantize`'s (float32 copy, true division by a tensor on ``w``'s device,
    clamp, cast), so each ``out[i]`` has the bytes of ``fp8_quantize(w[i], scale[i], ...)``;
    whole weights at a time, as many as fit in ``chunk_elems`` (at least one)."""
    k, rows, cols = w.shape
    out = torch.empty((k, rows, cols), dtype=FP8, device=w.device)
    s = scale.to(device=w.device, dtype=torch.float32, non_blocking=True).reshape(k, -1, 1)
    step = max(1, chunk_elems // max(rows * cols, 1))
    buf = torch.empty(min(k, step) * rows * cols, dtype=torch.float32, device=w.device)
    for i0 in range(0, k, step):
        i1 = min(k, i0 + step)
        x = buf[: (i1 - i0) * rows * cols].view(i1 - i0, rows, cols)
        x.copy_(w[i0:i1])
        x.div_(s[i0:i1])
        x.clamp_(-FP8_MAX, FP8_MAX)
        out[i0:i1].copy_(x)
    return out


def _stack_f32(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[k, n]`` float32 of ``k`` host tensors of ``n`` elements each: one stack and one
    conversion (element-wise, so each row is its tensor's own conversion); tensors of one
    shape (the usual case: every amax of a stack alike) are stacked as they are."""
    k = len(tensors)
    if len({t.shape for t in tensors}) != 1:
        tensors = [t.reshape(-1) for t in tensors]
    return torch.stack(tensors).detach().reshape(k, -1).to(torch.float32)


def check_source_stack(
    w: torch.Tensor, weight_amax: list[torch.Tensor], chunk_elems: int
) -> torch.Tensor:
    """:func:`check_source_weight`'s verdicts on ``k`` weights ``w`` ``[k, rows, cols]`` at
    once: a ``[k]`` bool tensor on ``w``'s device, True where :func:`refuse_source_weight`
    refuses ``w[i]`` against ``weight_amax[i]``. One reduction per chunk of whole weights.

    The same verdicts: a tensor (or row) is refused when its largest magnitude is over the
    limit or not finite (a NaN or Inf anywhere makes the maximum NaN or Inf), and the limit is
    made as there, ``float32(amax) * (1 + WEIGHT_AMAX_RTOL)``. Weights whose amaxes differ in
    kind (some per row, some not) are checked one by one."""
    k, rows, cols = w.shape
    shapes = {a.shape for a in weight_amax}  # one shape, so one kind, in the usual case
    kinds = {rows > 1 and math.prod(sh) == rows and sh[:1] == (rows,) for sh in shapes}
    if len(kinds) != 1 or rows == 0 or cols == 0:
        return torch.stack([check_source_weight("", w[i], a) for i, a in enumerate(weight_amax)])
    per_row = kinds.pop()
    if per_row or all(math.prod(sh) == 1 for sh in shapes):
        cal = _stack_f32(weight_amax)
    else:  # a per-tensor limit is the amax's max
        cal = torch.stack([a.detach().to(torch.float32).max() for a in weight_amax]).reshape(k, 1)
    limit = (cal * (1 + WEIGHT_AMAX_RTOL)).to(w.device, non_blocking=True)
    step = max(1, chunk_elems // (rows * cols))
    parts = []
    for i0 in range(0, k, step):
        i1 = min(k, i0 + step)
        a = w[i0:i1].abs()
        part = (a.amax(dim=2) if per_row else a.amax(dim=(1, 2)).reshape(-1, 1)).to(torch.float32)
        del a
        # "over the limit or not finite" is refuse_source_weight's test (a NaN limit refuses
        # no finite row); whatever the limit, the same verdict as check_source_weight's
        bad = (part > limit[i0:i1]).logical_or_(~torch.isfinite(part)).any(dim=1)
        parts.append(bad)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
