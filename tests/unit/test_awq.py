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


def test_statistics_on_the_grid_are_the_same_for_any_split_of_the_rows():
    from qckpt.calib import gptq

    x = _salient(600, 48)
    amax, bits = float(x.abs().max()), gptq.grid_bits(600)

    def stats(rows):
        xi = gptq.fixed_point(rows, amax, bits)
        return xi.abs().sum(dim=0), xi.t() @ xi

    sums, h = stats(x)
    for cut in (1, 299, 599):
        (s1, h1), (s2, h2) = stats(x[:cut]), stats(x[cut:])
        assert torch.equal(sums, s2 + s1) and torch.equal(h, h2 + h1)
    assert bool((sums == sums.round()).all()) and float(sums.max()) < 2**53
    mean = awq.mean_abs(sums.to(torch.int64), 600, amax, bits)
    assert torch.allclose(mean, x.abs().double().mean(dim=0), rtol=1e-5, atol=0)


def test_awq_beats_max_on_salient_channels_nvfp4():
    x, w = _salient(1024, 128), _weight(64, 128)
    for pow2 in (True, False):
        k, losses, s = awq.search_linear(x, w, Spec("nvfp4"), pow2=pow2)
        assert k > 0 and losses[k] < 0.8 * losses[0], (pow2, losses)
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

    # alpha 0 is max calibration exactly: its loss is rounding-to-nearest's output error (the
    # loss from X^T X on the grid: the direct sum within the grid's resolution)
    def err(y):
        return float((y.double() - (x @ w.float().t()).double()).square().sum())

    rtn = awq.fake_quant(w, spec)
    assert losses[0] == pytest.approx(err(x @ rtn.t()), rel=1e-4)
    assert losses[k] <= losses[0]
    y = (x / s.float()) @ awq.fake_quant(awq.folded(w, s), spec).t()
    assert err(y) == pytest.approx(losses[k], rel=1e-4)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_the_input_term_is_the_inputs_quantization_error_exactly_summed(fmt):
    x, w = _salient(512, 64), _weight(32, 64)
    s = awq.scales(x.abs().double().mean(dim=0), 0.5)
    ispec = Spec(fmt)  # the function's math for both (the pass asks it for static FP8 only)
    xs_amax = float((x.abs().amax(dim=0).double() / s).max())
    bits = 62 - 10
    whole = awq.input_error_sums(x, s, ispec, xs_amax, bits)
    split = awq.input_error_sums(x[:77], s, ispec, xs_amax, bits) + awq.input_error_sums(
        x[77:], s, ispec, xs_amax, bits
    )
    assert whole.dtype == torch.int64 and torch.equal(whole, split)
    xs = x / s.float()
    e = awq.fake_quant(xs, ispec, torch.tensor(xs_amax)) - xs
    q = awq.candidate(w, s, Spec("nvfp4"))
    direct = float((q.double().square().sum(dim=0) * e.double().square().sum(dim=0)).sum())
    assert awq.input_loss(q, whole, xs_amax, bits) == pytest.approx(direct, rel=1e-9)
    assert awq.input_spec(Spec("fp8")) == Spec("fp8")
    assert awq.input_spec(Spec("fp8", "block")) is None  # per block: no one stored scale
    assert awq.input_spec(Spec("nvfp4")) is None  # measured worse: QUALITY_ALGORITHMS


