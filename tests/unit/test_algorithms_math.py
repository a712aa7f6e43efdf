"""The math of calibrate.algorithm mse and gptq on small tensors (no model, no processes)."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import gptq, mse
from qckpt.calib.awq import Spec
from qckpt.formats import nvfp4_search, quantize
from qckpt.formats.nvfp4 import e2m1_values


def _heavy(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights with outliers (a Student-t), where clipping pays."""
    torch.manual_seed(seed)
    return (0.02 * torch.distributions.StudentT(3.0).sample((rows, cols))).to(torch.bfloat16)


def _fp8_err(w: torch.Tensor, amax: torch.Tensor, gran: str, block=(32, 32)) -> float:
    g = mse.weight_groups(w, gran, block)
    s = (amax.reshape(-1, 1).double() / 448).float()
    return float(((g - mse.fp8_dequantize(g, s)).double() ** 2).sum())


def _amax(w: torch.Tensor, gran: str, block=(32, 32)) -> torch.Tensor:
    from qckpt.formats.shapes import amax_shape

    shape = amax_shape(gran, "weight", tuple(w.shape), block)
    return mse.weight_groups(w, gran, block).abs().amax(dim=1).reshape(shape)


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_fp8_mse_clip_is_never_worse_than_max(gran):
    w = _heavy(64, 96)
    amax = _amax(w, gran)
    clip, err_max, err_mse = mse.fp8_weight_clip(w, amax, gran, (32, 32))
    assert clip.shape == amax.shape and bool((clip <= amax).all())
    # the errors it reports are the errors of those scales, measured apart
    assert err_max == pytest.approx(_fp8_err(w, amax, gran), rel=1e-9)
    assert err_mse == pytest.approx(_fp8_err(w, clip, gran), rel=1e-9)
    assert err_mse <= err_max


def test_nvfp4_block_search_lowers_the_error_and_decodes_to_its_own_values():
    w = _heavy(32, 64)
    a = w.float().abs().max()
    packed, scales, gs, err, err0 = nvfp4_search.nvfp4_mse_quantize(w, a)
    ref = quantize(w, "nvfp4", amax=a)  # the max rule: the formats layer
    assert torch.equal(gs, ref.global_scale)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(32, -1)
    dq = e2m1_values(codes).view(32, -1, 16) * (gs * scales.float()).unsqueeze(-1)
    assert float(((dq.reshape(32, -1) - w.float()).double() ** 2).sum()) == pytest.approx(err)
    ref_dq = ref.dequantize(torch.float32)
    assert err0 == pytest.approx(float(((ref_dq - w.float()).double() ** 2).sum()))
    assert err < 0.95 * err0
    clip, e_max, e_best = mse.nvfp4_weight_clip(w, a)
    assert float(clip) <= float(a) and e_best <= err and e_max == pytest.approx(err0)


def test_input_histograms_sum_exactly_in_any_split_and_the_clip_beats_max():
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.5).sample((4096,))
    amax = float(x.abs().max())
    whole = mse.histogram(x, amax)
    parts = mse.histogram(x[:1000], amax) + mse.histogram(x[1000:], amax)
    assert whole.dtype == torch.int64 and torch.equal(whole, parts)
    assert int(whole.sum()) == x.numel()
    clip, err_max, err_clip = mse.input_clip(whole, amax)
    assert clip < amax and err_clip < err_max


