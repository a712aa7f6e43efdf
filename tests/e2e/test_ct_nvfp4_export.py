"""compressed-tensors NVFP4 exports (``nvfp4-pack-quantized``) from a DeepSeek-style
blockwise-FP8 source: compressed-tensors' own decompressor gives the values qckpt reads back,
``qckpt check`` passes them, and transformers loads the dense model with logits close to the
dequantized source.

transformers 5.24 on CPU cannot dequantize NVFP4 MoE experts (docs/CLIENTS.md says why), so the
transformers half runs on the tiny dense model; the MoE export is checked through
compressed-tensors' decompressor, module by module.
"""

from __future__ import annotations

import json

import pytest
import torch

from qckpt import build_model, check_export, load_checkpoint
from tests import quantized_fixtures as fx
from tests.export_fixtures import make_calibration, quant_config, run_export
from tests.unit.test_quantized_sources import loaded_hf, same_bits, stored

IGNORE = ["lm_head", "*.mlp.gate"]


def _nvfp4_quant():
    q = quant_config(fmt="nvfp4")
    q.ignore = list(IGNORE)
    return q


def _source_model(tmp_path, source: str):
    """(blockwise-FP8 source dir, the model holding its dequantized weights)."""
    src = fx.blockwise_fp8(fx.bf16_dir(tmp_path, source), tmp_path / f"{source}-bw", (32, 32))
    model = build_model(str(src), dtype="bfloat16")
    load_checkpoint(model, src)
    return src, model


def _ct_decompressed(d) -> dict[str, torch.Tensor]:
    """Every quantized weight of an export, by compressed-tensors' NVFP4PackedCompressor, with
    the scheme compressed-tensors parses from the export's own config."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    t = stored(d)
    out = {}
    for k in t:
        mod, _, leaf = k.rpartition(".")
        if leaf == "weight_packed":
            sd = {n.rpartition(".")[2]: v for n, v in t.items() if n.rpartition(".")[0] == mod}
            w = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
            out[f"{mod}.weight"] = w.to(torch.bfloat16)
    return out


def test_moe_export_is_what_compressed_tensors_decompresses(tmp_path):
    src, model = _source_model(tmp_path, "tiny-moe")
    q = _nvfp4_quant()
    out = tmp_path / "nvfp4"
    rep = run_export(model, src, make_calibration(model, q), out, q, source_dir=src)
    assert len(rep.warnings) == 1 and "NVFP4 MoE experts" in rep.warnings[0]

    res = check_export(out)
    assert res.ok and res.quantized == 56 and res.experts == 48, res.lines()
    t = stored(out)
    e0 = "model.layers.0.mlp.experts.3"
    g = f"{e0}.gate_proj"
    assert (t[f"{g}.weight_packed"].dtype, t[f"{g}.weight_packed"].shape) == (torch.uint8, (32, 32))
    assert (t[f"{g}.weight_scale"].dtype, t[f"{g}.weight_scale"].shape) == (
        torch.float8_e4m3fn,
        (32, 4),
    )
    assert t[f"{g}.weight_global_scale"].shape == t[f"{g}.input_global_scale"].shape == (1,)
    # moe_scales: shared: one global scale for an expert's gate and up
    assert torch.equal(
        t[f"{e0}.gate_proj.weight_global_scale"], t[f"{e0}.up_proj.weight_global_scale"]
    )

    ref = _ct_decompressed(out)
    assert len(ref) == 56
    back = build_model("tiny-moe", dtype="bfloat16", seed=5)
    assert load_checkpoint(back, out).source_layout.startswith("compressed-tensors")
    got = loaded_hf(back)
    for k, v in ref.items():
        assert same_bits(got[k], v), k


@pytest.mark.timeout(300)
def test_blockwise_fp8_to_ct_nvfp4_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from qckpt import calibrate_model, init_mesh
    from tests.export_fixtures import calib_inputs

    src, model = _source_model(tmp_path, "tiny-dense")
    q = _nvfp4_quant()
    state, _ = calibrate_model(model, calib_inputs(), q, init_mesh(ep=1, tp=1, timeout_s=60))
    out = tmp_path / "nvfp4"
    assert run_export(model, src, state, out, q, source_dir=src).warnings == []
    assert check_export(out).ok, check_export(out).lines()

    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(7))

    def cosine(m) -> torch.Tensor:
        with torch.no_grad():
            got = m(ids).logits.float().reshape(-1, 256)
        return torch.nn.functional.cosine_similarity(got, ref, dim=-1)

    with torch.no_grad():
        ref = model(ids).logits.float().reshape(-1, 256)
    # dequantize=True: the weights dequantized at load, activations left in BF16
    cos = cosine(
        AutoModelForCausalLM.from_pretrained(
            out, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
    )
    # the default: compressed-tensors decompresses the weights on the first forward and also
    # fake-quantizes each linear's input to NVFP4 (W4A4, as a serving stack runs it)
    w4a4 = cosine(AutoModelForCausalLM.from_pretrained(out))
    print(
        f"cosine vs dequantized source: weights-only mean {float(cos.mean()):.4f} min "
        f"{float(cos.min()):.4f}; W4A4 mean {float(w4a4.mean()):.4f} min {float(w4a4.min()):.4f}"
    )
    assert float(cos.mean()) >= 0.99 and float(cos.min()) >= 0.98, cos
    assert float(w4a4.mean()) >= 0.97, w4a4
