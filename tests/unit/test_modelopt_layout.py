"""The ModelOpt layout equals what ModelOpt 0.47 itself writes for the same tiny model.

The fixtures in ``tests/fixtures/modelopt/`` come from ModelOpt's own ``export_hf_checkpoint``
(``make_fixtures.py`` there says how): ``config.json``'s ``quantization_config``,
``hf_quant_config.json`` and every tensor's name, dtype and shape. qckpt's export of the same
model with the same scheme must match them field for field, the producer aside. The scale
relations ModelOpt keeps (an expert's gate/up share a weight scale, a layer's experts share their
input scales) must hold with ``export.moe_scales: shared`` and not be forced with ``per_expert``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.export_fixtures import make_calibration, quant_config, run_export, saved_model

FIXTURES = Path(__file__).parents[1] / "fixtures" / "modelopt"
SCHEMES = {  # fixture name -> qckpt recipe
    "fp8": dict(weights="tensor", inputs="static"),
    "fp8_kv": dict(weights="tensor", inputs="static", kv=True),
    "fp8_pcpt": dict(weights="channel", inputs="token"),
    "nvfp4": dict(weights="tensor", inputs="static", fmt="nvfp4"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("modelopt_layout")


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            got.update({k: sf.get_tensor(k) for k in sf.keys()})
    return got


def _no_producer(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "producer"}


_DONE: dict[Path, Path] = {}


def _export(root: Path, source: str, scheme: str, **kw) -> Path:
    out = root / "-".join([source, scheme, *(f"{k}_{v}" for k, v in kw.items())])
    if out not in _DONE:  # the shared-scales test reuses the parametrized test's export
        model, hf_dir = saved_model(root, source)
        q = quant_config(**SCHEMES[scheme])
        run_export(model, hf_dir, make_calibration(model, q), out, q, fmt="modelopt", **kw)
        _DONE[out] = out
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("source", ["tiny-dense", "tiny-moe"])
def test_modelopt_layout_equals_modelopts_own_export(root, source, scheme):
    ref = json.loads((FIXTURES / f"{source}-{scheme}.json").read_text())
    out = _export(root, source, scheme)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    hfq = json.loads((out / "hf_quant_config.json").read_text())
    assert _no_producer(cfg) == _no_producer(ref["quantization_config"])
    assert cfg["producer"]["name"] == "qckpt"
    assert _no_producer(hfq) == _no_producer(ref["hf_quant_config"])
    assert hfq["producer"]["name"] == "qckpt"
    listing = {
        k: f"{str(v.dtype).removeprefix('torch.')} {list(v.shape)}"
        for k, v in _tensors(out).items()
    }
    assert listing == ref["tensors"]


def _relations(t: dict[str, torch.Tensor]) -> tuple[bool, bool]:
    e = "model.layers.0.mlp.experts"
    gate_up = all(
        torch.equal(t[f"{e}.{i}.gate_proj.weight_scale"], t[f"{e}.{i}.up_proj.weight_scale"])
        for i in range(8)
    )
    inputs = all(
        torch.equal(t[f"{e}.{i}.{p}.input_scale"], t[f"{e}.0.{p}.input_scale"])
        for i in range(8)
        for p in ("gate_proj", "up_proj", "down_proj")
    )
    return gate_up, inputs


def test_moe_scales_shared_as_modelopt_does_and_per_expert_kept(root):
    ref = json.loads((FIXTURES / "tiny-moe-fp8.json").read_text())["relations"]
    shared = _tensors(_export(root, "tiny-moe", "fp8"))
    assert _relations(shared) == (True, True)
    assert ref["expert gate/up weight_scale equal"]
    assert ref["expert down_proj input_scale equal across experts"]
    per_expert = _tensors(_export(root, "tiny-moe", "fp8", moe_scales="per_expert"))
    # the test's calibration gives each expert its own down input amax and gate/up weight amax
    assert _relations(per_expert) == (False, False)
    # shared = the max of the two, so neither gate's nor up's values are clipped
    e = "model.layers.0.mlp.experts.3"
    assert shared[f"{e}.gate_proj.weight_scale"] == torch.maximum(
        per_expert[f"{e}.gate_proj.weight_scale"], per_expert[f"{e}.up_proj.weight_scale"]
    )


def test_transformers_does_not_dequantize_modelopt_exports(root):
    """README and docs/CLIENTS.md say so: transformers (5.24 here) has no ModelOpt quantizer and
    loads the FP8 codes as if they were weights. If this starts to fail, transformers learned
    the layout: update both documents."""
    from transformers import AutoModelForCausalLM

    model, _ = saved_model(root, "tiny-dense")
    loaded = AutoModelForCausalLM.from_pretrained(_export(root, "tiny-dense", "fp8"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = model(ids).logits.float(), loaded(ids).logits.float()
    assert torch.nn.functional.cosine_similarity(ref, got, dim=-1).min() < 0.5


def test_export_warns_for_what_vllm_cannot_serve(root):
    """FP8_PER_CHANNEL_PER_TOKEN MoE experts: vLLM 0.26 refuses them (ModelOpt's own export
    too; docs/CLIENTS.md); the dense model's per-channel export serves, so no warning there."""
    q = quant_config(**SCHEMES["fp8_pcpt"])
    reports = {}
    for source in ("tiny-moe", "tiny-dense"):
        model, hf_dir = saved_model(root, source)
        out = root / f"warn-{source}"
        reports[source] = run_export(model, hf_dir, make_calibration(model, q), out, q, "modelopt")
    (warning,) = reports["tiny-moe"].warnings
    assert "vLLM 0.26 cannot load FP8_PER_CHANNEL_PER_TOKEN MoE experts" in warning
    assert reports["tiny-dense"].warnings == []
