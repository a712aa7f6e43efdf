"""fp8 / fp8_delayed: scales, codes, edge cases, round trips, delayed-scaling state."""

from __future__ import annotations

import pytest
import torch

from qckpt.errors import FormatError
from qckpt.formats import FORMATS, QuantizedTensor, is_quantized, numerics, quantize
from tests._bits import bits

E4 = torch.float8_e4m3fn
E5 = torch.float8_e5m2


def test_formats_listed() -> None:
    assert {"fp8", "fp8_delayed"} <= set(FORMATS)


@pytest.mark.parametrize("dtype,fmax", [(E4, 448.0), (E5, 57344.0)])
def test_fp8_tensor_scale_and_codes(dtype: torch.dtype, fmax: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 19) * 3
    q = quantize(x, "fp8", dtype=dtype)
    amax = x.abs().max()
    assert q.scale.dtype == torch.float32 and q.scale.shape == ()
    assert q.scale.item() == pytest.approx((amax / fmax).item(), rel=0, abs=0)
    expect = (x / (amax / fmax)).clamp(-fmax, fmax).to(dtype)
    assert torch.equal(bits(q.qdata), bits(expect))
    # the element holding amax maps to +-fmax exactly
    assert q.qdata.float().abs().max().item() == fmax
    assert q.dtype == torch.float32 and q.shape == x.shape and is_quantized(q)


def test_fp8_channel() -> None:
    torch.manual_seed(1)
    x = torch.randn(8, 5, 3) * torch.arange(1, 9).view(8, 1, 1)
    q = quantize(x, "fp8", granularity="channel")
    assert q.scale.shape == (8, 1, 1)
    amax = x.abs().amax(dim=(1, 2))
    assert torch.equal(q.scale.flatten(), amax / 448.0)
    expect = (x / q.scale).clamp(-448, 448).to(E4)
    assert torch.equal(bits(q.qdata), bits(expect))
    d = q.dequantize(torch.float32)
    assert torch.all((d - x).abs() <= amax.view(8, 1, 1) * 2**-4)


def test_zero_tensor_and_zero_rows_have_unit_scale() -> None:
    q = quantize(torch.zeros(4, 4), "fp8")
    assert q.scale.item() == 1.0 and torch.all(q.qdata.float() == 0)
    x = torch.zeros(3, 4)
    x[1] = 2.0
    qc = quantize(x, "fp8", granularity="channel")
    assert torch.equal(qc.scale.flatten(), torch.tensor([1.0, 2.0 / 448, 1.0]))
    assert torch.equal(qc.dequantize(torch.float32), x)


def test_saturation_with_given_amax() -> None:
    x = torch.tensor([0.5, -1.0, 4.0, -100.0])
    q = quantize(x, "fp8", amax=1.0)
    assert q.scale.item() == pytest.approx(1.0 / 448)
    assert q.dequantize(torch.float32).tolist() == pytest.approx([0.5, -1.0, 1.0, -1.0], rel=2**-4)
    assert q.qdata.float().abs().max().item() == 448.0


def test_subnormal_codes() -> None:
    # scale 1: values in the E4M3 subnormal range (< 2**-6) keep their subnormal codes
    x = torch.tensor([448.0, 2.0**-7, 2.0**-9, 2.0**-11])
    q = quantize(x, "fp8")
    assert q.scale.item() == 1.0
    assert q.dequantize(torch.float32).tolist() == [448.0, 2.0**-7, 2.0**-9, 0.0]
    # the smallest subnormal is code 0x01
    assert bits(q.qdata)[2].item() == 0x01


@pytest.mark.parametrize("bad,name", [(float("nan"), "NaN"), (float("inf"), "Inf")])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_delayed"])
def test_refuses_non_finite(bad: float, name: str, fmt: str) -> None:
    x = torch.ones(5, 5)
    x[2, 3] = bad
    with pytest.raises(FormatError, match=name):
        quantize(x, fmt)
    with pytest.raises(FormatError, match=name):
        quantize(x, fmt, amax=1.0)
    if fmt == "fp8":
        with pytest.raises(FormatError, match=name):
            quantize(x, fmt, granularity="channel")


def test_refuses_bad_options() -> None:
    with pytest.raises(FormatError, match="unknown"):
        quantize(torch.ones(2), "fp8", blocks=3)
    with pytest.raises(FormatError, match="unknown quantization format"):
        quantize(torch.ones(2), "int3")
    with pytest.raises(FormatError, match="granularity"):
        quantize(torch.ones(2), "fp8", granularity="row")


def test_chunked_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    x = torch.randn(50, 33)
    ref_t = quantize(x, "fp8")
    ref_c = quantize(x, "fp8", granularity="channel")

    monkeypatch.setattr(numerics, "CHUNK_ELEMS", 100)
    for ref, g in [(ref_t, "tensor"), (ref_c, "channel")]:
        q = quantize(x, "fp8", granularity=g)
        assert torch.equal(bits(q.qdata), bits(ref.qdata)) and torch.equal(q.scale, ref.scale)
        assert torch.equal(q.dequantize(torch.float32), ref.dequantize(torch.float32))


