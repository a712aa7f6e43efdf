"""``calibrate.gptq_inputs: quantized``: each linear's inputs as the export's clients quantize
them, for the gptq pass's input-aware Hessians (:mod:`qckpt.calib.gptq_pass`).

The serving computation of a W4A4 / W8A8 export is ``Q Qa(X)``: GPTQ on the source's inputs
``X`` minimises ``|(W - Q) X|^2`` and leaves ``Qa`` out. With the quantized inputs ``Xq`` it
minimises ``|W X - Q Xq|^2`` instead (:func:`qckpt.calib.gptq.input_aware_target`). ``Xq`` is
what ``qckpt eval`` computes for the export (:mod:`qckpt.formats.act_quant`), from the scales
the export will write:

* NVFP4: the global scale ``1 / (amax / (6 * 448))`` in float32 (compressed-tensors'
  ``input_global_scale``; ModelOpt's ``input_scale`` is ``amax / (6 * 448)`` and its clients
  take the float32 reciprocal: the same number);
* FP8 static per tensor: ``amax / 448`` in float32, stored in ``scale_dtype`` (the model's
  dtype for compressed-tensors, float32 for ModelOpt), read back as float32;
* FP8 dynamic: per token (``granularity: tensor``) or per group of ``block_size[-1]``
  (``granularity: block``), as the export's config says, with no calibrated scale.

The amax is the calibrated input amax (after the max pass's sync; at least ``1e-12``, as the
export clamps it). Experts: one static scale per MoE layer and side (gate/up, down), the largest
amax over the layer's experts, as vLLM's fused MoE shares them (``qckpt eval`` does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qckpt.errors import CalibrationError
from qckpt.formats.act_quant import InputQuant
from qckpt.formats.numerics import div_f32, f64_const

SOURCE, QUANTIZED = "source", "quantized"
MIN_AMAX = 1e-12  # the export's clamp (qckpt.layouts.export_layout.MIN_AMAX)


@dataclass(frozen=True)
class InputMode:
    """How the export's clients quantize every linear input (one recipe: one mode)."""

    mode: str  # an act_quant mode: nvfp4, fp8_static, fp8_token or fp8_group
    group: int = 0  # fp8_group: the group width
    scale_dtype: torch.dtype = torch.float32  # fp8_static: the stored input_scale's dtype


def input_mode(fmt: str, granularity: str, dynamic: bool, block, scale_dtype) -> InputMode:
    """The mode of a recipe's ``quant.inputs`` (``fmt``, ``granularity``, ``dynamic``,
    ``block``), as the export layouts write it; CalibrationError for one they do not."""
    if fmt == "nvfp4" and not dynamic:
        return InputMode("nvfp4")
    if fmt == "fp8" and granularity == "tensor":
        return InputMode("fp8_token") if dynamic else InputMode("fp8_static", 0, scale_dtype)
    if fmt == "fp8" and granularity == "block" and dynamic:
        return InputMode("fp8_group", int(block[-1]))
    kind = f"{fmt} {granularity}{' dynamic' if dynamic else ''}"
    raise CalibrationError(
        f"calibrate.gptq_inputs: quantized does not know the clients' quantization of {kind} "
        "inputs; use calibrate.gptq_inputs: source"
    )


def _static(mode: InputMode, amax: torch.Tensor) -> InputQuant:
    a = amax.detach().to(device="cpu", dtype=torch.float32).reshape(()).clamp_min(MIN_AMAX)
    if mode.mode == "nvfp4":
        s = div_f32(a, f64_const(6.0 * 448.0, a.device))
        return InputQuant("nvfp4", (1.0 / s.to(torch.float64)).to(torch.float32))
    s = div_f32(a, f64_const(448.0, a.device)).to(mode.scale_dtype).to(torch.float32)
    return InputQuant("fp8_static", s)


def _largest(qs) -> torch.Tensor | None:
    got = [q.amax.detach().float().reshape(()) for q in qs if q.amax is not None]
    return torch.stack(got).max() if got else None


class LayerInputs(dict):
    """A layer's GPTQ Hessian keys (``_Linear.hkey``) -> the quantization of their inputs, and
    :meth:`quantized`, the quantized values of an input (q/k/v read one tensor, gate/up too: it
    is quantized once for them, the last input kept until :meth:`forget`)."""

    def __init__(self) -> None:
        super().__init__()
        self._last: tuple | None = None

    def quantized(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` quantized as the inputs of ``key`` are (float32, :mod:`qckpt.formats.act_quant`)."""
        iq = self[key]
        how = (iq.mode, None if iq.scale is None else float(iq.scale), iq.group)
        last = self._last
        if last is not None and last[0] is x and last[1] == x._version and last[2] == how:
            return last[3]
        xq = iq(x)
        self._last = (x, x._version, how, xq)
        return xq

    def forget(self) -> None:
        self._last = None


def layer_input_quants(instr, lin, experts, mode: InputMode) -> LayerInputs:
    """Each GPTQ Hessian key of the layer (``_Linear.hkey``) -> its inputs' quantization; a
    static one whose input was never calibrated (no token reached it) has none."""
    out = LayerInputs()
    dynamic = mode.mode in ("fp8_token", "fp8_group")
    for x in lin:
        if ":" in x.hkey:
            continue
        q = instr.quantizers.get(f"{x.hkey}.input_amax")
        if dynamic:
            out[x.hkey] = InputQuant(mode.mode, group=mode.group)
        elif q is not None and q.amax is not None:
            out[x.hkey] = _static(mode, q.amax)
    for info, _ in experts:
        for side, roles in (("gate_up", ("gate", "up")), ("down", ("down",))):
            qs = [info.input_q[e][r] for e in info.input_q for r in roles if r in info.input_q[e]]
            top = None if dynamic else _largest(qs)
            if not dynamic and top is None:
                continue
            iq = InputQuant(mode.mode, group=mode.group) if dynamic else _static(mode, top)
            for e in range(info.num_experts):
                out[f"{info.module_name}:{e}:{side}"] = iq
    return out
