"""Instrumentation of tiny-moe / tiny-dense, and calibrate_model in one process."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.data import calibration_batches
from qckpt.calib.instrument import insert_quantizers, remove_quantizers
from qckpt.calib.state_file import load_calibration, model_fingerprint, save_calibration
from qckpt.models.build import build_model
from qckpt.models.naming import hf_tensors
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import DataConfig, QuantConfig, TensorQuantConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe():
    return build_model("tiny-moe", dtype="float32", seed=0)


def _ids(n=2, seq=24, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _hf_weight_modules(model) -> set[str]:
    mt = model.config.model_type
    return {
        n[: -len(".weight")]
        for name, t in model.state_dict().items()
        for n, _ in hf_tensors(name, t, mt)
        if n.endswith("_proj.weight")
    }


def test_quantizers_cover_every_hf_linear_but_ignored_ones(moe):
    qs = insert_quantizers(moe, QuantConfig())
    try:
        modules = {q.name for q in qs.values()}
        assert modules == _hf_weight_modules(moe)  # per-expert names as save_pretrained writes them
        assert "model.layers.0.mlp.experts.7.down_proj" in modules
        assert not any(m.startswith("lm_head") or m.endswith("mlp.gate") for m in modules)
        assert len(qs) == 2 * len(modules)
    finally:
        remove_quantizers(moe)


def test_ignore_patterns_are_fnmatch_on_module_names(moe):
    cfg = QuantConfig(ignore=["lm_head", "*.mlp.gate", "*.self_attn.*", "model.layers.1.*"])
    qs = insert_quantizers(moe, cfg)
    try:
        names = {q.name for q in qs.values()}
        assert names and all(n.startswith("model.layers.0.mlp.experts.") for n in names)
    finally:
        remove_quantizers(moe)


def test_instrumented_logits_unchanged_and_removal_restores(moe):
    ids = _ids()
    moe.config._experts_implementation = "eager"
    try:
        with torch.no_grad():
            ref = moe(ids).logits
            sd = {k: v.clone() for k, v in moe.state_dict().items()}
            insert_quantizers(moe, QuantConfig())
            assert list(moe.state_dict()) == list(sd)  # nothing registered in the model
            got = moe(ids).logits
            remove_quantizers(moe)
            after = moe(ids).logits
    finally:
        moe.config._experts_implementation = "grouped_mm"
    assert torch.equal(got, ref)  # the same ops as transformers' eager experts, bit for bit
    assert torch.equal(after, ref)
    assert all(torch.equal(v, sd[k]) for k, v in moe.state_dict().items())
    with torch.no_grad():
        default = moe(ids).logits
    torch.testing.assert_close(got, default, rtol=1e-4, atol=1e-4)


def test_expert_input_quantizer_sees_only_its_tokens(moe):
    ids = _ids(seq=8)
    qs = insert_quantizers(moe, QuantConfig())
    captured = {}
    mlp = moe.model.layers[0].mlp
    h = mlp.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0].detach()))
    try:
        with torch.no_grad():
            moe(ids)
    finally:
        h.remove()
        remove_quantizers(moe)
    x = captured["x"].reshape(-1, captured["x"].shape[-1])
    with torch.no_grad():
        _, _, idx = mlp.gate(x)
    for e in range(8):
        q = qs[f"model.layers.0.mlp.experts.{e}.gate_proj.input_amax"]
        up = qs[f"model.layers.0.mlp.experts.{e}.up_proj.input_amax"]
        rows = (idx == e).any(dim=-1)
        if rows.any():
            assert q.amax == x[rows].abs().max()
            assert torch.equal(up.amax, q.amax)  # gate and up read the same input
        else:
            assert q.amax is None


def test_calibrate_model_single_process_state_and_report(moe, tmp_path):
    batches = calibration_batches(
        DataConfig(num_samples=4, seq_len=16, batch_size=2), vocab_size=256
    )
    ticks = []
    state, report = calibrate_model(moe, batches, QuantConfig(), Mesh(), progress=ticks.append)
    assert ticks == [1, 1]
    assert not hasattr(moe, "_qckpt_instrumentation")
    # weight amax from the weight itself, for every expert
    gu = moe.model.layers[1].mlp.experts.gate_up_proj.detach()
    for e in range(8):
        assert (
            state.amax[f"model.layers.1.mlp.experts.{e}.gate_proj.weight_amax"]
            == gu[e, :32].abs().max()
        )
        assert (
            state.amax[f"model.layers.1.mlp.experts.{e}.up_proj.weight_amax"]
            == gu[e, 32:].abs().max()
        )
    names_shapes = [
        (n, tuple(t.shape))
        for k, v in moe.state_dict().items()
        for n, t in hf_tensors(k, v, "qwen3_moe")
    ]
    assert state.model_fingerprint == model_fingerprint(names_shapes)
    assert state.model_type == "qwen3_moe"
    meta = state.quantizers["model.layers.0.self_attn.q_proj.input_amax"]
    assert meta["calibrated"] and meta["granularity"] == "tensor" and meta["format"] == "fp8"
    row = report["layers"]["model.layers.0"]
    assert row["total"] == 56 and row["experts_total"] == 8
    assert row["amax_min"] <= row["amax_max"]
    # round trip through the calibration file
    back = load_calibration(save_calibration(state, tmp_path / "calib.safetensors"))
    assert back.amax.keys() == state.amax.keys()
    assert back.quantizers == state.quantizers


def test_dynamic_inputs_are_disabled_and_nvfp4_weights_are_dynamic_block():
    m = build_model("tiny-dense", dtype="float32")
    cfg = QuantConfig(
        weights=TensorQuantConfig(format="nvfp4"),
        inputs=TensorQuantConfig(dynamic=True),
    )
    state, report = calibrate_model(m, [_ids()], cfg, Mesh())
    q = state.quantizers["model.layers.0.mlp.down_proj.input_amax"]
    assert q["enabled"] is False and "model.layers.0.mlp.down_proj.input_amax" not in state.amax
    w = state.quantizers["model.layers.0.mlp.down_proj.weight_amax"]
    assert (
        w["granularity"] == "dynamic_block"
        and state.amax["model.layers.0.mlp.down_proj.weight_amax"].shape == ()
    )
    assert report["disabled"] == report["quantizers"]


def test_zero_weight_is_calibrated_zero_and_flagged():
    m = build_model("tiny-dense", dtype="float32")
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.zero_()
    state, report = calibrate_model(m, [_ids()], QuantConfig(), Mesh())
    assert state.amax["model.layers.1.mlp.up_proj.weight_amax"].item() == 0.0
    # up is zero, so down_proj's input act(gate) * up is all zeros too: both are flagged
    assert report["layers"]["model.layers.1"]["zero_amax"] == [
        "model.layers.1.mlp.up_proj.weight_amax",
        "model.layers.1.mlp.down_proj.input_amax",
    ]


def test_nan_activation_fails_naming_the_module():
    m = build_model("tiny-dense", dtype="float32")
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")
    with pytest.raises(Exception, match=r"model\.layers\.0\.self_attn\.o_proj.*non-finite"):
        calibrate_model(m, [_ids()], QuantConfig(), Mesh())
    assert not hasattr(m, "_qckpt_instrumentation")


def _one_by_one(model, quant):
    """Every weight quantizer's amax as ``reduce`` takes it from its own slice, one at a time."""
    from qckpt.calib.instrument import instrumentation

    qs = insert_quantizers(model, quant)
    try:
        out = {}
        for src in instrumentation(model).weights:
            q = src.quantizer
            out[q.key] = q.reduce(src.take(model.get_parameter(src.param))).float()
        return out, qs
    finally:
        remove_quantizers(model)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_expert_weight_amax_at_once_equals_one_by_one(dtype):
    """The experts' weight amaxes taken per fused weight at once (one aminmax) are those each
    expert's slice gives alone, bit for bit: signs of the extremes, a -0.0-only expert, an
    expert whose largest magnitude is negative, a value only one row of the gate half holds."""
    from qckpt.calib.instrument import (
        calibrate_weights,
        fused_expert_amax,
        instrumentation,
        settle,
    )

    m = build_model("tiny-moe", dtype=dtype, seed=0)
    experts = m.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.gate_up_proj[2].zero_().neg_()  # -0.0 everywhere: amax +0.0
        experts.gate_up_proj[3, 0, 0] = -1000.0  # the gate half's extreme is negative
        experts.down_proj[5, -1, -1] = 77.0
    ref, _ = _one_by_one(m, QuantConfig())
    qs = insert_quantizers(m, QuantConfig())
    try:
        # every expert slice goes the at-once way (only the attention linears are left)
        left = fused_expert_amax(m, instrumentation(m).weights)
        assert left and not any(".experts." in s.quantizer.name for s in left)
        for q in qs.values():
            q.reset()
        calibrate_weights(m)
        settle(m)
        got = {k: q.amax.float() for k, q in qs.items() if k.endswith(".weight_amax")}
    finally:
        remove_quantizers(m)
    assert sorted(got) == sorted(ref) and any(".experts." in k for k in ref)
    diff = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not diff, diff[:5]
    key = "model.layers.0.mlp.experts.2.gate_proj.weight_amax"
    assert got[key].item() == 0.0 and not torch.signbit(got[key])
    assert got["model.layers.0.mlp.experts.3.gate_proj.weight_amax"].item() == 1000.0
    assert got["model.layers.0.mlp.experts.5.down_proj.weight_amax"].item() == 77.0