def _correlated(n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(n, 16, generator=g) @ torch.randn(16, d, generator=g)
    return (base + 0.3 * torch.randn(n, d, generator=g)).to(torch.bfloat16).float()


def test_hessian_on_the_grid_is_the_same_for_any_split_of_the_rows():
    x = _correlated(600, 48)
    amax, bits = float(x.abs().max()), gptq.grid_bits(600)
    h = gptq.hessian_add(None, x, amax, bits)
    for cut in (1, 299, 599):
        split = gptq.hessian_add(gptq.hessian_add(None, x[cut:], amax, bits), x[:cut], amax, bits)
        assert torch.equal(h, split)
    # the grid's sums stay exact: every entry an integer below 2**53
    assert bool((h == h.round()).all()) and float(h.abs().max()) < 2**53


@pytest.mark.parametrize(("fmt", "gran"), [("fp8", "tensor"), ("fp8", "channel"), ("nvfp4", "")])
def test_gptq_lowers_the_output_error_against_round_to_nearest(fmt, gran):
    x = _correlated(1024, 128)
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    h = gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(1024))
    amax = w.abs().amax(dim=1) if gran == "channel" else w.abs().max()

    def quantizer():
        return gptq.ColumnQuantizer(Spec(fmt, gran or "tensor"), amax, tuple(w.shape))

    rtn = gptq.round_to_nearest(w.clone(), quantizer())
    q, _ = gptq.gptq(w, h, quantizer())

    def err(v):
        return float(((x @ (v - w).t()) ** 2).mean())

    assert err(q) < 0.5 * err(rtn)
    # no Hessian (a cold expert): rounding to nearest, exactly
    assert torch.equal(gptq.gptq(w, None, quantizer())[0], rtn)
    if fmt == "fp8":
        qa, _ = gptq.gptq(w, h, quantizer(), act_order=True)
        assert err(qa) < 0.5 * err(rtn)


@pytest.mark.parametrize("search", [False, True])
def test_the_export_writes_gptqs_codes_from_its_bf16_weights_and_block_scales(search):
    x = _correlated(512, 64)
    w = 0.05 * torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    h = gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(512))
    cq = gptq.ColumnQuantizer(Spec("nvfp4"), w.abs().max(), tuple(w.shape), search=search)
    q, _ = gptq.gptq(w, h, cq)
    stored = q.to(torch.bfloat16)  # what the sidecar holds
    packed, sb, gs = nvfp4_search.nvfp4_with_scales(stored.float(), w.abs().max(), cq.block_scales)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(32, -1)
    dq = (e2m1_values(codes).view(32, -1, 16) * (gs * sb.float()).unsqueeze(-1)).reshape(32, -1)
    assert torch.equal(dq, q)  # the very values GPTQ chose, not re-rounded ones


@pytest.mark.parametrize(
    ("fmt", "gran", "search", "act_order"),
    [
        ("fp8", "tensor", False, False),
        ("fp8", "channel", False, True),
        ("fp8", "block", False, False),
        ("nvfp4", "tensor", False, False),
        ("nvfp4", "tensor", True, False),
    ],
)
@pytest.mark.parametrize("stack_bytes", [1, 1 << 30])
def test_gptq_of_linears_side_by_side_gives_each_its_own_values(
    fmt, gran, search, act_order, stack_bytes, monkeypatch
):
    # an MoE layer's experts run as one batch; an EP rank holds a different set of them, so
    # each expert's values must not depend on which others share its batch (or how many fit)
    monkeypatch.setattr(gptq, "STACK_BYTES", stack_bytes)
    shape = (40, 144)  # 144 columns: one full block of 128 and a partial one

    def case(k: int):
        g = torch.Generator().manual_seed(20 + k)
        w = (0.02 * (k + 1)) * torch.randn(shape, generator=g)
        x = _correlated(300 + 50 * k, shape[1])
        h = None if k == 2 else gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(600))
        if gran == "channel":
            amax = w.abs().amax(dim=1)
        elif gran == "block":
            amax = torch.stack([w[:, :128].abs().max(), w[:, 128:].abs().max()]).reshape(1, 2)
        else:
            amax = w.abs().max()

        def quantizer():
            return gptq.ColumnQuantizer(Spec(fmt, gran), amax, shape, search=search)

        return w, h, quantizer

    cases = [case(k) for k in range(4)]  # case 2: a cold expert (no Hessian)
    qs = [make() for _, _, make in cases]
    together = gptq.gptq_batch(
        [w for w, _, _ in cases], [h for _, h, _ in cases], qs, act_order=act_order
    )
    for (w, h, make), q_batch, (got, _) in zip(cases, qs, together, strict=True):
        alone_q = make()
        alone, _ = gptq.gptq(w, h, alone_q, act_order=act_order)
        assert torch.equal(got, alone)
        if fmt == "nvfp4":
            assert torch.equal(
                q_batch.block_scales.view(torch.uint8), alone_q.block_scales.view(torch.uint8)
            )
    assert torch.equal(together[2][0], gptq.round_to_nearest(cases[2][0].clone(), cases[2][2]()))


