import torch
from safetensors.torch import load_file

from qckpt.models.build import build_model
from qckpt.models.naming import expert_slices, hf_tensors


def _hf_state(model):
    out = {}
    for name, t in model.state_dict().items():
        for hf_name, v in hf_tensors(name, t, model.config.model_type):
            out[hf_name] = v
    return out


def test_hf_names_and_values_match_save_pretrained(tmp_path):
    model = build_model("tiny-moe")
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = _hf_state(model)
    assert sorted(ours) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(ours[k], v), k


def test_expert_slices_address_the_fused_weights():
    model = build_model("tiny-moe")
    experts = model.model.layers[0].mlp.experts
    sl = expert_slices(
        "model.layers.0.mlp.experts",
        "qwen3_moe",
        experts.gate_up_proj.shape,
        experts.down_proj.shape,
    )
    assert len(sl) == 3 * experts.gate_up_proj.shape[0]
    hf = _hf_state(model)
    for s in sl:
        fused = experts.gate_up_proj if s.param_name.endswith("gate_up_proj") else experts.down_proj
        assert torch.equal(s.take(fused.detach()), hf[s.hf_module + ".weight"]), s.hf_module


def test_mixtral_names_follow_its_checkpoint():
    t = torch.zeros(2, 8, 4)
    names = [n for n, _ in hf_tensors("model.layers.0.mlp.experts.gate_up_proj", t, "mixtral")]
    assert names[:2] == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
    ]
