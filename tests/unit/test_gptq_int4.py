"""GPTQ on INT4 groups: zero points (asymmetric groups) and act-order (compressed-tensors'
``actorder: weight``: every group's scale and zero point fixed from the weight before the sweep,
the columns visited in decreasing Hessian-diagonal order). Small tensors, no model."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import gptq
from qckpt.formats.intq import int_asym_qparams, int_scale
from qckpt.formats.scheme import make_scheme

GROUP = 32


def _scheme(symmetric: bool):
    return make_scheme("int4", granularity="group", block=(1, GROUP), symmetric=symmetric)


def _quantizer(w: torch.Tensor, symmetric: bool) -> gptq.ColumnQuantizer:
    amax = w.abs().reshape(w.shape[0], -1, GROUP).amax(-1)
    return gptq.ColumnQuantizer(
        _scheme(symmetric), amax, tuple(w.shape), scale_dtype=torch.bfloat16
    )


def _skewed(rows: int = 48, cols: int = 128, n: int = 2048, seed: int = 0):
    """Inputs whose columns' scales spread over two orders of magnitude in a shuffled order (a
    skewed Hessian diagonal), and weights with their own column scales: act-order's case."""
    g = torch.Generator().manual_seed(seed)
    col = torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=g)]
    base = torch.randn(n, 12, generator=g) @ torch.randn(12, cols, generator=g)
    x = ((base + 0.5 * torch.randn(n, cols, generator=g)) * col).to(torch.bfloat16).float()
    wcol = torch.logspace(-0.5, 0.5, cols)[torch.randperm(cols, generator=g)]
    w = (0.05 * torch.randn(rows, cols, generator=g) * wcol + 0.01).to(torch.bfloat16).float()
    h = gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(n))
    return w, x, h


def _err(x: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> float:
    return float(((x @ (v - w).t()).double() ** 2).sum())


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_lowers_the_output_error_on_a_skewed_hessian(symmetric):
    w, x, h = _skewed()
    rtn = gptq.round_to_nearest(w.clone(), _quantizer(w, symmetric))
    plain, _ = gptq.gptq(w, h, _quantizer(w, symmetric))
    ordered, _ = gptq.gptq(w, h, _quantizer(w, symmetric), act_order=True)
    assert _err(x, ordered, w) <= _err(x, plain, w) < _err(x, rtn, w)


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_keeps_each_columns_group_scale_and_zero_point(symmetric):
    """With act-order every group's qparams are those of the weight before the sweep (what
    round-to-nearest makes), and every value GPTQ chose is a code of its original group."""
    w, _, h = _skewed(seed=1)
    q = _quantizer(w, symmetric)
    got, _ = gptq.gptq(w, h, q, act_order=True)
    ref = _quantizer(w, symmetric)
    gptq.round_to_nearest(w.clone(), ref)
    assert torch.equal(q.block_scales, ref.block_scales)
    groups = w.reshape(w.shape[0], -1, GROUP)
    if symmetric:
        want = int_scale(groups.abs().amax(-1), 7.5, torch.bfloat16)
        assert torch.equal(q.block_scales, want) and q.zero_points is None
        zp = torch.zeros_like(want, dtype=torch.float32)
    else:
        want, zps = int_asym_qparams(groups.amin(-1), groups.amax(-1), (-8, 7), torch.bfloat16)
        assert torch.equal(q.block_scales, want) and torch.equal(q.zero_points, zps)
        zp = zps.float()
    s = q.block_scales.float().unsqueeze(-1)
    codes = got.reshape(w.shape[0], -1, GROUP) / s + zp.unsqueeze(-1)
    assert torch.equal(codes, codes.round()) and bool((codes >= -8).all() & (codes <= 7).all())
    assert not torch.equal(got, gptq.round_to_nearest(w.clone(), _quantizer(w, symmetric)))


def test_asymmetric_groups_are_made_from_each_groups_current_columns():
    """Without act-order: each group's scale and zero point come from its columns as the sweep
    reaches them (after the earlier groups' errors were spread into them), and the values lie
    on them."""
    w, _, h = _skewed(seed=2)
    q = _quantizer(w, False)
    got, _ = gptq.gptq(w, h, q)
    rtn = _quantizer(w, False)
    gptq.round_to_nearest(w.clone(), rtn)
    assert torch.equal(q.block_scales[:, 0], rtn.block_scales[:, 0])  # nothing spread yet
    assert not torch.equal(q.block_scales, rtn.block_scales)
    s = q.block_scales.float().unsqueeze(-1)
    codes = got.reshape(w.shape[0], -1, GROUP) / s + q.zero_points.float().unsqueeze(-1)
    assert torch.equal(codes, codes.round()) and bool((codes >= -8).all() & (codes <= 7).all())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("stack_bytes", [1, 1 << 30])
def test_int4_linears_side_by_side_give_each_its_own_values(act_order, stack_bytes, monkeypatch):
    monkeypatch.setattr(gptq, "STACK_BYTES", stack_bytes)
    cases = [_skewed(rows=24, seed=10 + k) for k in range(3)]
    ws = [w for w, _, _ in cases]
    hs = [None if k == 1 else h for k, (_, _, h) in enumerate(cases)]  # 1: a cold expert
    qs = [_quantizer(w, False) for w in ws]
    together = gptq.gptq_batch(ws, hs, qs, act_order=act_order)
    for w, h, q, (got, _) in zip(ws, hs, qs, together, strict=True):
        alone_q = _quantizer(w, False)
        alone, _ = gptq.gptq(w, h, alone_q, act_order=act_order)
        assert torch.equal(got, alone)
        assert torch.equal(q.block_scales, alone_q.block_scales)
        assert torch.equal(q.zero_points, alone_q.zero_points)
