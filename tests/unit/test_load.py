"""load_checkpoint: streaming vs bulk, every format, main params, errors, the report."""

from __future__ import annotations

import inspect
import os
import pickle

import pytest
import torch

import qckpt.load.loader as load_mod
from qckpt import formats
from qckpt.convert.dcp import dcp_to_hf_dir, save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.load.loader import LoadReport, load_checkpoint
from qckpt.models.quantize_params import quantize_model_params
from qckpt.plot import plot_memory
from qckpt.recipe import recipe_from_dict
from tests._bits import bits
from tests.toy import FMTS, Toy, assert_same_model, same_tensor, toy_quantized


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy") / "dcp"
    src = Toy(seed=1)
    save_model_dcp(src, d)
    return d, src


# ---- stream vs bulk, every format --------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_stream_and_bulk_give_identical_params(toy_ckpt, fmt):
    path, src = toy_ckpt
    a, b = toy_quantized(fmt), toy_quantized(fmt)
    # the plain reader: one scratch at a time, so the transient is exact (the fast reader's
    # bound and values: tests/unit/test_fast_read.py)
    ra = load_checkpoint(a, path, stream=True, reader="plain")
    rb = load_checkpoint(b, path, stream=False, reader="plain")
    assert ra.stream and not rb.stream
    assert_same_model(a, b)
    # and the load really wrote the checkpoint's values: each quantized param equals
    # quantizing the checkpoint tensor directly
    ref = src.state_dict()
    for name, p in a.state_dict(keep_vars=True).items():
        if formats.is_quantized(p):
            if fmt == "fp8_delayed":
                want = formats.quantize(torch.zeros_like(ref[name]), fmt)
                want.load_quant_state(p.quant_state())
                want.scale.copy_(p.quant_scale)
                want.quantize_(ref[name], update_state=False)
            else:
                want = formats.quantize(ref[name], fmt, **p.opts)
            assert same_tensor(p, want), name
        else:
            assert same_tensor(p.detach(), ref[name]), name
    # transient: one scratch at a time vs every destination at once
    q_numels = [p.numel() for p in a.state_dict(keep_vars=True).values() if formats.is_quantized(p)]
    assert ra.predicted_transient_bytes == 2 * max(q_numels)
    assert ra.transient_bytes == 2 * max(q_numels)
    assert rb.transient_bytes == 2 * sum(q_numels)
    assert ra.tensors_per_format == {"none": 3, fmt: 4}


def test_plain_bf16_round_trips_bit_exactly(toy_ckpt):
    path, src = toy_ckpt
    m = Toy(seed=5)
    rep = load_checkpoint(m, path)
    assert rep.tensors_per_format == {"none": 7}
    assert rep.transient_bytes == 0 and rep.predicted_transient_bytes == 0
    assert_same_model(m, src)


def test_plain_tensors_untouched_by_streaming_path(toy_ckpt):
    """Plain destinations keep their storage (the default path copies into them)."""
    path, src = toy_ckpt
    m = toy_quantized("fp8")
    ptrs = {
        k: v.data_ptr()
        for k, v in m.state_dict(keep_vars=True).items()
        if not formats.is_quantized(v)
    }
    load_checkpoint(m, path)
    for k, v in m.state_dict(keep_vars=True).items():
        if k in ptrs:
            assert v.data_ptr() == ptrs[k]
            assert same_tensor(v.detach(), src.state_dict()[k])


def test_streaming_is_the_default(toy_ckpt):
    assert inspect.signature(load_checkpoint).parameters["stream"].default is True
    assert recipe_from_dict({}).load.stream is True
    ticks = []
    rep = load_checkpoint(toy_quantized("fp8"), toy_ckpt[0], progress=ticks.append)
    assert rep.stream is True and rep.reader == "fast" and rep.max_inflight == 1
    # one scratch live at a time: the largest quantized param (4x64x32 BF16)
    assert 2 * 4 * 64 * 32 <= rep.transient_bytes <= rep.predicted_transient_bytes
    assert rep.predicted_transient_bytes == 2 * (4 * 64 * 32)
    assert sum(ticks) == rep.tensors == 7  # progress: one tick per finished tensor


