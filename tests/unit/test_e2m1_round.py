"""``nvfp4.e2m1_round``, GPTQ's rounding to the E2M1 grid, equals the dequantized codes
(``e2m1_values(e2m1_codes(y))``) bit for bit, signed zeros and every tie included: GPTQ's
weights and so its exports must not change with the faster path. (The whole float32 range
[-6, 6] was checked once, 2.1 billion values, no difference; this test takes the values where a
mistake would show.)"""

from __future__ import annotations

import torch

from qckpt.formats.nvfp4 import E2M1_VALUES, e2m1_codes, e2m1_round, e2m1_values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _edges() -> torch.Tensor:
    """Each grid value and each midpoint between neighbours (the ties), with the float32 just
    below and just above each, both signs, and the zeros."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids, torch.tensor([6.0])])
    near = torch.cat(
        [pts, torch.nextafter(pts, torch.tensor(-1.0)), torch.nextafter(pts, torch.tensor(7.0))]
    ).clamp(0.0, 6.0)
    return torch.cat([near, -near, torch.tensor([0.0, -0.0])])


def test_equals_the_dequantized_codes_at_every_tie_and_its_neighbours():
    y = _edges()
    assert torch.equal(_bits(e2m1_round(y)), _bits(e2m1_values(e2m1_codes(y))))


def test_equals_the_dequantized_codes_on_random_values_and_keeps_negative_zero():
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(1 << 20, generator=g) * 12 - 6).to(torch.float32)
    assert torch.equal(_bits(e2m1_round(y)), _bits(e2m1_values(e2m1_codes(y))))
    small = torch.tensor([-0.0, -0.1, -0.25, 0.25, 0.0])
    got = e2m1_round(small)
    assert torch.signbit(got).tolist() == [True, True, True, False, False]
    assert got.abs().tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
