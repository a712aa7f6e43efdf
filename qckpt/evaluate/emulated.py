"""Modules that compute a quantized linear the way a serving kernel does.

A quantized GEMM multiplies codes and accumulates in float32, then applies the scales and
rounds once to the output dtype. Here the weight is held dequantized in float32 (code times
scale: exact in float32), the input is quantized by :mod:`qckpt.formats.act_quant` (also exact
float32 values), the product runs in float32 and is rounded once to the model dtype. What this
does not reproduce is a kernel's summation order (fp32 rounding, ~1e-7 relative).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qckpt.formats.act_quant import InputQuant, fp8_static
from qckpt.formats.scheme import FP8_MAX


class EmulatedLinear(nn.Module):
    """``nn.Linear`` with a dequantized float32 weight and an input quantizer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, inputs: InputQuant) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.float32), persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.float32), persistent=False
        )
        self.inputs = inputs
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(self.inputs(x), self.weight, self.bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, inputs {self.inputs.describe()}"


def emulated_experts_forward(
    mod: nn.Module,
    w13: torch.Tensor,
    w2: torch.Tensor,
    in13: list[InputQuant],
    in2: list[InputQuant],
) -> Callable:
    """A forward for transformers 5's fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]) with each expert's weights in float32 and its inputs quantized; otherwise the
    same loop as transformers' eager experts (same routing, same weighting, same sum)."""

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        num = w13.shape[0]
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=num + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == num:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            gate, up = nn.functional.linear(in13[e](x), w13[e]).to(x.dtype).chunk(2, dim=-1)
            h = mod.act_fn(gate) * up
            y = nn.functional.linear(in2[e](h), w2[e]).to(x.dtype)
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    return forward


def kv_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values through an FP8 KV cache with a static per-tensor scale: stored as
    ``e4m3(x / scale)``, read back times the scale (in the model dtype)."""
    s = scale.to(device=t.device, dtype=torch.float32)
    codes = (t.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.to(torch.float32) * s).to(t.dtype)


KV_ATTENTION = "qckpt_fp8_kv"


def register_kv_attention() -> str:
    """An attention implementation that sends keys and values through the FP8 KV cache of the
    module's ``qckpt_kv_scales`` (when set) before transformers' SDPA attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001
        scales = getattr(module, "qckpt_kv_scales", None)
        if scales is not None:
            key, value = kv_fp8(key, scales[0]), kv_fp8(value, scales[1])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(KV_ATTENTION, attention)
    return KV_ATTENTION


__all__ = [
    "EmulatedLinear",
    "emulated_experts_forward",
    "fp8_static",
    "kv_fp8",
    "register_kv_attention",
]
