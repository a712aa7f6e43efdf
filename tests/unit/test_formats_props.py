"""Hypothesis properties: dequantize(quantize(x)) error bounds per format, idempotence of the
power-of-two-scale formats, NaN refusal anywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qckpt.errors import FormatError
from qckpt.formats import quantize

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, max_cols: int = 80) -> torch.Tensor:  # noqa: ANN001
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, max_cols))
    elems = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
    a = draw(hnp.arrays(np.float32, (rows, cols), elements=elems))
    exp = draw(st.integers(-30, 30))  # move the whole tensor across many binades
    t = torch.from_numpy(a.copy()) * (2.0**exp)
    if draw(st.booleans()):
        t = t.to(torch.bfloat16).float()  # bf16-representable inputs
    return t


def _expand(s: torch.Tensor, shape: tuple[int, int], br: int, bc: int) -> torch.Tensor:
    s = s.reshape(-1, s.shape[-1]) if s.dim() else s.reshape(1, 1)
    return s.repeat_interleave(br, 0)[: shape[0]].repeat_interleave(bc, 1)[:, : shape[1]]


# fp8 element error: half an ulp (2**-4 relative for E4M3, 2**-3 for E5M2) for normal codes, half
# the smallest subnormal (2**-10 / 2**-17 of the scale) below; power-of-two scales may saturate
# the top of [256, 512) * scale to 448 * scale: |err| <= |x| / 8.
REL = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
ABS = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}


def _check_fp8(
    x: torch.Tensor, d: torch.Tensor, s: torch.Tensor, dt: torch.dtype, pow2: bool
) -> None:
    rel = 2.0**-3 if pow2 and dt == torch.float8_e4m3fn else REL[dt]
    bound = torch.maximum(x.abs() * rel, s * ABS[dt]) * (1 + 2**-20)
    assert torch.all((d - x).abs() <= bound), float(((d - x).abs() - bound).max())


@SETTINGS
@given(
    x=tensors(),
    dt=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    g=st.sampled_from(["tensor", "channel"]),
    pow2=st.booleans(),
)
def test_fp8_error_bound(x: torch.Tensor, dt: torch.dtype, g: str, pow2: bool) -> None:
    q = quantize(x, "fp8", dtype=dt, granularity=g, pow2_scale=pow2)
    d = q.dequantize(torch.float32)
    s = q.scale.expand(x.shape) if g == "channel" else q.scale.expand(x.shape)
    assert torch.all(q.scale > 0) and torch.all(torch.isfinite(q.scale))
    _check_fp8(x, d, s, dt, pow2)
    if pow2:
        for hp in (torch.float32, torch.bfloat16):
            q2 = quantize(q.dequantize(hp), "fp8", dtype=dt, granularity=g, pow2_scale=True)
            assert torch.equal(q2.qdata.view(torch.uint8), q.qdata.view(torch.uint8))
            assert torch.equal(q2.scale, q.scale)


@SETTINGS
@given(x=tensors())
def test_fp8_delayed_initial_error_bound(x: torch.Tensor) -> None:
    q = quantize(x, "fp8_delayed")
    _check_fp8(x, q.dequantize(torch.float32), q.scale.expand(x.shape), torch.float8_e4m3fn, False)


@SETTINGS
@given(
    x=tensors(),
    dt=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    rnd=st.sampled_from(["floor", "rceil"]),
)
def test_mxfp8_error_bound_and_idempotence(x: torch.Tensor, dt: torch.dtype, rnd: str) -> None:
    q = quantize(x, "mxfp8", dtype=dt, scale_rounding=rnd)
    d = q.dequantize(torch.float32)
    e = q.scale.to(torch.int32) - 127
    s = _expand(torch.ldexp(torch.ones(e.shape), e), tuple(x.shape), 1, 32)
    _check_fp8(x, d, s, dt, rnd == "floor")  # RCEIL never saturates: the plain fp8 bound
    if rnd == "rceil":
        return  # not idempotent by design (see the mxfp8 docstring)
    for hp in (torch.float32, torch.bfloat16):
        q2 = quantize(q.dequantize(hp), "mxfp8", dtype=dt)
        assert torch.equal(q2.qdata.view(torch.uint8), q.qdata.view(torch.uint8))
        assert torch.equal(q2.scale, q.scale)


@SETTINGS
@given(
    x=tensors(max_cols=300), bs=st.sampled_from([(128, 128), (1, 128), (2, 16)]), pow2=st.booleans()
)
def test_fp8_block_error_bound(x: torch.Tensor, bs: tuple[int, int], pow2: bool) -> None:
    q = quantize(x, "fp8_block", block_size=bs, pow2_scale=pow2)
    s = _expand(q.scale, tuple(x.shape), *bs)
    _check_fp8(x, q.dequantize(torch.float32), s, torch.float8_e4m3fn, pow2)


@SETTINGS
@given(x=tensors())
def test_nvfp4_error_bound(x: torch.Tensor) -> None:
    q = quantize(x, "nvfp4")
    d = q.dequantize(torch.float32)
    s = _expand(q.scale.float() * q.global_scale, tuple(x.shape), 1, 16)
    assert torch.all(q.scale.float() > 0) and q.global_scale.item() > 0
    # E2M1's widest step is 2 (4 -> 6): |err| <= 1 block scale (saturation after the E4M3
    # rounding of the block scale costs at most 6 * 2**-4 < 1 of it)
    assert torch.all((d - x).abs() <= s * (1 + 2**-20)), float(((d - x).abs() - s).max())


@SETTINGS
@given(
    x=tensors(),
    fmt=st.sampled_from(["fp8", "fp8_delayed", "mxfp8", "fp8_block", "nvfp4"]),
    data=st.data(),
)
def test_nan_anywhere_is_refused(x: torch.Tensor, fmt: str, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, x.shape[0] - 1))
    j = data.draw(st.integers(0, x.shape[1] - 1))
    x = x.clone()
    x[i, j] = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    with pytest.raises(FormatError, match="NaN|Inf"):
        quantize(x, fmt)
