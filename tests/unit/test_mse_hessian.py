"""``calibrate.mse_weighting: hessian`` (no model, no processes): each searched scale minimises
``sum_j h_j (w_j - q_j)**2`` over its candidate grid (checked against a brute force written
here, candidate by candidate), a skewed ``h`` changes the choice, a uniform one (ones, or a
power of two) gives the plain search bit for bit, and the recipe refuses what it cannot run
in one line."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import mse
from qckpt.calib.algorithms import Mse, algorithm_from
from qckpt.errors import CalibrationError, RecipeError, SchemeError
from qckpt.formats.intq import int_round, int_scale
from qckpt.formats.mx_codes import MX_EMAX, mx_exponents, mx_round
from qckpt.formats.mx_search import MX_STEPS, mx_mse_quantize
from qckpt.formats.nvfp4 import e2m1_codes, e2m1_values
from qckpt.formats.nvfp4_search import BLOCK_STEPS, nvfp4_mse_quantize, nvfp4_scalars
from qckpt.formats.scheme import make_scheme
from qckpt.recipe import recipe_from_dict

FP8 = torch.float8_e4m3fn


def _w(rows: int = 24, cols: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.distributions.StudentT(2.5).sample((rows, cols)) if seed % 2 else None
    if x is None:
        x = torch.randn(rows, cols, generator=g)
    return (0.02 * x).to(torch.bfloat16).float()


def _h(cols: int, seed: int = 1) -> torch.Tensor:
    """A trained model's H_jj: a few columns 100x the others (outlier channels)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(cols, generator=g, dtype=torch.float64) + 0.05
    h[torch.randperm(cols, generator=g)[: cols // 8]] *= 100.0
    return h.to(torch.float32)


def _werr(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Brute force: float64 weighted squared error along the last dim."""
    return (d.double() ** 2 * h.double()).sum(dim=-1)


def _e4m3_neighbour(sb: torch.Tensor, step: int) -> torch.Tensor:
    """E4M3 ``step`` codes from ``sb`` in the max rule's range [2**-6, 448] (codes 8 .. 126)."""
    code = sb.view(torch.uint8).to(torch.int16) + step
    return code.clamp(8, 126).to(torch.uint8).view(FP8)


def test_nvfp4_block_scales_minimise_the_weighted_error_over_their_candidates():
    w, h = _w(seed=3), _h(128)
    clip = w.abs().amax()
    _, sb, _, err, _ = nvfp4_mse_quantize(w, clip, h)
    gs, gs64, inv_gs = nvfp4_scalars(clip, w.device)
    blocks = w.reshape(24, 8, 16)
    hb = h.reshape(8, 16)
    # the max rule's scale, then each candidate's error, recomputed here
    from qckpt.formats.nvfp4 import max_block_scales

    base = max_block_scales(blocks.abs().amax(-1), torch.tensor(6.0, dtype=torch.float64), gs64)
    base = base.to(FP8)
    errs = []
    for step in BLOCK_STEPS:
        cand = _e4m3_neighbour(base, step).float()
        codes = e2m1_codes((blocks * (inv_gs / cand).unsqueeze(-1)).clamp(-6, 6))
        dq = e2m1_values(codes) * (gs * cand).unsqueeze(-1)
        errs.append(_werr(blocks - dq, hb))
    errs = torch.stack(errs)  # [candidates, rows, blocks]
    chosen = torch.stack(
        [(_e4m3_neighbour(base, s).float() == sb.float()) for s in BLOCK_STEPS]
    )  # which candidate(s) the search's scale is
    got = torch.where(chosen, errs, torch.inf).amin(dim=0)
    best = errs.amin(dim=0)
    assert torch.allclose(got, best, rtol=1e-12, atol=0), (got - best).abs().max()
    assert abs(float(best.sum()) - err) <= 1e-9 * err
    # and the weights matter: the unweighted search picks other scales for some blocks
    _, sb0, *_ = nvfp4_mse_quantize(w, clip)
    assert not torch.equal(sb0.view(torch.uint8), sb.view(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
def test_mx_exponents_minimise_the_weighted_error_over_their_candidates(bits):
    w, h = _w(16, 128, seed=5), _h(128, seed=2)
    _, scales, err, _ = mx_mse_quantize(w, bits, h)
    blocks = w.reshape(16, 4, 32)
    hb = h.reshape(4, 32)
    base = mx_exponents(blocks.abs().amax(-1), MX_EMAX[bits])
    errs = torch.stack(
        [
            _werr(blocks - mx_round(blocks, (base + s).clamp(-127, 127).unsqueeze(-1), bits), hb)
            for s in MX_STEPS
        ]
    )
    got_e = scales.to(torch.int32) - 127
    pick = torch.stack([(base + s).clamp(-127, 127) == got_e for s in MX_STEPS])
    got = torch.where(pick, errs, torch.inf).amin(dim=0)
    assert torch.allclose(got, errs.amin(dim=0), rtol=1e-12, atol=0)
    assert abs(float(got.sum()) - err) <= 1e-9 * err


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_clips_minimise_the_weighted_error_over_the_ratios(granularity):
    w, h = _w(64, 128, seed=7), _h(128, seed=4)
    block = (32, 32)
    g = mse.weight_groups(w, granularity, block)
    amax = g.abs().amax(dim=1)
    clip, lo, hi = mse.fp8_weight_clip(w, amax, granularity, block, h)
    hg = mse.weight_groups(h.reshape(1, -1).expand(64, 128), granularity, block)
    errs = []
    for r in mse.WEIGHT_RATIOS:
        c = (amax.double() * r).float()
        s = (c.clamp_min(1e-12).double() / 448).float().reshape(-1, 1)
        errs.append(_werr(g - mse.fp8_dequantize(g, s), hg))
    errs = torch.stack(errs)  # [ratios, groups]
    ratios = torch.tensor([float((amax.double() * r).float()[0]) for r in mse.WEIGHT_RATIOS])
    assert ratios.numel() == len(mse.WEIGHT_RATIOS)
    got = torch.stack(
        [
            errs[
                [float((amax[i].double() * r).float()) for r in mse.WEIGHT_RATIOS].index(
                    float(clip.reshape(-1)[i])
                )
            ][i]
            for i in range(amax.numel())
        ]  # fmt: skip
    )
    assert torch.allclose(got, errs.amin(dim=0), rtol=1e-9, atol=0)
    assert hi <= lo


def test_int4_group_clips_minimise_the_weighted_error_over_the_ratios():
    w, h = _w(16, 128, seed=9), _h(128, seed=6)
    scheme = make_scheme("int4", granularity="group", block=(32,))
    g = mse.weight_groups(w, scheme.calib_granularity, scheme.block)
    amax = g.abs().amax(dim=1).reshape(scheme.amax_shape("weight", (16, 128)))
    clip, *_ = mse.int_weight_clip(w, amax, scheme, torch.float32, h)
    hg = mse.weight_groups(h.reshape(1, -1).expand(16, 128), scheme.calib_granularity, scheme.block)
    a = amax.reshape(-1)
    errs = []
    cands = []
    for r in mse.INT_RATIOS:
        c = (a.double() * r).float()
        s = int_scale(c, scheme.qmax, torch.float32).float().reshape(-1, 1)
        errs.append(_werr(g - int_round(g, s, scheme.code_range), hg))
        cands.append(c)
    errs, cands = torch.stack(errs), torch.stack(cands)
    pick = cands == clip.reshape(1, -1)
    got = torch.where(pick, errs, torch.inf).amin(dim=0)
    assert torch.allclose(got, errs.amin(dim=0), rtol=1e-9, atol=0)
    clip0, *_ = mse.int_weight_clip(w, amax, scheme, torch.float32)
    assert not torch.equal(clip0, clip)  # the weights moved some group's clip


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_a_uniform_h_gives_the_plain_search_bit_for_bit(scale):
    w = _w(32, 128, seed=11)
    h = torch.full((128,), scale)
    clip = w.abs().amax() * 0.9
    a = nvfp4_mse_quantize(w, clip)
    b = nvfp4_mse_quantize(w, clip, h)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert float(mse.nvfp4_weight_clip(w, w.abs().amax())[0]) == float(
        mse.nvfp4_weight_clip(w, w.abs().amax(), h)[0]
    )
    for bits in (4, 8):
        x, y = mx_mse_quantize(w, bits), mx_mse_quantize(w, bits, h)
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    for gran in ("tensor", "channel", "block"):
        amax = mse.weight_groups(w, gran, (32, 32)).abs().amax(dim=1)
        p = mse.fp8_weight_clip(w, amax, gran, (32, 32))[0]
        q = mse.fp8_weight_clip(w, amax, gran, (32, 32), h)[0]
        assert torch.equal(p, q), gran
    for kw in ({"granularity": "group", "block": (32,)}, {"granularity": "channel"}):
        s = make_scheme("int4", **kw)
        amax = mse.weight_groups(w, s.calib_granularity, s.block).abs().amax(dim=1)
        amax = amax.reshape(s.amax_shape("weight", (32, 128)))
        assert torch.equal(
            mse.int_weight_clip(w, amax, s, torch.bfloat16)[0],
            mse.int_weight_clip(w, amax, s, torch.bfloat16, h)[0],
        )


def _cal(**kw):
    return {"calibrate": {"data": {"source": "synthetic"}, **kw}}


@pytest.mark.parametrize(
    ("cal", "needle"),
    [
        ({"algorithm": "max", "mse_weighting": "hessian"}, "needs calibrate.algorithm: mse"),
        ({"algorithm": "awq", "mse_weighting": "hessian"}, "(got awq)"),
        (
            {"algorithm": "gptq", "mse_weighting": "hessian"},
            "(got gptq, gptq_block_scales max)",
        ),
    ],
)
def test_hessian_weighting_without_a_searched_scale_is_one_line(cal, needle):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(_cal(**cal))
    msg = str(e.value)
    assert "mse_weighting: hessian" in msg and needle in msg and "\n" not in msg


def test_an_unknown_weighting_is_refused():
    with pytest.raises(RecipeError):
        recipe_from_dict(_cal(algorithm="mse", mse_weighting="full"))
    with pytest.raises(CalibrationError, match="not one of none, hessian"):
        Mse(weighting="full")


def test_the_recipe_reaches_the_algorithms():
    r = recipe_from_dict(_cal(algorithm="mse", mse_weighting="hessian"))
    assert algorithm_from(r.calibrate).weighting == "hessian"
    g = recipe_from_dict(_cal(algorithm="gptq", gptq_block_scales="mse", mse_weighting="hessian"))
    assert algorithm_from(g.calibrate).options().block_weighted is True
    assert algorithm_from(recipe_from_dict(_cal(algorithm="mse")).calibrate).weighting == "none"


def test_asymmetric_int4_with_hessian_mse_is_refused_in_one_line():
    asym = make_scheme("int4", granularity="group", block=(32,), symmetric=False)
    with pytest.raises(SchemeError) as e:
        Mse(weighting="hessian").check_schemes([asym])
    assert "does not search" in str(e.value) and "\n" not in str(e.value)