def _nvfp4_inputs(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a client quantizes NVFP4 inputs (per-16 blocks under the static global scale
    of its amax, as the export writes it)."""
    from qckpt.formats.act_quant import nvfp4

    s = (x.abs().max().double() / (6.0 * 448.0)).float()
    return nvfp4(x, (1.0 / s.double()).float())


def test_gptq_on_quantized_inputs_lowers_the_w4a4_output_error():
    """calibrate.gptq_inputs: quantized: GPTQ of the input-aware target with the quantized
    inputs' Hessian gives a lower ``|W X - Q Qa(X)|`` than GPTQ on the inputs as they are;
    the target is ``W`` itself when quantizing leaves the inputs unchanged."""
    x = _correlated(2048, 128)
    xq = _nvfp4_inputs(x)
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    bits = gptq.grid_bits(2048)
    amax = float(torch.maximum(x.abs().max(), xq.abs().max()))  # one grid for X and Qa(X)
    h_src = gptq.hessian_add(None, x, amax, bits)
    h_q, c = gptq.quantized_add(None, None, x, xq, amax, bits)
    assert torch.equal(h_q, gptq.hessian_add(None, xq, amax, bits))
    assert bool((c == c.round()).all())  # exact integer sums, as the Hessian's

    def quantizer():
        return gptq.ColumnQuantizer(Spec("nvfp4"), w.abs().max(), tuple(w.shape))

    q_src, _ = gptq.gptq(w, h_src, quantizer())
    aim = gptq.input_aware_target(w, h_q, c, 0.01)
    q_in, _ = gptq.gptq(aim, h_q, quantizer())

    def w4a4(q):
        return float(((x @ w.t() - xq @ q.t()) ** 2).sum().sqrt())

    src, quantized = w4a4(q_src), w4a4(q_in)
    assert quantized < 0.9 * src, (quantized, src)
    # inputs that quantizing leaves as they are: the target is the weight (GPTQ as before)
    same = gptq.input_aware_target(w, h_src, h_src, 0.01)
    assert torch.allclose(same, w, rtol=0, atol=1e-6)


def test_gptq_inputs_quantize_as_the_export_layouts_write_the_inputs():
    from qckpt.calib.gptq_inputs import InputMode, input_mode
    from qckpt.errors import CalibrationError
    from qckpt.formats.scheme import make_scheme

    def mode(fmt, gran, dynamic, block):
        return input_mode(make_scheme(fmt, granularity=gran, block=block, dynamic=dynamic,
                                      kind="input"), bf16)  # fmt: skip

    bf16 = torch.bfloat16
    assert mode("nvfp4", "tensor", False, [128, 128]) == InputMode(
        "nvfp4", qmax=6 * 448.0, reciprocal=True
    )
    assert mode("fp8", "tensor", False, [128, 128]) == InputMode("fp8_static", 0, bf16, 448.0)
    assert mode("fp8", "tensor", True, [128, 128]) == InputMode("fp8_token")
    assert mode("fp8", "block", True, [128, 64]) == InputMode("fp8_group", 64)
    assert not mode("none", "tensor", False, [128, 128]).quantized
    with pytest.raises(CalibrationError, match=r"^calibrate\.gptq_inputs: quantized .* fp8 block"):
        mode("fp8", "block", False, [128, 128])
