"""NVFP4 exports give the linears a client fuses one global scale, so that the weight vLLM
builds from them (q/k/v -> qkv_proj, gate/up -> gate_up_proj) is the weight the export means.

vLLM 0.26 keeps one global scale per fused weight: the largest compressed-tensors
``weight_global_scale``, the largest ModelOpt ``weight_scale_2``. With per-linear global scales
it served the shared real-text Llama at 4.79 bits per byte instead of 1.10; the last test here
shows that effect on the real model when ../shared/quality is present.
"""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qckpt import check_export
from tests.export_fixtures import make_calibration, quant_config, run_export, saved_model
from tests.unit.test_quantized_sources import stored

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
FUSED = re.compile(r"\.(?:(q|k|v)_proj|(gate|up)_proj)$")


def _fused_key(module: str) -> str | None:
    m = FUSED.search(module)
    if m is None:
        return None
    return module[: m.start()] + (".qkv" if m.group(1) else ".gate_up")


def _dequant(packed: torch.Tensor, scale: torch.Tensor, per_tensor: float) -> torch.Tensor:
    """value = e2m1 code x its 16-block's E4M3 scale x the per-tensor factor."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return E2M1[codes] * scale.float().repeat_interleave(16, 1) * per_tensor


def _weights(t: dict[str, torch.Tensor], layout: str, as_vllm: bool) -> dict[str, torch.Tensor]:
    """Every quantized weight, dequantized with its own global scale, or as vLLM does: with the
    fused group's (the max of the stored globals, whichever way the layout stores them)."""
    codes, glob = ("weight_packed", "weight_global_scale")
    if layout == "modelopt":
        codes, glob = ("weight", "weight_scale_2")
    mods = [
        k[: -len(codes) - 1] for k, v in t.items() if k.endswith(codes) and v.dtype == torch.uint8
    ]
    groups: dict[str, list[str]] = {}
    for m in mods:
        groups.setdefault(_fused_key(m) or m, []).append(m)
    out = {}
    for m in mods:
        g = max(float(t[f"{o}.{glob}"]) for o in groups[_fused_key(m) or m]) if as_vllm else None
        g = float(t[f"{m}.{glob}"]) if g is None else g
        factor = 1.0 / g if layout == "compressed-tensors" else g
        out[m] = _dequant(t[f"{m}.{codes}"], t[f"{m}.weight_scale"], factor)
    return out


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4-fused")
    model, src = saved_model(root, "tiny-dense")
    q = quant_config(fmt="nvfp4")
    q.ignore = ["lm_head"]
    cal = make_calibration(model, q)
    outs = {}
    for layout in ("compressed-tensors", "modelopt"):
        outs[layout] = root / layout
        run_export(model, src, cal, outs[layout], q, fmt=layout, source_dir=src)
    return model, cal, outs


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_fused_linears_share_one_global_scale(dense, layout):
    model, cal, outs = dense
    t = stored(outs[layout])
    glob = "weight_global_scale" if layout == "compressed-tensors" else "weight_scale_2"
    for i in range(model.config.num_hidden_layers):
        for parent, parts in (
            (f"model.layers.{i}.self_attn", "qkv"),
            (f"model.layers.{i}.mlp", "gu"),
        ):
            names = ("q_proj", "k_proj", "v_proj") if parts == "qkv" else ("gate_proj", "up_proj")
            vals = {float(t[f"{parent}.{n}.{glob}"]) for n in names}
            assert len(vals) == 1, (parent, vals)
            # the shared one is the group's largest calibrated amax (not any other value)
            top = max(float(cal.amax[f"{parent}.{n}.weight_amax"]) for n in names)
            want = (6 * 448) / top if layout == "compressed-tensors" else top / (6 * 448)
            assert math.isclose(vals.pop(), want, rel_tol=1e-6)
    # the calibrated amaxes themselves differ inside a group: the sharing is what made them one
    a = [float(cal.amax[f"model.layers.0.self_attn.{n}_proj.weight_amax"]) for n in "qkv"]
    assert len(set(a)) == 3
    assert check_export(outs[layout]).ok


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_vllm_fused_dequant_is_the_exported_weight(dense, layout):
    _, _, outs = dense
    t = stored(outs[layout])
    own, vllm = _weights(t, layout, False), _weights(t, layout, True)
    assert own.keys() == vllm.keys() and len(own) == 14
    for m in own:
        assert torch.equal(own[m], vllm[m]), m


def test_check_refuses_fused_linears_with_different_global_scales(dense, tmp_path):
    _, _, outs = dense
    bad = tmp_path / "bad"
    shutil.copytree(outs["compressed-tensors"], bad)
    f = next(bad.glob("*.safetensors"))
    sd = load_file(str(f))
    key = "model.layers.1.self_attn.k_proj.weight_global_scale"
    sd[key] = sd[key] * 2
    save_file(sd, str(f), metadata={"format": "pt"})
    res = check_export(bad)
    assert not res.ok
    hit = [p for p in res.problems if "model.layers.1.self_attn" in p and "global" in p]
    assert len(hit) == 1 and "q_proj" in hit[0] and "k_proj" in hit[0], res.problems