def test_recipe_flags_reach_the_planner(toy_ckpt, monkeypatch):
    seen = []
    real = load_mod.StreamingDequantLoadPlanner

    class Spy(real):
        def __init__(self, **kw):
            seen.append(kw)
            super().__init__(**kw)

    monkeypatch.setattr(load_mod, "StreamingDequantLoadPlanner", Spy)
    for overrides, want in (
        (["load.main_params=fp32"], {"stream": True, "main": True}),
        ([], {"stream": True, "main": False}),
        (["load.stream=false"], {"stream": False, "main": False}),
        (["load.stream=false", "load.main_params=fp32"], {"stream": False, "main": True}),
    ):
        seen.clear()
        r = recipe_from_dict({}, overrides)
        rep = load_checkpoint(
            toy_quantized("fp8"), toy_ckpt[0], stream=r.load.stream, main_params=r.load.main_params
        )
        assert rep.stream is want["stream"]
        if want["stream"]:
            assert len(seen) == 1 and seen[0]["main_params"] is want["main"]
        else:
            assert seen == []  # the bulk path does not use the streaming planner
        assert (rep.main_params == "fp32") is want["main"]
        assert bool(rep.main_param_tensors) is want["main"]


# ---- delayed scaling ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_delayed_scaling_state_is_bit_identical(toy_ckpt, stream):
    m = toy_quantized("fp8_delayed")
    sentinel = {}
    for name, p in m.state_dict(keep_vars=True).items():
        if formats.is_quantized(p):
            p.amax_history.copy_(torch.linspace(3.0, 7.0, p.amax_history.numel()) * 1.2345678)
            p.quant_scale.fill_(0.0123456789)
            sentinel[name] = {k: v.clone() for k, v in p.quant_state().items()}
    assert sentinel
    load_checkpoint(m, toy_ckpt[0], stream=stream)
    for name, p in m.state_dict(keep_vars=True).items():
        if name in sentinel:
            for k, v in p.quant_state().items():
                assert torch.equal(bits(v), bits(sentinel[name][k])), (name, k)
            # the codes were written with the kept quantizer scale
            assert torch.equal(p.scale, sentinel[name]["quant_scale"])


# ---- FP32 main params --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_main_params_fp32_equal_the_checkpoint_bit_for_bit(tmp_path, stream):
    src = Toy(seed=3, dtype=torch.float32)  # an FP32 checkpoint: a BF16 scratch would round it
    save_model_dcp(src, tmp_path / "c")
    m = toy_quantized("fp8")
    rep = load_checkpoint(m, tmp_path / "c", stream=stream, main_params="fp32")
    masters = rep.main_param_tensors
    qnames = {k for k, v in m.state_dict(keep_vars=True).items() if formats.is_quantized(v)}
    assert set(masters) == qnames
    for k in qnames:
        assert masters[k].dtype == torch.float32
        assert torch.equal(bits(masters[k]), bits(src.state_dict()[k])), k
    assert rep.main_params_bytes == sum(4 * masters[k].numel() for k in qnames)
    # the quantized params are what a load without main params gives
    ref = toy_quantized("fp8")
    load_checkpoint(ref, tmp_path / "c", stream=stream)
    assert_same_model(m, ref)
    assert "main_param_tensors" not in rep.to_dict()