@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("g", ["tensor", "channel"])
def test_pow2_round_trip_bit_exact(dtype: torch.dtype, g: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 48) * torch.logspace(-3, 3, 64).view(64, 1)
    q = quantize(x, "fp8", dtype=dtype, granularity=g, pow2_scale=True)
    # power-of-two scales: 2**(floor(log2 amax) - emax)
    m, e = torch.frexp(q.scale)
    assert torch.all(m == 0.5)
    for hp in (torch.float32, torch.bfloat16):
        q2 = quantize(q.dequantize(hp), "fp8", dtype=dtype, granularity=g, pow2_scale=True)
        assert torch.equal(bits(q2.qdata), bits(q.qdata))
        assert torch.equal(q2.scale, q.scale)


def test_pow2_edge_that_ceil_rule_breaks() -> None:
    # amax / 2**ceil(log2(amax/448)) in (224, 232) rounds to code 224: the floor rule keeps it
    x = torch.tensor([229.0, 1.0, -3.0])
    q = quantize(x, "fp8", pow2_scale=True)
    assert q.scale.item() == 2.0**-1  # floor(log2 229) = 7, 7 - 8 = -1
    q2 = quantize(q.dequantize(torch.bfloat16), "fp8", pow2_scale=True)
    assert torch.equal(bits(q2.qdata), bits(q.qdata)) and torch.equal(q2.scale, q.scale)


def test_default_scale_round_trip_codes_fp32() -> None:
    torch.manual_seed(4)
    x = torch.randn(128, 64)
    q = quantize(x, "fp8")
    q2 = quantize(q.dequantize(torch.float32), "fp8")
    assert torch.equal(bits(q2.qdata), bits(q.qdata))
    assert (q2.scale - q.scale).abs().item() <= q.scale.item() * 2**-22


# ---- fp8_delayed ----------------------------------------------------------------------------


def test_delayed_initial_and_update() -> None:
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    q = quantize(x, "fp8_delayed", history_len=4)
    assert q.amax_history.tolist() == [4.0, 0.0, 0.0, 0.0]
    assert q.scale.item() == pytest.approx(4.0 / 448)
    assert torch.equal(q.dequantize(torch.float32), x)
    # quantize_ uses the current scale: 8.0 saturates to 4.0, then the amax is recorded
    y = torch.tensor([[8.0, 1.0], [0.0, 0.0]])
    q.quantize_(y)
    assert q.dequantize(torch.float32)[0, 0].item() == 4.0
    assert q.amax_history.tolist() == [8.0, 4.0, 0.0, 0.0]
    assert q.scale.item() == pytest.approx(4.0 / 448)  # the codes' scale
    assert q.quant_scale.item() == pytest.approx(8.0 / 448)  # the next quantize_'s scale
    q.quantize_(y * 0.25)
    assert q.dequantize(torch.float32).tolist() == [[2.0, 0.25], [0.0, 0.0]]
    assert q.amax_history.tolist() == [2.0, 8.0, 4.0, 0.0]
    assert q.quant_scale.item() == pytest.approx(8.0 / 448)  # max over the history


def test_delayed_most_recent_margin_and_zero() -> None:
    q = quantize(
        torch.full((3,), 2.0), "fp8_delayed", history_len=2, amax_compute="most_recent", margin=1
    )
    assert q.quant_scale.item() == pytest.approx(2.0 * 2 / 448)
    q.quantize_(torch.full((3,), 1.0))
    assert q.quant_scale.item() == pytest.approx(1.0 * 2 / 448)
    before = q.quant_scale.clone()
    q.quantize_(torch.zeros(3))  # zero amax: keep the previous scale
    assert torch.equal(q.quant_scale, before)
    assert q.amax_history.tolist() == [0.0, 1.0]


def test_delayed_load_leaves_state_bit_identical() -> None:
    torch.manual_seed(5)
    q = quantize(torch.randn(16, 16), "fp8_delayed")
    q.quantize_(torch.randn(16, 16) * 3)
    hist, qscale = q.amax_history.clone(), q.quant_scale.clone()
    src = torch.randn(16, 16) * 10
    q.quantize_(src, update_state=False)
    assert torch.equal(q.amax_history, hist) and torch.equal(q.quant_scale, qscale)
    assert torch.equal(q.scale, qscale)
    expect = (src / qscale).clamp(-448, 448).to(E4)
    assert torch.equal(bits(q.qdata), bits(expect))
    # copy_ updates the state; quant_state / load_quant_state undo that
    snap = q.quant_state()
    assert set(snap) == {"amax_history", "quant_scale"}
    assert snap["quant_scale"].data_ptr() != q.quant_scale.data_ptr()
    q.copy_(src)
    assert not torch.equal(q.amax_history, hist)
    assert torch.equal(q.scale, qscale)  # the codes were quantized with the old quant_scale
    q.load_quant_state(snap)
    assert torch.equal(q.amax_history, hist) and torch.equal(q.quant_scale, qscale)


def test_quant_state_empty_for_current_scaling() -> None:
    assert quantize(torch.ones(4), "fp8").quant_state() == {}


def test_quantized_tensor_type() -> None:
    q = quantize(torch.ones(4, dtype=torch.bfloat16), "fp8")
    assert isinstance(q, QuantizedTensor) and q.dtype == torch.bfloat16
    assert q.fmt == "fp8" and q.opts["dtype"] == E4
