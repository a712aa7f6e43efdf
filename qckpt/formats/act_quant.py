"""Input (activation) quantization as the serving kernels compute it, in float32.

Each function takes a linear's input in the model dtype and returns the values the GEMM sees:
the quantized codes times their scales, in float32 (exact: an FP8 / E2M1 code times an FP32
scale is representable there). The rounding conventions follow vLLM's CUDA kernels and its
NVFP4 reference (``csrc/quantization/fp8/common.cu``, ``nvfp4_emulation_utils.ref_nvfp4_quant``):

* FP8 static per-tensor: ``code = e4m3(clamp(x * (1 / s), +-448))``: vLLM inverts the scale
  once and multiplies (``scaled_fp8_quant_kernel``); ``s`` is the stored ``input_scale``.
* FP8 dynamic per-token: ``s = max(amax_token / 448, 1 / (448 * 512))``, ``code = e4m3(x / s)``
  (``dynamic_per_token_scaled_fp8_quant_kernel``: a division, to match FBGEMM).
* FP8 dynamic per-tensor: ``s = amax / 448`` over the whole call's input, then as static.
* FP8 dynamic per-group (``strategy: group``): ``s = max(amax_group, 1e-10) / 448``,
  ``code = e4m3(clamp(x / s, +-448))`` (``per_token_group_quant_fp8``).
* NVFP4 (16-element blocks under a static global scale ``g``, in the convention where it
  multiplies the block scale: compressed-tensors' ``input_global_scale``, or ``1 / input_scale``
  of ModelOpt): ``sb = e4m3(clamp(g * (amax_block * (1/6)), +-448))``,
  ``code = e2m1(clamp(x * (1 / (sb * (1 / g))), +-6))`` (ties to even), value ``code * (sb / g)``.

* INT8 static per-tensor: ``code = round(x / s)`` saturated to -128..127 (ties to even: the
  kernels' ``cvt.rni.sat.s8.f32``), ``s`` the stored ``input_scale``
  (``static_scaled_int8_quant``).
* INT8 dynamic per-token: ``s = amax_token / 127``, ``code = round(x * (127 / amax_token))``
  saturated, 0 for an all-zero token (``dynamic_scaled_int8_quant``).
* MXFP8 dynamic per 32: E4M3 under the block's E8M0 scale, by the export's rule for weights
  (:mod:`qckpt.formats.mx_codes`; what llm-compressor's fake quantization computes).

E4M3 rounding is torch's ``.to(float8_e4m3fn)`` (round to nearest even) after the clamp, as the
kernels saturate before they convert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qckpt.formats.nvfp4 import e2m1_codes, e2m1_values

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
# vLLM's floor of a dynamic per-token scale (min_scaling_factor<fp8_e4m3>)
PER_TOKEN_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# vLLM's floor of a per-group amax (per_token_group_quant_fp8's eps)
GROUP_EPS = 1e-10

INT8_RANGE = (-128, 127)
MODES = (
    "none",
    "fp8_static",
    "fp8_token",
    "fp8_tensor_dynamic",
    "fp8_group",
    "nvfp4",
    "int8_static",
    "int8_token",
    "mxfp8",
)
# the modes whose scale is made per call, with no calibrated value
DYNAMIC_MODES = frozenset({"fp8_token", "fp8_tensor_dynamic", "fp8_group", "int8_token", "mxfp8"})


@dataclass(frozen=True)
class InputQuant:
    """How one linear's input is quantized. ``scale``: the static FP8 scale or NVFP4's global
    scale (multiplying convention, float32), None for the dynamic modes."""

    mode: str  # one of MODES
    scale: torch.Tensor | None = None
    group: int = 0  # fp8_group: group size along the last dim

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown input quantization {self.mode!r}")

    def describe(self) -> str:
        return {
            "none": "unquantized",
            "fp8_static": "fp8 static per-tensor",
            "fp8_token": "fp8 dynamic per-token",
            "fp8_tensor_dynamic": "fp8 dynamic per-tensor",
            "fp8_group": f"fp8 dynamic per-group {self.group}",
            "nvfp4": "nvfp4 per-16 under a static global scale",
            "int8_static": "int8 static per-tensor",
            "int8_token": "int8 dynamic per-token",
            "mxfp8": "mxfp8 dynamic per-32",
        }[self.mode]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_input(x, self)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``x`` (never ``x`` itself: the callers work on it in place)."""
    return x.to(torch.float32, copy=True)