# ---- sources: HF dirs load like DCP ------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_loads_like_dcp(tmp_path, sharded):
    from qckpt.models.build import build_model

    src = build_model("tiny-moe", seed=1)
    save_model_dcp(src, tmp_path / "dcp")
    dcp_to_hf_dir(
        tmp_path / "dcp", tmp_path / "hf", src.config, max_shard_bytes=60_000 if sharded else None
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() is sharded
    a = build_model("tiny-moe", seed=7)
    b = build_model("tiny-moe", seed=7)
    quantize_model_params(a, "fp8", ignore=["lm_head"])
    quantize_model_params(b, "fp8", ignore=["lm_head"])
    ra = load_checkpoint(a, tmp_path / "dcp", reader="plain")
    rb = load_checkpoint(b, tmp_path / "hf", reader="plain")
    assert (ra.format, rb.format) == ("dcp", "safetensors")
    assert_same_model(a, b)
    # fused experts arrive as one read item per expert and projection, quantized once
    assert rb.read_items == ra.read_items + 2 * (3 * 8 - 2)
    assert rb.transient_bytes == rb.predicted_transient_bytes == 2 * 8 * 64 * 64


# ---- errors ------------------------------------------------------------------------------------


def _save_dict(sd, path):
    save_model_dcp(sd, path)
    return path


def test_missing_key_is_one_line_error_naming_it(tmp_path):
    sd = Toy(seed=1).state_dict()
    del sd["moe.experts.down_proj"]
    _save_dict(sd, tmp_path / "c")
    for fmt in ("none", "fp8"):
        m = Toy() if fmt == "none" else toy_quantized(fmt)
        with pytest.raises(CheckpointError) as ei:
            load_checkpoint(m, tmp_path / "c")
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith("moe.experts.down_proj: missing"), msg


def test_wrong_shape_is_one_line_error_naming_it(tmp_path):
    sd = Toy(seed=1).state_dict()
    sd["l1.weight"] = torch.zeros(96, 32, dtype=torch.bfloat16)
    _save_dict(sd, tmp_path / "c")
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(toy_quantized("fp8"), tmp_path / "c")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("l1.weight: shape (96, 32)") and "(96, 64)" in msg


def test_wrong_dtype_is_one_line_error_naming_it(tmp_path):
    sd = Toy(seed=1).state_dict()
    sd["norm.bias"] = torch.zeros(64, dtype=torch.int32)
    _save_dict(sd, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"^norm\.bias: dtype torch\.int32 .* cannot load"):
        load_checkpoint(toy_quantized("fp8"), tmp_path / "c")


def test_missing_expert_in_hf_dir_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from qckpt.models.build import build_model

    src = build_model("tiny-moe", seed=1)
    save_model_dcp(src, tmp_path / "dcp")
    dcp_to_hf_dir(tmp_path / "dcp", tmp_path / "hf", src.config)
    f = tmp_path / "hf" / "model.safetensors"
    t = load_file(str(f))
    del t["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(t, str(f))
    m = build_model("tiny-moe")
    quantize_model_params(m, "fp8")
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(m, tmp_path / "hf")
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("model.layers.1.mlp.experts.gate_up_proj: missing")
    assert "experts.5.up_proj.weight" in msg


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_evil_metadata_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = str(marker)
    d = tmp_path / "c"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(toy_quantized("fp8"), d)
    assert not marker.exists()


def test_nan_in_checkpoint_names_the_tensor(tmp_path):
    sd = Toy(seed=1).state_dict()
    sd["l2.weight"][3, 4] = float("nan")
    _save_dict(sd, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"^l2\.weight: cannot quantize"):
        load_checkpoint(toy_quantized("fp8"), tmp_path / "c")


@pytest.mark.parametrize("reader", ["fast", "plain"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_nan_checks_deferred_name_the_first_bad_tensor(tmp_path, reader, fmt):
    # the NaN/Inf checks of a load are made once, after its last item: the first bad
    # destination in plan order is still the one named, whatever follows it
    sd = Toy(seed=1).state_dict()
    sd["l1.weight"][0, 1] = float("inf")
    sd["l2.weight"][3, 4] = float("nan")
    _save_dict(sd, tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"^l1\.weight: cannot quantize.*Inf values$"):
        load_checkpoint(toy_quantized(fmt), tmp_path / "c", reader=reader)
    # a clean checkpoint loaded afterwards by a new load is not blamed for the old one's checks
    good = Toy(seed=1).state_dict()
    _save_dict(good, tmp_path / "g")
    load_checkpoint(toy_quantized(fmt), tmp_path / "g", reader=reader)


# ---- report and plot ---------------------------------------------------------------------------


def test_report_fields_and_plot(toy_ckpt, tmp_path):
    path, _ = toy_ckpt
    a = load_checkpoint(toy_quantized("fp8"), path, stream=True)
    b = load_checkpoint(toy_quantized("fp8"), path, stream=False)
    for r in (a, b):
        d = r.to_dict()
        for k in (
            "transient_bytes",
            "predicted_transient_bytes",
            "peak_bytes",
            "host_peak_rss_bytes",
            "measured_by",
            "bytes_read",
            "seconds",
            "gbps",
            "tensors_per_format",
            "stream",
            "samples",
        ):
            assert k in d
        assert d["bytes_read"] > 7 * 64 * 2 and d["seconds"] > 0 and d["gbps"] > 0
        assert "scratch accounting" in d["measured_by"] and "RSS" in d["measured_by"]
        assert len(d["samples"]) >= d["read_items"]
        assert d["peak_bytes"] >= d["host_peak_rss_bytes"] > 0
    # the stream's level returns to zero after each destination; the bulk's peaks at the sum
    assert max(s[1] for s in a.samples) == a.transient_bytes
    assert max(s[1] for s in b.samples) == b.transient_bytes
    assert a.samples[-1][1] == 0 and b.samples[-1][1] == 0
    out = plot_memory([b, a], tmp_path / "mem.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(a, LoadReport)


def test_tied_weights_load_from_the_name_the_checkpoint_holds(tmp_path):
    src = Toy(seed=1)
    save_model_dcp(src, tmp_path / "c")  # holds l1.weight only, as save_pretrained would
    m = Toy(seed=2)
    m.l3 = m.l1  # the same weight under two names (l1.weight, l3.weight)
    assert "l3.weight" in m.state_dict()
    rep = load_checkpoint(m, tmp_path / "c")
    assert rep.tensors == 7
    assert m.l3.weight is m.l1.weight and torch.equal(m.l1.weight, src.l1.weight)
