"""The instrumented MoE forwards (calibrate.moe_forward: eager | grouped) and their amaxes.

The reference is the slow way, written here: transformers' eager experts loop with one
``abs().amax()`` per expert and per linear, on the same model and data. The segmented maxes
of both instrumented forwards must give the same amaxes bit for bit, and the same tokens.
"""

import pytest
import torch
from torch import nn

from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.instrument import insert_quantizers, remove_quantizers
from qckpt.errors import CalibrationError, RecipeError
from qckpt.models.build import build_model
from qckpt.models.naming import is_fused_experts
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import QuantConfig, recipe_from_dict


def _batches(n=3, seq=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, seq), generator=g) for _ in range(n)]


def _reference(model: nn.Module, batches) -> tuple[dict, dict]:
    """Input amaxes (and tokens per expert) one module and one expert at a time."""
    amax, tokens, handles, patched = {}, {}, [], []

    def keep(key, x):
        a = x.detach().abs().amax().float()
        amax[key] = a if key not in amax else torch.maximum(amax[key], a)

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith(("lm_head", "mlp.gate")):
            hook = (lambda k: lambda _m, args: keep(k, args[0]))(f"{name}.input_amax")
            handles.append(mod.register_forward_pre_hook(hook))
        elif is_fused_experts(mod):
            mod.forward = _reference_experts(mod, name, keep, tokens)
            patched.append(mod)
    try:
        with torch.no_grad():
            for b in batches:
                model(input_ids=b, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        for mod in patched:
            del mod.forward
    return amax, tokens


def _reference_experts(mod, name, keep, tokens):
    def forward(hidden, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden)
        for e in range(mod.gate_up_proj.shape[0]):
            pos, tok = torch.where(top_k_index.t() == e)
            if tok.numel() == 0:
                continue
            tokens[(name, e)] = tokens.get((name, e), 0) + tok.numel()
            x = hidden[tok]
            keep(f"{name}.{e}.gate_proj.input_amax", x)
            keep(f"{name}.{e}.up_proj.input_amax", x)
            gate, up = nn.functional.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
            h = mod.act_fn(gate) * up
            keep(f"{name}.{e}.down_proj.input_amax", h)
            h = nn.functional.linear(h, mod.down_proj[e]) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, h.to(final.dtype))
        return final

    return forward


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("source", ["tiny-moe", "tiny-dense"])
def test_eager_and_grouped_amaxes_equal_the_one_expert_at_a_time_reference(source, dtype):
    model = build_model(source, dtype=dtype)
    batches = _batches()
    ref, ref_tokens = _reference(model, batches)
    quant = QuantConfig(ignore=["lm_head", "*.mlp.gate"])
    for mode in ("eager", "grouped"):
        state, report = calibrate_model(
            model, batches, quant, Mesh(), share_expert_inputs=False, moe_forward=mode
        )
        got = {k: v for k, v in state.amax.items() if k.endswith("input_amax")}
        assert sorted(got) == sorted(ref), mode
        diff = [k for k in ref if not torch.equal(got[k], ref[k])]
        assert not diff, (mode, diff[:4])
        seen = {
            (layer + ".mlp.experts", int(e)): sum(counts)
            for layer, row in report["layers"].items()
            for e, counts in row.get("expert_tokens", {}).items()
            if sum(counts)
        }
        assert seen == ref_tokens, mode
    assert not hasattr(model, "_qckpt_instrumentation")


def test_per_block_inputs_are_the_same_in_both_forwards():
    model = build_model("tiny-moe", dtype="bfloat16")
    quant = recipe_from_dict(
        {"quant": {"inputs": {"format": "fp8", "granularity": "block", "block_size": [16]}}}
    ).quant
    batches = _batches()
    out = {}
    for mode in ("eager", "grouped"):
        state, _ = calibrate_model(model, batches, quant, Mesh(), moe_forward=mode)
        out[mode] = state.amax
    k = "model.layers.1.mlp.experts.3.down_proj.input_amax"
    assert out["eager"][k].shape == (2,)  # moe_intermediate 32 in blocks of 16
    assert sorted(out["eager"]) == sorted(out["grouped"])
    assert all(torch.equal(out["eager"][k], out["grouped"][k]) for k in out["eager"])


def test_a_nan_activation_is_reported_after_the_forward_naming_the_module():
    model = build_model("tiny-moe", dtype="float32")
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(float("nan"))
    qs = insert_quantizers(model, QuantConfig())
    try:
        with torch.no_grad():  # the hooks do not sync: the forward itself runs through
            model(input_ids=_batches(1)[0], use_cache=False)
        with pytest.raises(
            CalibrationError, match=r"layers\.0\.self_attn\.q_proj: non-finite input"
        ):
            qs["model.layers.0.self_attn.q_proj.input_amax"].amax  # noqa: B018 - reading settles
    finally:
        remove_quantizers(model)
    with pytest.raises(CalibrationError, match=r"layers\.0\.self_attn\.q_proj: non-finite input"):
        calibrate_model(model, _batches(1), QuantConfig(), Mesh(), moe_forward="grouped")


def test_moe_forward_setting_is_checked():
    with pytest.raises(RecipeError, match=r"calibrate\.moe_forward: grouped needs"):
        recipe_from_dict({"calibrate": {"moe_forward": "grouped", "weights_resident": "fp8"}})
    with pytest.raises(RecipeError, match=r"calibrate\.moe_forward"):
        recipe_from_dict({"calibrate": {"moe_forward": "fast"}})
    with pytest.raises(CalibrationError, match=r"calibrate\.moe_forward"):
        insert_quantizers(build_model("tiny-moe"), QuantConfig(), moe_forward="fast")
