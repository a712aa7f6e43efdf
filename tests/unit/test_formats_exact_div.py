"""The scale divisions by constants (amax / 448, amax / 6, ...) give the correctly rounded
float32 quotient through ``numerics.div_f32`` (float64, rounded once): the same bits as CPU
float32 division, which the reference tests pin. CUDA torch would multiply by a rounded
reciprocal instead (tests/gpu/test_formats_gpu.py compares the devices)."""

from __future__ import annotations

import torch

from qckpt.formats import numerics


def _edge_amaxes() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F7FFFFF, (1 << 20,), generator=g, dtype=torch.int32)
    special = torch.tensor(
        [0.0, 2.0**-149, 2.0**-130, 2.0**-126, 2.0**-118, 3 * 2.0**-130, 6 * 2.0**-140, 1.0, 6.0]
        + [448.0 * 2.0**k for k in range(-140, 110, 7)]
        + [57344.0 * 2.0**k for k in range(-150, 100, 9)]
        + [torch.finfo(torch.float32).max]
    )
    # every subnormal float32 with a small mantissa: quotients that are exact float32 ties
    sub = torch.arange(1, 1 << 16, dtype=torch.int32).view(torch.float32)
    return torch.cat([bits.view(torch.float32), special, sub])


def test_div_f32_is_float32_division() -> None:
    a = _edge_amaxes()
    for d in (448.0, 57344.0, 6.0, 2688.0, 3.0):
        want = a / d  # CPU float32 division: correctly rounded, ties to even
        got = numerics.div_f32(a, numerics.f64_const(d, a.device))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), d


def test_float_scale_is_float32_division_clamped() -> None:
    a = _edge_amaxes()
    for q in (448.0, 57344.0, 2688.0):
        want = (a / q).clamp_min(numerics.F32_TINY)
        want = torch.where(a > 0, want, torch.ones_like(want))
        for qmax in (q, numerics.f64_const(q, a.device)):
            got = numerics.float_scale(a, qmax)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), q


def test_e4m3_round_normal_is_the_float8_cast() -> None:
    """NVFP4's block scales are rounded to E4M3 by hand (so the cast after it is exact on every
    device and kernel): every float32 next to each E4M3 midpoint of the normal range, the
    midpoints themselves (ties to even) and the E4M3 values must round as torch's cast does."""
    from qckpt.formats.nvfp4 import E4M3_MAX, E4M3_TINY, e4m3_round_normal

    vals = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    vals = vals[torch.isfinite(vals) & (vals >= E4M3_TINY) & (vals <= E4M3_MAX)].unique()
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float32
    near = torch.cat([mids, vals])
    bits = near.view(torch.int32)
    edge = torch.cat([bits + d for d in range(-3, 4)]).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    rand = torch.empty(1 << 18).uniform_(-6, 8.8, generator=g).exp2()
    x = torch.cat([edge, rand]).clamp(E4M3_TINY, E4M3_MAX)
    want = x.to(torch.float8_e4m3fn).to(torch.float32)
    got = e4m3_round_normal(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got.to(torch.float8_e4m3fn).to(torch.float32), got)


def test_nvfp4_block_scale_rounds_the_quotient_by_6_before_dividing_by_the_global_scale() -> None:
    """``s_b = e4m3(fl32(fl32(amax_b / 6) / gs))``, two float32 roundings. Found on the H200: a
    compiled kernel that divided once in float64 (inductor folding the casts between) put a
    block of amax 11776 under gs 0x47aaaaab exactly on an E4M3 tie and rounded it up."""
    from qckpt.formats import quantize

    gs_bits = 0x47AAAAAB
    gs = torch.tensor([gs_bits], dtype=torch.int32).view(torch.float32)
    tensor_amax = float(gs) * 2688.0  # float_scale(tensor_amax, 6 * 448) gives gs back
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 0] = 11776.0
    q = quantize(x, "nvfp4", amax=tensor_amax)
    assert int(q.global_scale.view(torch.int32)) == gs_bits
    single = (torch.tensor(11776.0, dtype=torch.float64) / (6 * gs.double())).float()
    assert float(single) == 11.5 * 2**-9  # the one-rounding quotient is a tie: it would give 12
    assert q.scale[0, 0].view(torch.uint8).item() == 0x0B  # 11 * 2**-9 = 0.021484375
    assert float(q.scale[0, 0].float()) == 0.021484375