def _e4m3_(y: torch.Tensor) -> torch.Tensor:
    """``y`` (a float32 temporary, clamped in place) rounded to E4M3, as float32."""
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32)


def fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.to(device=x.device, dtype=torch.float32).reshape(())
    inv = torch.ones((), dtype=torch.float32, device=x.device) / s
    return _e4m3_(_f32(x).mul_(inv)).mul_(s)


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    xf = _f32(x)
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(PER_TOKEN_MIN_SCALE)
    return _e4m3_(xf.div_(s)).mul_(s)


def fp8_dynamic_tensor(x: torch.Tensor) -> torch.Tensor:
    s = _f32(x).abs().amax() / FP8_MAX
    return fp8_static(x, s) if float(s) > 0 else _f32(x)


def fp8_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    xf = _f32(x)
    if xf.shape[-1] % group:
        raise ValueError(f"input dim {xf.shape[-1]} is not a multiple of the group {group}")
    g = xf.unflatten(-1, (xf.shape[-1] // group, group))
    s = g.abs().amax(dim=-1, keepdim=True).clamp_min(GROUP_EPS) / FP8_MAX
    return _e4m3_(g.div_(s)).mul_(s).flatten(-2)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    # vLLM's get_reciprocal: 1 / x, and a huge divisor (a ~zero result) where x is 0
    return 1.0 / (x + (x == 0) * 1e8)


def nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    xf = _f32(x)
    if xf.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"input dim {xf.shape[-1]} is not a multiple of {NVFP4_BLOCK}")
    g = global_scale.to(device=x.device, dtype=torch.float32).reshape(())
    b = xf.unflatten(-1, (xf.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK))
    amax = b.abs().amax(dim=-1, keepdim=True)
    sb = (g * (amax * (1.0 / FP4_MAX))).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32)
    inv = _reciprocal(sb * _reciprocal(g))
    codes = e2m1_codes(b.mul_(inv).clamp_(-FP4_MAX, FP4_MAX))
    return e2m1_values(codes).mul_(sb / g).flatten(-2)


def _int8_(y: torch.Tensor) -> torch.Tensor:
    """``y`` (a float32 temporary) rounded to int8 codes in place, ties to even, saturated."""
    return torch.round(y, out=y).clamp_(*INT8_RANGE)


def int8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return _int8_(_f32(x).div_(s)).mul_(s)


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    xf = _f32(x)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # both quotients correctly rounded (in float64, rounded once): the same bits on every device
    a64 = amax.to(torch.float64)
    s = (a64 / 127.0).to(torch.float32)
    inv = torch.where(amax > 0, (127.0 / a64).to(torch.float32), torch.zeros_like(amax))
    return _int8_(xf.mul_(inv)).mul_(s)


def quantize_input(x: torch.Tensor, q: InputQuant) -> torch.Tensor:
    """``x`` as the GEMM of a client running ``q`` sees it, in float32."""
    if q.mode == "none":
        return _f32(x)
    if q.mode == "fp8_static":
        assert q.scale is not None
        return fp8_static(x, q.scale)
    if q.mode == "fp8_token":
        return fp8_per_token(x)
    if q.mode == "fp8_tensor_dynamic":
        return fp8_dynamic_tensor(x)
    if q.mode == "fp8_group":
        return fp8_per_group(x, q.group)
    if q.mode == "int8_token":
        return int8_per_token(x)
    if q.mode == "mxfp8":
        from qckpt.formats.mx_codes import mxfp8_input

        return mxfp8_input(x)
    assert q.scale is not None
    if q.mode == "int8_static":
        return int8_static(x, q.scale)
    return nvfp4(x, q.scale)
