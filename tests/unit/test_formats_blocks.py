"""mxfp8 / fp8_block / nvfp4: layout, padding, zero blocks, views, round trips, ops per format."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from qckpt.errors import FormatError
from qckpt.formats import FORMATS, QuantizedTensor, UnsupportedOpError, numerics, quantize

E4 = torch.float8_e4m3fn


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return a.fmt == b.fmt and all(
        torch.equal(
            u8(getattr(a, k)) if getattr(a, k).element_size() == 1 else getattr(a, k),
            u8(getattr(b, k)) if getattr(b, k).element_size() == 1 else getattr(b, k),
        )
        for k in a.spec.tensor_fields
    )


ALL = ["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]


def test_all_formats_registered() -> None:
    assert set(ALL) == set(FORMATS)


# ---- layouts and padding ----------------------------------------------------------------------


def test_mxfp8_layout_and_padding() -> None:
    x = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(0))
    q = quantize(x, "mxfp8")
    assert q.qdata.shape == (3, 5, 70) and q.qdata.dtype == E4
    assert q.scale.shape == (3, 5, 3) and q.scale.dtype == torch.uint8
    # padding rule: the partial block (6 elements) is scaled as if zero-padded to 32
    xp = F.pad(x, (0, 26))
    qp = quantize(xp, "mxfp8")
    assert torch.equal(q.scale, qp.scale)
    assert torch.equal(u8(q.qdata), u8(qp.qdata)[..., :70])
    # dequantize: code * 2**(scale - 127)
    e = q.scale.to(torch.int32) - 127
    s = torch.ldexp(torch.ones(e.shape), e).repeat_interleave(32, -1)[..., :70]
    assert torch.equal(q.dequantize(torch.float32), q.qdata.float() * s)


def test_mxfp8_zero_blocks_and_saturation() -> None:
    x = torch.zeros(2, 64)
    x[1, 32] = 1.0
    x[1, 33] = 1.9  # amax 1.9: e = 0 - 8, 1.9 * 256 = 486.4 saturates to 448
    q = quantize(x, "mxfp8")
    assert q.scale.tolist() == [[0, 0], [0, 119]]  # all-zero blocks: 2**-127, never NaN (255)
    d = q.dequantize(torch.float32)
    assert torch.all(d[0] == 0) and torch.all(d[1, :32] == 0)
    assert d[1, 32].item() == 1.0 and d[1, 33].item() == 448 / 256


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_mxfp8_round_trip_idempotent(hp: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 256, generator=g) * torch.logspace(-30, 30, 128).view(128, 1)
    x[5, :40] = 0
    q = quantize(x.to(hp), "mxfp8")
    for dt in (torch.float32, torch.bfloat16):
        q2 = quantize(q.dequantize(dt), "mxfp8")
        assert torch.equal(u8(q2.qdata), u8(q.qdata)) and torch.equal(q2.scale, q.scale)


def test_fp8_block_layout_padding_and_zero_tiles() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 260, generator=g)
    x[:128, :128] = 0  # an all-zero tile
    q = quantize(x, "fp8_block")
    assert q.scale.shape == (3, 3) and q.scale.dtype == torch.float32
    assert q.scale[0, 0].item() == 1.0
    for i in range(3):
        for j in range(3):
            t = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            if i or j:
                assert q.scale[i, j].item() == (t.abs().max() / 448).item()
    xp = F.pad(x, (0, 124, 0, 84))  # to 384 x 384: the same tiles, zero padded
    qp = quantize(xp, "fp8_block")
    assert torch.equal(q.scale, qp.scale)
    assert torch.equal(u8(q.qdata), u8(qp.qdata)[:300, :260])
    s = q.scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert torch.equal(q.dequantize(torch.float32), q.qdata.float() * s)
    # activations: 1 x 128
    a = quantize(x, "fp8_block", block_size=(1, 128))
    assert a.scale.shape == (300, 3)
    assert torch.equal(a.scale[5, 2], x[5, 256:].abs().max() / 448)


def test_fp8_block_batched_and_1d() -> None:
    x = torch.randn(4, 130, 200, generator=torch.Generator().manual_seed(3))
    q = quantize(x, "fp8_block")
    assert q.scale.shape == (4, 2, 2)
    for e in range(4):
        assert same(
            quantize(x[e], "fp8_block"),
            QuantizedTensor(
                {"qdata": q.qdata[e], "scale": q.scale[e]}, "fp8_block", q.opts, (130, 200), q.dtype
            ),
        )
    v = quantize(torch.arange(300.0), "fp8_block")
    assert v.scale.shape == (3,)
    assert torch.allclose(v.dequantize(torch.float32), torch.arange(300.0), rtol=2**-4)


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_fp8_block_pow2_round_trip(hp: torch.dtype) -> None:
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(4)) * 1e3
    q = quantize(x, "fp8_block", pow2_scale=True)
    q2 = quantize(q.dequantize(hp), "fp8_block", pow2_scale=True)
    assert torch.equal(u8(q2.qdata), u8(q.qdata)) and torch.equal(q2.scale, q.scale)


def test_nvfp4_layout_padding_and_zeros() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 37, generator=g)
    x[0, 0] = 0  # an all-zero row: its blocks get the floor scale 2**-6
    q = quantize(x, "nvfp4")
    assert q.qdata.shape == (3, 4, 19) and q.qdata.dtype == torch.uint8
    assert q.scale.shape == (3, 4, 3) and q.scale.dtype == E4
    assert q.global_scale.shape == () and q.global_scale.item() == pytest.approx(
        (x.abs().max() / 2688).item(), rel=1e-7
    )
    assert torch.all(q.scale[0, 0].float() == 2.0**-6)
    # odd K: the last byte's high nibble is +0
    assert torch.all((q.qdata[..., -1] >> 4) == 0)
    # padding rule = zero padding to a multiple of 16
    qp = quantize(F.pad(x, (0, 11)), "nvfp4")
    assert torch.equal(u8(q.scale), u8(qp.scale)) and torch.equal(q.qdata, qp.qdata[..., :19])
    # every scale positive and finite
    assert torch.all(q.scale.float() > 0) and torch.all(torch.isfinite(q.scale.float()))
    zero = quantize(torch.zeros(2, 32), "nvfp4")
    assert zero.global_scale.item() == 1.0 and torch.all(zero.qdata == 0)
    assert torch.all(zero.dequantize(torch.float32) == 0)


def test_nvfp4_error_bound() -> None:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    q = quantize(x, "nvfp4")
    d = q.dequantize(torch.float32)
    s = (q.scale.float() * q.global_scale).repeat_interleave(16, -1)
    # E2M1 step is at most 2 (between 4 and 6): |err| <= 1 * block scale
    assert torch.all((d - x).abs() <= s * 1.0 + 1e-12)


# ---- non-finite input, options ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_block_formats_refuse_non_finite(fmt: str, bad: float) -> None:
    x = torch.ones(4, 64)
    x[3, 63] = bad
    with pytest.raises(FormatError, match="NaN|Inf"):
        quantize(x, fmt)
    with pytest.raises(FormatError, match="NaN|Inf"):
        quantize(x.to(torch.bfloat16), fmt)


def test_nvfp4_given_amax_still_refuses_nan() -> None:
    x = torch.ones(2, 32)
    x[1, 1] = float("nan")
    with pytest.raises(FormatError, match="NaN"):
        quantize(x, "nvfp4", amax=1.0)


def test_bad_options() -> None:
    with pytest.raises(FormatError, match="block_size"):
        quantize(torch.ones(2, 32), "mxfp8", block_size=16)
    with pytest.raises(FormatError, match="amax"):
        quantize(torch.ones(2, 32), "mxfp8", amax=1.0)
    with pytest.raises(FormatError, match="unknown"):
        quantize(torch.ones(2, 32), "nvfp4", foo=1)
    with pytest.raises(FormatError, match="high-precision"):
        quantize(torch.ones(2, 32, dtype=torch.int32), "fp8")


# ---- views / ops per format ----------------------------------------------------------------


def test_mx_views_keep_last_dim_only() -> None:
    x = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(7))
    for fmt in ("mxfp8", "nvfp4"):
        q = quantize(x, fmt)
        ref = q.dequantize(torch.float32)
        for shape in [(24, 64), (1, 4, 6, 64), (2, 2, 6, 64)]:
            v = q.view(shape)
            assert isinstance(v, QuantizedTensor) and v.shape == shape
            assert v.qdata.untyped_storage().data_ptr() == q.qdata.untyped_storage().data_ptr()
            assert torch.equal(v.dequantize(torch.float32), ref.view(shape))
        assert torch.equal(q.view(1, 4, 6, 64)[0].dequantize(torch.float32), ref)
        with pytest.raises(UnsupportedOpError, match="last dim"):
            q.view(4, 6 * 64)
        with pytest.raises(UnsupportedOpError, match="last dim"):
            q.reshape(-1)
        with pytest.raises(NotImplementedError, match="transpose"):
            q.view(24, 64).t()


def test_fp8_block_views_and_transpose() -> None:
    x = torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(8))
    q = quantize(x, "fp8_block")
    ref = q.dequantize(torch.float32)
    assert torch.equal(q.view(1, 2, 256, 128).dequantize(torch.float32), ref.view(1, 2, 256, 128))
    with pytest.raises(UnsupportedOpError, match="last two dims"):
        q.view(512, 128)
    w = quantize(x[0], "fp8_block", block_size=(1, 128))
    wt = w.t()
    assert wt.opts["block_size"] == (128, 1)
    assert torch.equal(wt.dequantize(torch.float32), w.dequantize(torch.float32).t())


@pytest.mark.parametrize("fmt", ALL)
def test_parameter_linear_save_load_copy(fmt: str) -> None:
    torch.manual_seed(9)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    w = lin.weight.detach().clone()
    lin.weight = torch.nn.Parameter(quantize(w, fmt), requires_grad=False)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = lin(x)
    assert torch.equal(y, F.linear(x, lin.weight.dequantize(), lin.bias))
    rel = (y.float() - F.linear(x, w, lin.bias).float()).norm() / y.float().norm()
    assert rel < (0.2 if fmt == "nvfp4" else 0.06)

    buf = io.BytesIO()
    torch.save(lin.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert isinstance(sd["weight"], QuantizedTensor) and same(sd["weight"], lin.weight)

    # copy_: plain source -> quantize in place, fields keep their identity
    ptrs = {k: v.data_ptr() for k, v in lin.weight.fields().items()}
    src = torch.randn(32, 64, dtype=torch.bfloat16)
    lin.weight.copy_(src)
    assert {k: v.data_ptr() for k, v in lin.weight.fields().items()} == ptrs
    if fmt != "fp8_delayed":
        assert same(lin.weight, quantize(src, fmt))
    # same-format source: field copy
    other = quantize(torch.randn(32, 64), fmt)
    lin.weight.copy_(other)
    assert same(lin.weight, other)
    # clone / detach / to
    c = lin.weight.clone()
    assert same(c, lin.weight) and c.qdata.data_ptr() != lin.weight.qdata.data_ptr()
    assert same(lin.weight.detach(), lin.weight) and same(lin.weight.to("cpu"), lin.weight)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block", "nvfp4"])
def test_missing_op(fmt: str) -> None:
    q = quantize(torch.randn(4, 32), fmt)
    with pytest.raises(NotImplementedError, match=rf"aten\.mul\.Tensor.*{fmt}"):
        q * 2
    with pytest.raises(NotImplementedError, match="partial"):
        q[:2]


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_block", "nvfp4", "fp8"])
def test_chunk_boundaries(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:

    x = torch.randn(300, 200, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    ref = quantize(x, fmt)
    monkeypatch.setattr(numerics, "CHUNK_ELEMS", 1000)
    q = quantize(x, fmt)
    assert same(q, ref)
    assert torch.equal(q.dequantize(torch.float32), ref.dequantize(torch.float32))


def test_mxfp8_bf16_round_trip_exception_is_the_documented_one() -> None:
    # amax 2**-117: exponent -125; a code of 2**-9 is worth 2**-134, below bf16's smallest
    # subnormal (2**-133): bf16 flushes it (ties to even: 0), float32 keeps it
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 2.0**-117, 2.0**-134
    q = quantize(x, "mxfp8")
    assert q.scale.item() == 127 - 125 and q.qdata[0, 1].float().item() == 2.0**-9
    q32 = quantize(q.dequantize(torch.float32), "mxfp8")
    assert torch.equal(u8(q32.qdata), u8(q.qdata))
    q16 = quantize(q.dequantize(torch.bfloat16), "mxfp8")
    assert q16.qdata[0, 1].float().item() == 0.0 and torch.equal(q16.scale, q.scale)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("shape", [(), (0,), (0, 32), (5, 0), (1,), (3, 1, 1), (17,)])
def test_degenerate_shapes(fmt: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    q = quantize(x, fmt)
    d = q.dequantize(torch.float32)
    assert d.shape == x.shape
    if x.numel():
        assert torch.allclose(d, x, rtol=0.2, atol=1e-6 + 0.2 * x.abs().max().item())
    q.copy_(x)
    v = q.view((1, *shape))  # a prepended singleton (what a checkpoint unwrap undoes)
    assert torch.equal(v.dequantize(torch.float32), d.view((1, *shape)))
    assert torch.equal(v.view(shape).dequantize(torch.float32), d)


def test_mxfp8_rceil_no_saturation_but_not_idempotent() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 229.0 * 2**-7, 1.0
    q = quantize(x, "mxfp8", scale_rounding="rceil")
    assert q.scale.item() == 127 - 7  # ceil(log2(1.789 / 448)) = -7
    assert q.qdata[0, 0].float().item() == 224.0  # 229 rounds down to 224
    q2 = quantize(q.dequantize(torch.float32), "mxfp8", scale_rounding="rceil")
    assert q2.scale.item() == 127 - 8 and q2.qdata[0, 0].float().item() == 448.0
    assert torch.equal(q2.dequantize(torch.float32), q.dequantize(torch.float32))
    # FLOOR (the default) keeps it: floor(log2 1.789) - 8 = -8 both times
    f = quantize(x, "mxfp8")
    f2 = quantize(f.dequantize(torch.bfloat16), "mxfp8")
    assert torch.equal(f.scale, f2.scale) and torch.equal(u8(f.qdata), u8(f2.qdata))
    # RCEIL never saturates: amax / 2**e <= 448
    y = torch.randn(64, 256, generator=torch.Generator().manual_seed(12)) * 100
    qr = quantize(y, "mxfp8", scale_rounding="rceil")
    assert torch.all((qr.dequantize(torch.float32) - y).abs() <= y.abs() * 2**-4 + 1e-30)


def test_fp8_block_given_tile_amax() -> None:
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(13))
    own = quantize(x, "fp8_block")
    amax = own.scale * 448
    q = quantize(x, "fp8_block", amax=amax)  # the tiles' own amax: identical result
    assert same(q, own)
    half = quantize(x, "fp8_block", amax=amax / 2)  # a smaller calibrated amax saturates
    assert torch.equal(half.scale, own.scale / 2)
    assert half.qdata.float().abs().max().item() == 448.0
    with pytest.raises(FormatError, match="one value per tile"):
        quantize(x, "fp8_block", amax=torch.ones(3))
    x[5, 5] = float("nan")
    with pytest.raises(FormatError, match="NaN"):
        quantize(x, "fp8_block", amax=amax)
