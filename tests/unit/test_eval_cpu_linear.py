"""``qckpt eval`` computes BF16 / FP16 linears on the CPU in float32 with one rounding of the
output (a BF16 GEMM there is several times slower); nothing else changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qckpt.evaluate.cpu_linear import half_linears_in_float32
from qckpt.formats import quantize

CPU = torch.device("cpu")


def _lin(dtype: torch.dtype) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 48).to(dtype)


def test_a_bf16_linear_is_its_float32_product_rounded_once():
    lin = _lin(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    with torch.no_grad(), half_linears_in_float32(CPU):
        got = lin(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # outside the block the BF16 GEMM runs as before (its own rounding of partial sums)
    with torch.no_grad():
        assert lin(x).dtype == torch.bfloat16


def test_float32_linears_mixed_dtypes_and_other_devices_are_untouched():
    lin = _lin(torch.float32)
    x = torch.randn(5, 64)
    with torch.no_grad(), half_linears_in_float32(CPU):
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    # a device other than the CPU: the mode is not entered at all
    with half_linears_in_float32(torch.device("meta")):
        assert not torch.overrides._is_torch_function_mode_enabled()


def test_a_quantized_weight_keeps_its_own_handlers():
    lin = _lin(torch.bfloat16)
    q = quantize(lin.weight.detach(), "fp8")
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = F.linear(x, q, None)
        with half_linears_in_float32(CPU):
            got = F.linear(x, q, None)
    assert torch.equal(got, want)
