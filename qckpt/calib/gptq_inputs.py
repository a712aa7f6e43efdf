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

from qckpt.errors import CalibrationError, FormatError
from qckpt.formats.act_quant import DYNAMIC_MODES, MODES, InputQuant
from qckpt.formats.numerics import div_f32, f64_const
from qckpt.formats.scheme import Scheme

SOURCE, QUANTIZED = "source", "quantized"
MIN_AMAX = 1e-12  # the export's clamp (qckpt.layouts.export_layout.MIN_AMAX)


@dataclass(frozen=True)
class InputMode:
    """How the export's clients quantize one linear's inputs (a module's input scheme)."""

    mode: str  # an act_quant mode (qckpt.formats.act_quant.MODES)
    group: int = 0  # fp8_group: the group width
    scale_dtype: torch.dtype = torch.float32  # fp8_static: the stored input_scale's dtype
    # a static scale is amax / qmax; ``reciprocal``: clients take its float32 reciprocal
    # (NVFP4's global scale), else the scale stored in ``scale_dtype`` (FP8 per tensor)
    qmax: float = 1.0
    reciprocal: bool = False

    @property
    def dynamic(self) -> bool:
        return self.mode in DYNAMIC_MODES

    @property
    def quantized(self) -> bool:
        return self.mode != "none"


def input_mode(scheme: Scheme, scale_dtype: torch.dtype) -> InputMode:
    """The mode of an input ``scheme`` (a quantizer's, or a recipe entry's inputs), as the
    export layouts write it; CalibrationError for one they do not."""
    try:
        mode = scheme.input_mode()
    except FormatError:
        mode = None
    if mode is None or mode not in _KNOWN:
        raise CalibrationError(
            f"calibrate.gptq_inputs: quantized does not know the clients' quantization of "
            f"{scheme.describe()} inputs; use calibrate.gptq_inputs: source"
        )
    if not scheme.quantized:
        return InputMode(mode)
    if scheme.dynamic:
        group = int(scheme.block[-1]) if scheme.granularity == "block" else 0
        return InputMode(mode, group)
    # a static scale: NVFP4's global (its block scales are made per 16 when quantizing) is
    # read as a reciprocal, FP8's and INT8's per-tensor scale as stored
    reciprocal = bool(scheme.group)
    dtype = torch.float32 if reciprocal else scale_dtype
    return InputMode(mode, 0, dtype, qmax=scheme.qmax, reciprocal=reciprocal)


# the act_quant modes whose scales this module derives (or which need none): all but the
# per-tensor dynamic FP8 that no export layout writes
_KNOWN = tuple(m for m in MODES if m != "fp8_tensor_dynamic")


def _static(mode: InputMode, amax: torch.Tensor) -> InputQuant:
    a = amax.detach().to(device="cpu", dtype=torch.float32).reshape(()).clamp_min(MIN_AMAX)
    s = div_f32(a, f64_const(mode.qmax, a.device))
    if mode.reciprocal:
        return InputQuant(mode.mode, (1.0 / s.to(torch.float64)).to(torch.float32))
    return InputQuant(mode.mode, s.to(mode.scale_dtype).to(torch.float32))


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


def layer_input_quants(instr, lin, experts, scale_dtype: torch.dtype) -> LayerInputs:
    """Each GPTQ Hessian key of the layer (``_Linear.hkey``) -> its inputs' quantization, by
    each module's own input scheme; a static one whose input was never calibrated (no token
    reached it) has none, nor has an unquantized one."""
    out = LayerInputs()
    for x in lin:
        if ":" in x.hkey:
            continue
        q = instr.quantizers.get(f"{x.hkey}.input_amax")
        if q is None:
            continue
        mode = input_mode(q.scheme, scale_dtype)
        if not mode.quantized:
            continue
        if mode.dynamic:
            out[x.hkey] = InputQuant(mode.mode, group=mode.group)
        elif q.amax is not None:
            out[x.hkey] = _static(mode, q.amax)
    for info, _ in experts:
        for side, roles in (("gate_up", ("gate", "up")), ("down", ("down",))):
            qs = [info.input_q[e][r] for e in info.input_q for r in roles if r in info.input_q[e]]
            if not qs:
                continue
            mode = input_mode(qs[0].scheme, scale_dtype)  # one scheme per experts module
            if not mode.quantized:
                continue
            top = None if mode.dynamic else _largest(qs)
            if not mode.dynamic and top is None:
                continue
            iq = InputQuant(mode.mode, group=mode.group) if mode.dynamic else _static(mode, top)
            for e in range(info.num_experts):
                out[f"{info.module_name}:{e}:{side}"] = iq
    return out
