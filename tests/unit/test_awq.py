"""calibrate.algorithm awq: its math on small tensors, its folds on the tiny models (the BF16
model computes what it did), and the pipeline (calibrate -> the folded weights beside the file
-> export -> plan), one process."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib import awq
from qckpt.calib.awq import Spec


def _salient(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few channels 30x the others (what AWQ is for), BF16 values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, :4] *= 30.0
    return x.to(torch.bfloat16).float()


def _weight(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.05 * torch.randn(rows, cols, generator=g)).to(torch.bfloat16)


def test_scales_are_ones_at_alpha_zero_and_normalised_powers_of_two():
    a = _salient(256, 64).abs().mean(dim=0).double()
    assert torch.equal(awq.scales(a, 0.0), torch.ones(64, dtype=torch.float64))
    s = awq.scales(a, 0.5, pow2=False)
    assert float(s.max() * s.min()) == pytest.approx(1.0)
    assert bool((s[:4] > s[4:].max()).all())  # the salient channels get the large scales
    p = awq.scales(a, 0.5, pow2=True)
    assert torch.equal(p, torch.exp2(torch.log2(p).round()))  # every one a power of two
    assert torch.equal(awq.scales(torch.zeros(8), 0.7), torch.ones(8, dtype=torch.float64))


def test_statistics_and_losses_sum_exactly_in_any_split():
    x = _salient(600, 48)
    amax, bits = float(x.abs().max()), awq.stat_bits(600)
    whole = awq.abs_sums(x, amax, bits)
    for cut in (1, 299, 599):
        parts = awq.abs_sums(x[:cut], amax, bits) + awq.abs_sums(x[cut:], amax, bits)
        assert whole.dtype == torch.int64 and torch.equal(whole, parts)
    mean = awq.mean_abs(whole, 600, amax, bits)
    assert torch.allclose(mean, x.abs().double().mean(dim=0), rtol=1e-9, atol=0)
    err = x.square().sum(dim=1).double()
    unit = float(err.max()) / 2**bits
    assert awq.fixed_sum(err, unit, bits) == sum(
        awq.fixed_sum(err[i : i + 7], unit, bits) for i in range(0, 600, 7)
    )


def test_awq_beats_max_on_salient_channels_nvfp4():
    x, w = _salient(1024, 128), _weight(64, 128)
    for ispec in (None, Spec("nvfp4")):  # NVFP4 weights only, and W4A4
        k, losses, s = awq.search_linear(x, w, Spec("nvfp4"), ispec=ispec)
        assert k > 0 and losses[k] < 0.8 * losses[0], (ispec, losses)
        assert float(s[:4].min()) > 1.0


def test_the_search_picks_alpha_zero_when_it_is_best():
    """A weight that NVFP4 holds exactly at s = 1 (E2M1 values, every 16-block's max 6 under
    a global amax of 6): any other scales make it round, so alpha 0 (max) wins."""
    g = torch.Generator().manual_seed(4)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = grid[torch.randint(0, 8, (32, 64), generator=g)]
    w = w * torch.where(torch.rand(32, 64, generator=g) < 0.5, -1.0, 1.0)
    w[:, ::16] = 6.0
    x = _salient(512, 64)
    for pow2 in (False, True):
        k, losses, _ = awq.search_linear(x, w.to(torch.bfloat16), Spec("nvfp4"), pow2=pow2)
        # (small alphas' scales may round to all ones under pow2: a tie, which keeps 0)
        assert k == 0 and losses[0] <= min(losses) and losses[0] < losses[-1], (pow2, losses)


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_fp8_awq_is_no_worse_than_max(gran):
    x, w = _salient(1024, 256, seed=2), _weight(128, 256, seed=3)
    spec = Spec("fp8", gran, (64, 64))
    k, losses, s = awq.search_linear(x, w, spec)
    # alpha 0 is max calibration exactly: its loss is rounding-to-nearest's output error
    rtn = awq.fake_quant(w, spec)
    ref = x @ w.float().t()
    assert losses[0] == pytest.approx(float(awq.row_errors(x @ rtn.t(), ref).sum()), rel=1e-12)
    assert losses[k] <= losses[0]
    y = (x / s.float()) @ awq.fake_quant(awq.folded(w, s), spec).t()
    assert float(awq.row_errors(y, ref).sum()) == pytest.approx(losses[k], rel=1e-12)


def _random_scales(g, dim: int, tie, pow2: bool) -> torch.Tensor:
    n = dim if tie is None else tie[1] * tie[2]
    if pow2:
        t = torch.exp2(torch.randint(-2, 3, (n,), generator=g).double())
    else:
        t = torch.exp(0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    return t if tie is None else awq.expand_heads(t, *tie)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_folding_leaves_the_bf16_models_output_unchanged(name, pow2):
    from qckpt.calib.awq_layer import layer_plan
    from qckpt.calib.instrument import insert_quantizers, instrumentation, remove_quantizers
    from qckpt.models.build import build_model
    from qckpt.recipe import recipe_from_dict

    model = build_model(name, dtype="bfloat16", seed=0).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
    quant = recipe_from_dict({"quant": {"weights": {"format": "nvfp4"}}}).quant
    insert_quantizers(model, quant)
    instr = instrumentation(model)
    on = {id(q) for q in instr.quantizers.values() if q.enabled}
    layers = model.model.layers
    plans = [layer_plan(model, layer, f"model.layers.{i}", instr, on) for i, layer in
             enumerate(layers)]  # fmt: skip
    remove_quantizers(model)
    g = torch.Generator().manual_seed(6)
    changed = set()
    with torch.no_grad():
        for plan in plans:
            keys = [gr.key for gr in plan.groups]
            assert keys[:3] == ["input_layernorm", "self_attn.o_proj", "post_attention_layernorm"]
            for gr in plan.groups:
                changed.update(gr.fold(_random_scales(g, gr.dim, gr.tie, pow2)))
        got = model(input_ids=ids).logits.float()
    assert "model.layers.1.input_layernorm.weight" in changed
    if name == "tiny-moe":  # the router reads the norm too: folded with the experts
        assert {
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.gate_up_proj",
        } <= changed
    else:
        assert "model.layers.0.mlp.up_proj.weight" in changed  # down_proj's fold
    if pow2:  # powers of two: the very values, bit for bit
        assert torch.equal(got, ref)
    else:  # the folded weights rounded to BF16: a BF16 rounding's worth of change
        rel = float((got - ref).norm() / ref.norm())
        assert 0 < rel < 2e-2, rel