def test_nan_in_one_experts_weight_fails_naming_that_expert():
    from qckpt.calib.instrument import calibrate_weights, settle
    from qckpt.errors import CalibrationError

    m = build_model("tiny-moe", dtype="bfloat16", seed=0)
    with torch.no_grad():
        m.model.layers[1].mlp.experts.gate_up_proj[4, -1, 3] = float("nan")  # up half
    insert_quantizers(m, QuantConfig())
    try:
        calibrate_weights(m)
        with pytest.raises(CalibrationError, match=r"experts\.4\.up_proj: non-finite weight"):
            settle(m)
    finally:
        remove_quantizers(m)


@pytest.mark.parametrize("world", [2, 3])
def test_weight_amaxes_are_dealt_by_parameter_over_dp_ranks(moe, world):
    from qckpt.calib.instrument import instrumentation
    from qckpt.calib.weight_amax import split_weights

    insert_quantizers(moe, QuantConfig())
    try:
        sources = [s for s in instrumentation(moe).weights if s.quantizer.enabled]
    finally:
        remove_quantizers(moe)
    shares = [split_weights(sources, world, r) for r in range(world)]
    names = [s.quantizer.name for s in sources]
    # every weight quantizer on exactly one rank
    assert sorted(n for sh in shares for n in sh) == sorted(names)
    # a parameter's quantizers (a fused experts weight's slices) all on one rank, so that
    # rank alone reduces that weight
    by_param: dict[str, set[int]] = {}
    for s in sources:
        by_param.setdefault(s.param, set()).update(
            r for r, sh in enumerate(shares) if s.quantizer.name in sh
        )
    assert all(len(rs) == 1 for rs in by_param.values()), by_param
    fused = [p for p in by_param if p.endswith("experts.gate_up_proj")]
    assert fused and len({next(iter(by_param[p])) for p in fused}) > 1  # spread, not lumped
    # balanced by elements within one parameter's worth
    size = {p: 0 for p in by_param}
    for s in sources:
        size[s.param] += s.quantizer.shape[0] * s.quantizer.shape[1]
    loads = [sum(v for p, v in size.items() if by_param[p] == {r}) for r in range(world)]
    assert max(loads) - min(loads) <= max(size.values()), loads
