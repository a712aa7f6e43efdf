"""Bit-for-bit comparison with reference implementations nobody here wrote.

* mxfp8 and nvfp4 against torchao's MX / NVFP4 reference code (``to_mx`` FLOOR mode,
  ``to_dtype``, ``nvfp4_quantize`` with a per-tensor scale, ``NVFP4Tensor.dequantize``).
* fp8 (tensor, channel) and fp8_block against compressed-tensors' ``calculate_qparams`` +
  ``quantize`` (what vLLM / transformers expect a compressed-tensors checkpoint to hold).

Deliberate differences are tested explicitly (see the mxfp8 module docstring).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from qckpt.formats import numerics, quantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

E4 = torch.float8_e4m3fn
E5 = torch.float8_e5m2


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@functools.cache
def _inputs(dtype: torch.dtype, k: int = 256) -> dict[str, torch.Tensor]:
    """Random, skewed and edge-case inputs, all with a last dim divisible by 32."""
    g = torch.Generator().manual_seed(1234)
    rnd = torch.randn(64, k, generator=g)
    skew = rnd * torch.logspace(-20, 20, 64).view(64, 1)  # rows 40 decades apart
    heavy = torch.distributions.StudentT(1.5).sample((64, k))  # heavy tails
    outlier = rnd.clone()
    outlier[::7, 3] = 3e4
    edge = torch.zeros(8, k)
    edge[1, :16] = 1.0  # a block with half zeros
    edge[2] = torch.tensor([448.0, 449.0, 464.0, 480.0, 512.0, 1e6, -1e6, 0.0] * (k // 8))
    edge[3] = 2.0**-130  # subnormal float32 (bf16 too)
    edge[4] = torch.linspace(-1, 1, k) * 2.0**-120
    edge[5, ::2] = -0.0
    edge[6] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (k // 8))  # E2M1 ties
    edge[7] = torch.tensor([1.0 + 2**-4, 1.0 + 3 * 2**-4, 17.0, 19.0] * (k // 4))  # E4M3 ties
    out = {"random": rnd, "skewed": skew, "heavy": heavy, "outlier": outlier, "edge": edge}
    return {n: t.to(dtype) for n, t in out.items()}


CASES = [(d, n) for d in (torch.float32, torch.bfloat16) for n in _inputs(torch.float32)]


# ---- mxfp8 vs torchao to_mx (FLOOR) -------------------------------------------------------


@pytest.mark.parametrize("elem", [E4, E5])
@pytest.mark.parametrize("dtype,name", CASES)
def test_mxfp8_matches_torchao(elem: torch.dtype, dtype: torch.dtype, name: str) -> None:
    x = _inputs(dtype)[name]
    q = quantize(x, "mxfp8", dtype=elem)
    ref_s, ref_d = mx.to_mx(x, elem, 32, scaling_mode=mx.ScaleCalculationMode.FLOOR)
    ref_s = u8(ref_s).view(q.scale.shape)
    assert torch.equal(q.scale, ref_s)
    # blocks whose exponent clamps to -127 are the one documented difference (next test)
    same = (q.scale != 0).repeat_interleave(32, dim=-1)
    assert torch.equal(u8(q.qdata)[same], u8(ref_d)[same])
    assert int(same.sum()) > 0 or name == "edge"
    # dequantize agrees with torchao's to_dtype wherever the codes agree
    ref_hp = mx.to_dtype(ref_d, ref_s.view(torch.float8_e8m0fnu), elem, 32, torch.float32)
    assert torch.equal(q.dequantize(torch.float32)[same], ref_hp[same])


@pytest.mark.parametrize("elem", [E4, E5])
@pytest.mark.parametrize("dtype,name", CASES)
def test_mxfp8_rceil_matches_torchao(elem: torch.dtype, dtype: torch.dtype, name: str) -> None:
    x = _inputs(dtype)[name]
    q = quantize(x, "mxfp8", dtype=elem, scale_rounding="rceil")
    ref_s, ref_d = mx.to_mx(x, elem, 32, scaling_mode=mx.ScaleCalculationMode.RCEIL)
    assert torch.equal(q.scale, u8(ref_s).view(q.scale.shape))
    # blocks clamped to code 0: torchao multiplies by 1.0 there (documented difference)
    same = (q.scale != 0).repeat_interleave(32, dim=-1)
    assert torch.equal(u8(q.qdata)[same], u8(ref_d)[same])


def test_mxfp8_tiny_block_difference_is_documented() -> None:
    # amax < 2**-119: both store E8M0 code 0 (2**-127); torchao divides by 2**-126 (its FP32
    # scale floor), we by the stored 2**-127, so our codes dequantize to the input
    x = (torch.linspace(-1, 1, 32) * 2.0**-122).view(1, 32)
    q = quantize(x, "mxfp8")
    ref_s, ref_d = mx.to_mx(x, E4, 32)
    assert q.scale.item() == 0 and u8(ref_s).item() == 0
    ours = (x * 2.0**127).clamp(-448, 448).to(E4)
    theirs = (x / 2.0**-126).clamp(-448, 448).to(E4)
    assert torch.equal(u8(q.qdata), u8(ours)) and torch.equal(u8(ref_d), u8(theirs))
    assert not torch.equal(u8(ours), u8(theirs))
    assert torch.allclose(q.dequantize(torch.float32), x, rtol=2**-3, atol=0)
    # all-zero block: identical (code 0, zero elements)
    z = torch.zeros(2, 64)
    qz = quantize(z, "mxfp8")
    rs, rd = mx.to_mx(z, E4, 32)
    assert torch.equal(qz.scale, u8(rs).view(2, 2)) and torch.equal(u8(qz.qdata), u8(rd))


def test_mxfp8_3d_and_chunked_match_torchao(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(numerics, "CHUNK_ELEMS", 100)  # many row chunks
    x = torch.randn(4, 6, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = quantize(x, "mxfp8")
    rs, rd = mx.to_mx(x, E4, 32)
    assert torch.equal(q.scale, u8(rs).view(4, 6, 3)) and torch.equal(u8(q.qdata), u8(rd))


# ---- nvfp4 vs torchao nvfp4_quantize with a per-tensor scale ---------------------------------


def _nv_ref(x: torch.Tensor, amax: torch.Tensor | None = None):  # noqa: ANN202
    a = x.abs().amax().float() if amax is None else amax
    pts = nv.per_tensor_amax_to_scale(a)
    s, d = nv.nvfp4_quantize(x.reshape(-1, x.shape[-1]), 16, pts)
    return pts, s, d


@pytest.mark.parametrize("dtype,name", CASES)
def test_nvfp4_matches_torchao(dtype: torch.dtype, name: str) -> None:
    x = _inputs(dtype)[name]
    q = quantize(x, "nvfp4")
    pts, s, d = _nv_ref(x)
    assert torch.equal(q.global_scale, pts)
    assert q.scale.dtype == E4 and q.qdata.dtype == torch.uint8
    assert torch.equal(u8(q.scale), u8(s).view(q.scale.shape))
    assert torch.equal(q.qdata, d.view(torch.uint8).view(q.qdata.shape))
    t = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
    assert torch.equal(q.dequantize(torch.float32), t.dequantize(torch.float32))


def test_nvfp4_given_amax_matches_torchao() -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    amax = torch.tensor(1.5)  # below the data's amax: saturation
    q = quantize(x, "nvfp4", amax=amax)
    pts, s, d = _nv_ref(x, amax)
    assert torch.equal(q.global_scale, pts)
    assert torch.equal(u8(q.scale), u8(s).view(q.scale.shape))
    assert torch.equal(q.qdata, d.view(torch.uint8))


def test_nvfp4_packing_low_nibble_first() -> None:
    x = torch.tensor([[6.0, -0.5] + [0.0] * 14])  # amax 6: gs = 6/2688, block scale 448
    q = quantize(x, "nvfp4")
    assert u8(q.scale).item() == u8(torch.tensor([448.0]).to(E4)).item()
    # element 0 = +6 (code 7) in the low nibble, element 1 = -0.5 (code 9) in the high one
    assert q.qdata[0, 0].item() == 0x97
    assert q.qdata[0, 1:].tolist() == [0] * 7


# ---- fp8 / fp8_block vs compressed-tensors ---------------------------------------------------

ct = pytest.importorskip("compressed_tensors.quantization")


def _ct_args(strategy: str, **kw):  # noqa: ANN001, ANN202
    return ct.QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **kw)


@pytest.mark.parametrize("dtype,name", CASES)
def test_fp8_tensor_and_channel_match_compressed_tensors(dtype: torch.dtype, name: str) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    x = _inputs(dtype)[name].clone()
    if not bool((x != 0).any(dim=1).all()):
        x = x + (x == 0).all(dim=1, keepdim=True) * 1.0  # CT gives NaN scales for zero rows
    for strategy, g in (("tensor", "tensor"), ("channel", "channel")):
        args = _ct_args(strategy)
        if g == "tensor":
            mn, mx_ = x.float().amin().reshape(1), x.float().amax().reshape(1)
        else:
            mn, mx_ = x.float().amin(dim=1, keepdim=True), x.float().amax(dim=1, keepdim=True)
        scale, zp = calculate_qparams(mn, mx_, args)
        ref = ct.quantize(x.float(), scale, zp, args, dtype=E4)
        q = quantize(x, "fp8", granularity=g)
        qs = q.scale.reshape(scale.shape)
        # deliberate difference: a scale below float32's smallest normal is raised to it
        # (CT keeps the subnormal scale); only rows of amax < 448 * 2**-126 are affected
        tiny = scale.float() < torch.finfo(torch.float32).tiny
        assert torch.all(qs[tiny] == torch.finfo(torch.float32).tiny)
        assert torch.equal(qs[~tiny], scale.float()[~tiny])
        rows = ~tiny.reshape(-1) if g == "channel" else slice(None)
        if g == "tensor" and bool(tiny.any()):
            return
        assert torch.equal(u8(q.qdata)[rows], u8(ref)[rows])


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 128)])
def test_fp8_block_matches_compressed_tensors(shape: tuple[int, int]) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9))
    x = x * torch.logspace(-2, 2, shape[0]).view(-1, 1)
    args = _ct_args("block", block_structure=[128, 128])
    q = quantize(x, "fp8_block")
    # CT's block amax: per 128x128 tile (partial edge tiles cover the valid elements)
    r, c = -(-shape[0] // 128), -(-shape[1] // 128)
    amax = torch.zeros(r, c)
    for i in range(r):
        for j in range(c):
            amax[i, j] = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
    scale, zp = calculate_qparams(-amax, amax, args)
    assert torch.equal(q.scale, scale.float())
    ref = ct.quantize(x, scale, zp, args, dtype=E4)
    assert torch.equal(u8(q.qdata), u8(ref))


# ---- the MXFP4 export's codes vs torchao to_mx (EVEN) ---------------------------------------


@pytest.mark.parametrize("dtype,name", CASES)
def test_mxfp4_export_codes_match_torchao_even(dtype: torch.dtype, name: str) -> None:
    """qckpt.formats.mx_codes (what the MXFP4 export writes) is torchao's ``to_mx`` with
    ``ScaleCalculationMode.EVEN`` bit for bit: the E8M0 scales and the packed E2M1 codes,
    edge cases included (zeros, tiny and huge blocks); its values are torchao's ``to_dtype``."""
    from qckpt.formats.mx_codes import mx_quantize, mxfp4_values

    x = _inputs(dtype)[name].reshape(-1, 256)
    packed, scale = mx_quantize(x, 4)
    ref_s, ref_d = mx.to_mx(
        x.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=mx.ScaleCalculationMode.EVEN
    )
    assert torch.equal(scale, u8(ref_s).view(scale.shape))
    # blocks whose exponent clamps to -127: torchao divides by 2**-126, as the export does
    assert torch.equal(packed, u8(ref_d).view(packed.shape))
    ref_hp = mx.to_dtype(ref_d, ref_s, torch.float4_e2m1fn_x2, 32, torch.float32)
    assert torch.equal(mxfp4_values(packed, scale), ref_hp.reshape(x.shape))
