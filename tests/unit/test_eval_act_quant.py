"""``qckpt eval``'s input quantization against independent references, bit for bit.

The references: compressed-tensors' own ``fake_quantize`` / dynamic scales where its
arithmetic is the serving kernels' (float32 inputs; a power-of-two static scale, where
dividing by the scale and multiplying by its reciprocal are the same), and for the rest the
kernels' formulas written out here as vLLM documents them (static FP8: times the reciprocal of
the scale; NVFP4: vLLM's ``ref_nvfp4_quant`` rounding thresholds)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from qckpt.evaluate.emulated import EmulatedLinear
from qckpt.formats.act_quant import InputQuant, quantize_input

FP8 = torch.float8_e4m3fn


def _activations(rows: int = 96, cols: int = 256, seed: int = 0) -> torch.Tensor:
    # heavy-tailed like a transformer's activations, with a few outlier channels and a zero row
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    x[:, 7] *= 40.0
    x[5] = 0.0
    return x.to(torch.bfloat16)


def _ct(args: dict) -> QuantizationArgs:
    return QuantizationArgs(**{"num_bits": 8, "type": "float", "symmetric": True, **args})


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (a - b).abs().max()


def test_fp8_static_equals_compressed_tensors_with_a_power_of_two_scale():
    x = _activations()
    scale = torch.tensor(2.0**-3)
    got = quantize_input(x, InputQuant("fp8_static", scale))
    ref = fake_quantize(x.float(), scale, None, _ct({"strategy": "tensor", "dynamic": False}))
    _same_bits(got, ref)


def test_fp8_static_multiplies_by_the_reciprocal_as_vllm_does():
    x = _activations(seed=1)
    scale = torch.tensor(float(x.float().abs().max()) / 448.0 * 0.37)  # clips the outliers
    inv = 1.0 / scale
    ref = (x.float() * inv).clamp(-448, 448).to(FP8).float() * scale
    got = quantize_input(x, InputQuant("fp8_static", scale))
    _same_bits(got, ref)
    assert int((got.abs() == 448 * scale).sum()) > 0  # some values saturated


def test_fp8_per_token_equals_compressed_tensors_dynamic_token():
    x = _activations(seed=2)[[i for i in range(96) if i != 5]]  # vLLM floors a zero row's scale
    args = _ct({"strategy": "token", "dynamic": True})
    x = x.reshape(5, 19, 256)  # compressed-tensors' token strategy reads [batch, seq, hidden]
    xf = x.float()
    scale, zp = compute_dynamic_scales_and_zp(xf, args, torch.nn.Module())
    _same_bits(quantize_input(x, InputQuant("fp8_token")), fake_quantize(xf, scale, zp, args))


def test_fp8_per_token_floors_a_zero_rows_scale():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 3] = 1e-30  # far below 448 * 512 * 2**-149: quantized to zero, not to a huge code
    got = quantize_input(x, InputQuant("fp8_token"))
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("group", [128, 64])
def test_fp8_per_group_equals_compressed_tensors_dynamic_group(group):
    x = _activations(seed=3)[[i for i in range(96) if i != 5]]
    args = _ct({"strategy": "group", "group_size": group, "dynamic": True})
    xf = x.float()
    scale, zp = compute_dynamic_scales_and_zp(xf, args, torch.nn.Module())
    got = quantize_input(x, InputQuant("fp8_group", group=group))
    _same_bits(got, fake_quantize(xf, scale, zp, args))


def _vllm_ref_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """vLLM's ``ref_nvfp4_quant`` + dequantize, written out: thresholds, not code counting."""
    m, n = x.shape
    b = x.float().reshape(m, n // 16, 16)
    vec_max = b.abs().amax(-1, keepdim=True)
    scale = (gs * (vec_max * (1 / 6.0))).clamp(-448, 448).to(FP8).float()
    inv_gs = 1.0 / gs
    denom = scale * inv_gs
    out_scale = 1.0 / (denom + (denom == 0) * 1e8)
    y = (b * out_scale).clamp(-6.0, 6.0)
    a, sign = y.abs(), torch.sign(y)
    q = torch.zeros_like(a)
    for lo, hi, v, lo_in, hi_in in [
        (0.25, 0.75, 0.5, False, False),
        (0.75, 1.25, 1.0, True, True),
        (1.25, 1.75, 1.5, False, False),
        (1.75, 2.5, 2.0, True, True),
        (2.5, 3.5, 3.0, False, False),
        (3.5, 5.0, 4.0, True, True),
    ]:
        above = a >= lo if lo_in else a > lo
        below = a <= hi if hi_in else a < hi
        q = torch.where(above & below, torch.full_like(a, v), q)
    q = torch.where(a > 5.0, torch.full_like(a, 6.0), q)
    return (q * sign * (scale / gs)).reshape(m, n)


def test_nvfp4_equals_vllms_reference_quantizer():
    x = _activations(seed=4)
    amax = float(x.float().abs().max())
    gs = torch.tensor(448.0 * 6.0 / amax, dtype=torch.float32)
    got = quantize_input(x, InputQuant("nvfp4", gs))
    ref = _vllm_ref_nvfp4(x, gs)
    assert torch.equal(got, ref)  # -0.0 == 0.0: the sign of a zero does not reach the GEMM
    assert len(torch.unique(got[0] / (got[0].abs().max()))) > 4  # real E2M1 levels


def test_nvfp4_is_close_to_compressed_tensors_fake_quantize():
    # compressed-tensors divides where the kernels multiply by reciprocals: a handful of
    # values round to the neighbouring E2M1 level, nothing more
    x = _activations(seed=5)
    gs = torch.tensor(448.0 * 6.0 / float(x.float().abs().max()), dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=4,
        type="float",
        symmetric=True,
        strategy="tensor_group",
        group_size=16,
        dynamic="local",
        scale_dtype=FP8,
    )
    xf = x.float()
    scale, zp = compute_dynamic_scales_and_zp(xf, args, torch.nn.Module(), global_scale=gs)
    ref = fake_quantize(xf, scale, zp, args, global_scale=gs)
    got = quantize_input(x, InputQuant("nvfp4", gs))
    assert (got == ref).float().mean() > 0.999


@pytest.mark.parametrize(
    "mode",
    [
        InputQuant("fp8_static", torch.tensor(0.0123)),
        InputQuant("fp8_token"),
        InputQuant("fp8_group", group=128),
        InputQuant("nvfp4", torch.tensor(1234.5)),
    ],
    ids=lambda q: q.mode,
)
def test_emulated_linear_is_one_fp32_gemm_of_the_quantized_input(mode):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = _activations(seed=7).reshape(2, 48, 256)
    lin = EmulatedLinear(w, None, mode)
    ref = torch.nn.functional.linear(quantize_input(x, mode), w).to(torch.bfloat16)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    plain = torch.nn.functional.linear(x.float(), w).to(torch.bfloat16)
    assert not torch.equal(got, plain)  # the input quantization did something


def test_int8_per_token_is_vllms_dynamic_int8_quant():
    """Per token: scale amax / 127, codes round-half-even of x * (127 / amax) saturated, as
    vLLM's ``dynamic_scaled_int8_quant`` (``cvt.rni.sat.s8.f32``); a zero token stays zero."""
    x = torch.tensor([[127.0, -63.5, 0.5, 1.5], [0.0, 0.0, 0.0, 0.0], [2.0, -2.0, 0.5, 0.0078125]])
    got = quantize_input(x, InputQuant("int8_token"))
    # row 0: scale 1, codes 127 -64 0 2 (ties to even); row 2: scale 2 / 127, x * 63.5
    assert got[0].tolist() == [127.0, -64.0, 0.0, 2.0]
    assert got[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    s = torch.tensor(2.0) / 127.0
    assert torch.equal(got[2], torch.tensor([127.0, -127.0, 32.0, 0.0]) * s)


def test_int8_static_saturates_at_the_code_range():
    """Static: round(x / s) saturated to -128..127 with the stored scale (vLLM's
    ``static_scaled_int8_quant``): values past the calibrated range clip."""
    x = torch.tensor([[1.0, -1.0, 300.0, -300.0, 0.25]], dtype=torch.bfloat16)
    got = quantize_input(x, InputQuant("int8_static", torch.tensor(0.5)))
    assert got.tolist() == [[1.0, -1.0, 63.5, -64.0, 0.0]]