def _random_scales(g, dim: int, tie, pow2: bool) -> torch.Tensor:
    n = dim if tie is None else tie[1] * tie[2]
    if pow2:
        t = torch.exp2(torch.randint(-2, 3, (n,), generator=g).double())
    else:
        t = torch.exp(0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    return t if tie is None else awq.expand_heads(t, *tie)


def _qwen2_moe():
    """A tiny Qwen2-MoE: q/k/v biases, a shared expert and its gate beside the routed ones."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.abs().max() == 0:  # biases: not zero, so that folds show
                p.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "qwen2-moe"])
def test_folding_leaves_the_bf16_models_output_unchanged(name, pow2):
    from qckpt.calib.awq_layer import layer_plan
    from qckpt.calib.instrument import insert_quantizers, instrumentation, remove_quantizers
    from qckpt.models.build import build_model
    from qckpt.recipe import recipe_from_dict

    model = _qwen2_moe() if name == "qwen2-moe" else build_model(name, dtype="bfloat16", seed=0)
    model.eval()
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
    m = "model.layers.0"
    if name != "tiny-dense":  # the router reads the norm too: folded with the experts
        assert {f"{m}.mlp.gate.weight", f"{m}.mlp.experts.gate_up_proj"} <= changed
    if name == "qwen2-moe":  # the shared expert and its gate too; v's bias with its rows
        assert {f"{m}.mlp.shared_expert_gate.weight", f"{m}.mlp.shared_expert.up_proj.weight",
                f"{m}.self_attn.v_proj.bias"} <= changed  # fmt: skip
    if name == "tiny-dense":
        assert "model.layers.0.mlp.up_proj.weight" in changed  # down_proj's fold
    if pow2:  # powers of two: the very values, bit for bit
        assert torch.equal(got, ref)
    else:  # the folded weights rounded to BF16: a BF16 rounding's worth of change
        rel = float((got - ref).norm() / ref.norm())
        assert 0 < rel < 2e-2, rel


# -- the pipeline: calibrate, the folded weights beside the file, export, plan ------------------


def _salient_moe():
    """The tiny MoE with a few hidden channels 16x the others after every norm (a trained
    model's outlier channels), so that AWQ has something to find."""
    from qckpt.models.build import build_model

    model = build_model("tiny-moe", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:4] *= 16
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.recipe import load_recipe
    from tests.conftest import ROOT

    d = tmp_path_factory.mktemp("awq")
    save_model_dcp(_salient_moe(), d / "dcp")
    r = load_recipe(
        str(ROOT / "configs" / "tiny-moe.yaml"),
        [
            f"checkpoint.path={d / 'dcp'}",
            "quant.weights.format=nvfp4",
            "quant.inputs.format=nvfp4",
            "calibrate.algorithm=awq",
            f"calibrate.output={d / 'calib.safetensors'}",
            f"export.output={d / 'out'}",
        ],
    )
    return d, r, calibrate(r, Mesh())


def test_the_export_is_the_folded_model_quantized(run):
    from safetensors.torch import load_file

    from qckpt.pipeline.export import export

    d, r, got = run
    side = load_file(str(d / "calib.safetensors.awq" / "ep000.safetensors"))
    rows = [got.report["layers"][f"model.layers.{i}"]["awq"] for i in range(2)]
    assert all(row["loss_awq"] <= row["loss_max"] for row in rows)
    assert got.report["awq_stat_bytes"] > 0 and got.report["algorithm"] == "awq"
    export(r, None)
    out = {}
    for f in (d / "out").glob("*.safetensors"):
        out.update(load_file(str(f)))
    src = _salient_moe().state_dict()
    # every norm and router the folds changed is the export's, as a plain tensor
    norms = [k for k in side if k.endswith("layernorm.weight") or k.endswith("mlp.gate.weight")]
    assert norms
    for k in norms:
        assert torch.equal(out[k], side[k]), k
    # a layer's searched scales moved some of its weights off the checkpoint's
    assert any(not torch.equal(side[k], src[k]) for k in norms)
    # the export's codes are the folded weight's own (NVFP4 by the max rule from its amax)
    from qckpt.formats.nvfp4 import e2m1_values

    m = "model.layers.1.self_attn.q_proj"
    p = out[f"{m}.weight_packed"]
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    s = out[f"{m}.weight_scale"].float() / out[f"{m}.weight_global_scale"].float()
    dq = (e2m1_values(codes).view(p.shape[0], -1, 16) * s.unsqueeze(-1)).reshape(p.shape[0], -1)
    w = side[f"{m}.weight"].float()
    assert float((dq - w).norm() / w.norm()) < 0.2


def test_plan_accounts_for_the_awq_pass(run):
    from qckpt.pipeline.plan import plan

    _d, r, got = run
    (row,) = plan(r, nproc_per_node=1).rows["calibrate"]
    data = r.calibrate.data
    io = 2 * data.num_samples * data.seq_len * 64 * 2  # hidden 64, bf16
    held, bound = got.report["awq_hessian_bytes"], got.report["awq_hessian_bytes_bound"]
    assert 0 < held <= bound
    # the prediction's X^T X are the run's (x2: the sums and the all-reduce's buffer); the rest
    # (one layer's weights, one candidate's work, the statistics) is small here
    assert io + 2 * bound <= row.awq_bytes <= io + 2 * bound + (1 << 20)
    assert row.peak_bytes >= row.awq_bytes


def test_awq_refuses_tp_and_offload_in_one_line():
    from qckpt.calib.calibrate import check_algorithm
    from qckpt.errors import CalibrationError, RecipeError
    from qckpt.parallel.mesh import Mesh
    from qckpt.recipe import recipe_from_dict

    with pytest.raises(CalibrationError, match="awq runs with parallel.tp: 1") as e:
        check_algorithm("awq", Mesh(tp=2, world_size=2), None)
    assert "\n" not in str(e.value)
    with pytest.raises(RecipeError, match="awq needs calibrate.offload: none"):
        recipe_from_dict({"calibrate": {"algorithm": "awq", "offload": "layer"}})
