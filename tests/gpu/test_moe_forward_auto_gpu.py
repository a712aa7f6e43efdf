"""calibrate.moe_forward: auto on CUDA: grouped GEMMs (``torch._grouped_mm``) against eager's
per-expert cuBLAS GEMMs, bit for bit, on a Qwen3-MoE of realistic widths.

    CUDA_VISIBLE_DEVICES=0 pytest -q tests/gpu/test_moe_forward_auto_gpu.py   # skipped without CUDA

auto checks only the first experts call of a process; here every layer's rows are compared
(what GPTQ's Hessians, AWQ's statistics and mse's histograms are made of), with the amaxes and
GPTQ's weights, so a GPU whose grouped kernel rounds otherwise on a later layer's group sizes
shows here. A GPU where auto falls back to eager fails the first assertion with auto's reason:
the default then runs eager there (correct, not fast).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qckpt.calib import moe_forward
from qckpt.calib.algorithms import Gptq
from qckpt.calib.calibrate import calibrate_model
from qckpt.calib.instrument import insert_quantizers, instrumentation, remove_quantizers
from qckpt.parallel.mesh import Mesh
from qckpt.recipe import QuantConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model() -> nn.Module:
    """Qwen3-30B-A3B's expert widths (hidden 2048, 768 per expert, 128 experts, top-8), 4 layers."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _rows(model: nn.Module, mode: str, batches) -> tuple[dict, dict]:
    """Each (layer, side, expert)'s tapped rows, and which forward ran."""
    insert_quantizers(model, QuantConfig(), moe_forward=mode)
    rows: dict[tuple, list[torch.Tensor]] = {}
    try:
        for name, mod in model.named_modules():
            obs = getattr(getattr(mod, "forward", None), "observer", None)
            if obs is None:
                continue
            for side, seg in (("gate_up", obs.gate_up), ("down", obs.down)):

                def tap(x, ids, name=name, side=side):
                    uniq, counts = torch.unique_consecutive(ids, return_counts=True)
                    for e, part in zip(uniq.tolist(), x.split(counts.tolist()), strict=True):
                        rows.setdefault((name, side, e), []).append(part.clone())

                seg.tap = tap
        with torch.no_grad():
            for b in batches:
                model(input_ids=b, use_cache=False)
        report = instrumentation(model).moe.report(True)
    finally:
        remove_quantizers(model)
    return {k: torch.cat(v) for k, v in rows.items()}, report


def test_auto_is_grouped_and_every_layers_rows_are_eagers_bit_for_bit():
    moe_forward.forget_verdicts()
    model = _model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (4, 512), generator=g).cuda() for _ in range(2)]
    ref, _ = _rows(model, "eager", batches)
    got, rep = _rows(model, "auto", batches)
    assert rep["used"] == "grouped", rep["why"]
    assert sorted(got) == sorted(ref)
    bad = [k for k in ref if not torch.equal(ref[k].view(torch.int16), got[k].view(torch.int16))]
    assert not bad, (len(bad), bad[:4])


def test_auto_gptq_weights_and_amaxes_are_eagers_on_cuda():
    batches = [torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(2))]
    batches = [b.cuda() for b in batches]
    out = {}
    for mode in ("eager", "auto"):  # a model each: gptq writes its weights into the model
        state, report = calibrate_model(_model(), batches, QuantConfig(), Mesh(), moe_forward=mode,
                                        algorithm=Gptq())  # fmt: skip
        out[mode] = state, report["moe_forward"]
    (ref, _), (got, rep) = out["eager"], out["auto"]
    assert rep["used"] == "grouped", rep["why"]
    assert all(torch.equal(ref.amax[k], got.amax[k]) for k in ref.amax)
    assert sorted(ref.weights) == sorted(got.weights)
    assert all(torch.equal(ref.weights[k], got.weights[k]) for k in ref.weights)
