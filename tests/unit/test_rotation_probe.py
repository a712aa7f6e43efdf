"""bench.rotation_probe turns the residual stream without changing what the model computes:
the rotated state dict gives the original's logits (float64), and the norms' gains become 1."""

from __future__ import annotations

import pytest
import torch

from bench.rotation_probe import hadamard_rotation, rotate


def test_rotation_is_orthogonal_and_refuses_other_sizes():
    q = hadamard_rotation(64, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert not torch.equal(q, hadamard_rotation(64, seed=4))
    with pytest.raises(SystemExit, match="power of two"):
        hadamard_rotation(48, seed=0)


def test_rotated_llama_computes_the_same_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=50, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # gains away from 1, so that folding them matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    rotate(sd, cfg.num_hidden_layers, hadamard_rotation(64, seed=1))
    assert not torch.allclose(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert all(
        torch.equal(v, torch.ones_like(v)) for k, v in sd.items() if k.endswith("norm.weight")
    )
    model.load_state_dict(sd)
    with torch.no_grad():
        after = model(ids).logits
    # transformers' RMSNorm computes in float32 even in a float64 model: 1e-6, not 1e-12 (a wrong
    # turn or fold moves logits by about 0.1)
    assert torch.allclose(after, before, atol=1e-6), (after - before).abs().max()
