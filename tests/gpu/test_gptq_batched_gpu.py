"""GPTQ batched over a stack of experts on CUDA gives the per-linear reference's bits
(``gptq.REFERENCE``: one call per linear / expert) for every weight format GPTQ quantizes: the
batched block updates (``bmm``, ``gptq.UPDATE_DEVICES``), the factors as ``FACTOR_DEVICES``
says, and the experts' Hessians one GEMM per group. A failure names the step: run
``python -m bench.gptq_batched --device cuda --probe`` to see which batched op differs, and
take its device out of that tuple. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import gptq, gptq_hessians
from qckpt.calib.gptq_pass import per_expert
from qckpt.formats.act_quant import InputQuant
from qckpt.formats.scheme import make_scheme

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROWS, COLS, EXPERTS = 192, 384, 12  # 384 columns: three blocks of 128, two updates
SCHEMES = {
    "fp8_tensor": (dict(fmt="fp8"), False),
    "fp8_channel_ao": (dict(fmt="fp8", granularity="channel"), True),
    "fp8_block": (dict(fmt="fp8", granularity="block", block=(128, 128)), False),
    "nvfp4": (dict(fmt="nvfp4"), False),
    "int4": (dict(fmt="int4", granularity="group", block=(1, 128)), False),
    "int4_asym_ao": (
        dict(fmt="int4", granularity="group", block=(1, 128), symmetric=False),
        True,
    ),  # fmt: skip
    "int8_channel": (dict(fmt="int8", granularity="channel"), False),
    "mxfp4": (dict(fmt="mxfp4"), False),
    "mxfp8": (dict(fmt="mxfp8"), False),
}


def _amax(kw: dict, w: torch.Tensor) -> torch.Tensor:
    gran = kw.get("granularity", "tensor")
    if gran == "channel":
        return w.abs().amax(dim=1)
    if gran == "block":
        b = 128
        pad = torch.nn.functional.pad(w, (0, -w.shape[1] % b, 0, -w.shape[0] % b))
        return pad.abs().reshape(pad.shape[0] // b, b, -1, b).amax(dim=(1, 3))
    if gran == "group":
        return w.abs().reshape(w.shape[0], -1, 128).amax(-1)
    return w.abs().max()


def _stack():
    """Gate and up of each expert sharing its Hessian; expert 3 cold, expert 5 all zero."""
    g = torch.Generator().manual_seed(0)
    ws, hs = [], []
    for e in range(EXPERTS):
        h = None
        if e != 3:
            x = torch.randn(600 + 40 * e, 24, generator=g) @ torch.randn(24, COLS, generator=g)
            x = (x + 0.3 * torch.randn(x.shape, generator=g)).to(torch.bfloat16).float()
            h = gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(8192)).cuda()
            if e == 5:
                h = torch.zeros_like(h)
        for _ in range(2):
            ws.append((0.02 * torch.randn(ROWS, COLS, generator=g)).to(torch.bfloat16).cuda())
            hs.append(h)
    return [w.float() for w in ws], hs


def _run(name: str, batching):
    kw, act_order = SCHEMES[name]
    kw = dict(kw)
    scheme = make_scheme(kw.pop("fmt"), **kw)
    ws, hs = _stack()
    qs = [gptq.ColumnQuantizer(scheme, _amax(SCHEMES[name][0], w), (ROWS, COLS),
                               scale_dtype=torch.bfloat16) for w in ws]  # fmt: skip
    return gptq.gptq_batch(ws, hs, qs, act_order=act_order, batching=batching), qs


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_batched_gptq_on_cuda_gives_the_reference_bits(name):
    ref, ref_q = _run(name, gptq.REFERENCE)
    got, got_q = _run(name, gptq.Batching())
    for k, ((a, la), (b, lb)) in enumerate(zip(ref, got, strict=True)):
        assert a.is_cuda and torch.equal(a, b), f"{name}: linear {k} differs batched"
        assert la == lb, f"{name}: linear {k}'s loss differs batched"
    for qa, qb in zip(ref_q, got_q, strict=True):
        if gptq.makes_group_scales(qa.scheme):
            assert torch.equal(qa.block_scales.view(torch.uint8), qb.block_scales.view(torch.uint8))
            if qa.zero_points is not None:
                assert torch.equal(qa.zero_points, qb.zero_points)


def test_the_batched_block_updates_alone_on_cuda_give_the_reference_bits():
    """The step CUDA batches (``UPDATE_DEVICES``) by itself: a failure here says to take
    "cuda" out of that tuple (the factors stay per matrix on CUDA: ``FACTOR_DEVICES``)."""
    ref, _ = _run("nvfp4", gptq.REFERENCE)
    got, _ = _run("nvfp4", gptq.Batching(factor=False, update=True, hessian=False))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(ref, got, strict=True))


@pytest.mark.parametrize("inputs", ["source", "fp8_token"])
def test_expert_hessians_in_groups_on_cuda_are_each_experts_own(inputs):
    g = torch.Generator().manual_seed(1)
    counts = [700, 650, 0, 90, 610, 3, 640, 1]
    keys = [f"experts:{e}:gate_up" for e in range(len(counts))]
    ids = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(counts)])
    x = (torch.randn(len(ids), 512, generator=g) * 3).to(torch.bfloat16).cuda()
    ids = ids.cuda()
    amax = {k: float(rows.float().abs().max()) for (r, rows) in per_expert(x, ids)
            for k in [keys[r]]}  # fmt: skip
    bits = gptq.grid_bits(4096)
    iq = InputQuant("fp8_token") if inputs == "fp8_token" else None
    ref_h: dict = {}
    ref_c: dict = {}
    for r, rows in per_expert(x, ids):
        k = keys[r]
        if iq is None:
            ref_h[k] = gptq.hessian_add(None, rows, amax[k], bits)
        else:
            ref_h[k], ref_c[k] = gptq.quantized_add(None, None, rows, iq(rows), amax[k], bits)
    got_h: dict = {}
    got_c: dict = {}
    gptq_hessians.add_experts(got_h, got_c, x, ids, keys, amax, bits, iq)
    assert sorted(got_h) == sorted(ref_h) and sorted(got_c) == sorted(ref_c)
    for k in ref_h:
        assert got_h[k].is_cuda and torch.equal(got_h[k], ref_h[k]), k
        if iq is not None:
            assert torch.equal(got_c[k], ref_c[k]), k
