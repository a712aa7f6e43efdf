"""convert.py and sources.py: DCP <-> HF dirs, one tensor at a time, names and shapes."""

from __future__ import annotations

import json

import pytest
import torch

from qckpt.convert.dcp import dcp_to_hf_dir, hf_dir_to_dcp, save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.models.build import build_model
from qckpt.models.quantize_params import quantize_model_params
from qckpt.read.detect import detect_format
from qckpt.read.readers import checkpoint_names_shapes, iter_checkpoint_tensors


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    src = build_model("tiny-moe", seed=3)
    save_model_dcp(src, d / "dcp")
    dcp_to_hf_dir(d / "dcp", d / "hf", src.config)
    dcp_to_hf_dir(d / "dcp", d / "hf_sharded", src.config, max_shard_bytes=50_000)
    return d, src


def test_detect_format(moe, tmp_path):
    d, _ = moe
    assert detect_format(d / "dcp") == "dcp"
    assert detect_format(d / "hf") == "safetensors"
    assert detect_format(d / "hf_sharded") == "safetensors"
    with pytest.raises(CheckpointError, match="neither a DCP"):
        detect_format(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        detect_format(tmp_path / "nope")


def test_iter_dcp_gives_the_state_dict_one_tensor_at_a_time(moe):
    d, src = moe
    ref = src.state_dict()
    got = list(iter_checkpoint_tensors(d / "dcp"))
    assert len(got) == len(ref) and {n for n, _ in got} == set(ref)
    for n, t in got:
        assert t.dtype == ref[n].dtype and torch.equal(t, ref[n]), n


@pytest.mark.parametrize("which", ["hf", "hf_sharded"])
def test_hf_dir_reads_back_in_state_dict_names(moe, which):
    d, src = moe
    ref = src.state_dict()
    if which == "hf_sharded":
        index = json.loads((d / which / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in ref.values()
        )
    shapes = checkpoint_names_shapes(d / which)
    assert shapes == {k: (tuple(v.shape), v.dtype) for k, v in ref.items()}
    for n, t in iter_checkpoint_tensors(d / which):
        assert torch.equal(t, ref[n]), n


def test_hf_dir_has_per_expert_names_and_loads_in_transformers(moe):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    d, src = moe
    with safe_open(str(d / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    hf = AutoModelForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.bfloat16)
    for k, v in src.state_dict().items():
        assert torch.equal(v, hf.state_dict()[k]), k


def test_hf_dir_to_dcp_round_trip(moe, tmp_path):
    d, src = moe
    for model in (build_model("tiny-moe", seed=0), None):
        out = tmp_path / ("with" if model is not None else "without")
        hf_dir_to_dcp(d / "hf_sharded", out, model)
        assert detect_format(out) == "dcp"
        got = dict(iter_checkpoint_tensors(out))
        ref = src.state_dict()
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_save_model_dcp_dequantizes_quantized_params(tmp_path):
    m = build_model("tiny-dense", seed=1)
    quantize_model_params(m, "fp8", ignore=["lm_head"])
    save_model_dcp(m, tmp_path / "c")
    got = dict(iter_checkpoint_tensors(tmp_path / "c"))
    q = m.model.layers[0].self_attn.q_proj.weight
    w = got["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == torch.bfloat16 and torch.equal(w, q.dequantize(torch.bfloat16))


def test_quantize_model_params_replaces_linears_and_fused_experts():
    from qckpt import formats

    m = build_model("tiny-moe", seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    done = quantize_model_params(m, "fp8", ignore=["lm_head", "*.mlp.gate"])
    want = {
        f"model.layers.{i}.{n}"
        for i in range(2)
        for n in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
        )
    }
    assert done == dict.fromkeys(want, "fp8")
    for k, v in m.state_dict(keep_vars=True).items():
        assert formats.is_quantized(v) is (k in want), k
        if k in want:
            assert isinstance(v, torch.nn.Parameter) or v.requires_grad is False
            assert v.requires_grad is False
            assert torch.equal(
                v.dequantize(torch.bfloat16),
                formats.quantize(before[k], "fp8").dequantize(torch.bfloat16),
            )
        else:
            assert torch.equal(v.detach(), before[k])
    m2 = build_model("tiny-moe", seed=0)
    assert quantize_model_params(m2, "none") == {}
    assert not any(formats.is_quantized(v) for v in m2.state_dict(keep_vars=True).values())
