"""gpt-oss's MXFP4 experts (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``) as a source.

The independent reference is transformers' own dequantization of the same bytes
(``integrations/mxfp4.convert_moe_packed_tensors``, what ``from_pretrained`` runs on a CPU) and
the model transformers loads from the dir: qckpt's values equal it bit for bit, and the model
qckpt loads gives its logits exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qckpt.layouts import dequantize as dq
from qckpt.layouts.registry import source_layout
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.read.hf_reader import hf_index
from qckpt.read.readers import open_source
from qckpt.storage.slices import SafetensorsFetch
from tests import quantized_fixtures as fx
from tests._inproc import run_main

EXPERTS = [
    f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptoss")
    bf16 = fx.gpt_oss_bf16(root)
    return {"bf16": bf16, "mxfp4": fx.gpt_oss_mxfp4(bf16, root / "gpt-oss-mxfp4")}


def stored(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def transformers_dequantized(d: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    t = stored(d)
    return {
        n: convert_moe_packed_tensors(t[f"{n}_blocks"], t[f"{n}_scales"], dtype=dtype)
        for n in EXPERTS
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


def transformers_model(d: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # dequantize=True: what transformers does on a CPU anyway, asked for outright
    m = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    return m.eval()


IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_layout_detected_under_the_models_names_and_shapes(dirs):
    layout = source_layout(dirs["mxfp4"], hf_index(dirs["mxfp4"]))
    assert (layout.name, layout.detail) == ("gpt-oss-mxfp4", "mxfp4 experts e8m0 per 32")
    assert sorted(layout.weights) == sorted(EXPERTS)
    # what save_pretrained of the BF16 model holds: the experts [E, in, out], biases beside
    want = {k: v[1] for k, v in hf_index(dirs["bf16"]).items()}
    assert want["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 192)
    assert want["model.layers.0.mlp.experts.down_proj"] == (4, 96, 64)
    have = {k: v[1] for k, v in layout.logical_index(hf_index(dirs["mxfp4"])).items()}
    assert have == want
    assert {e.name: e.shape for e in open_source(dirs["mxfp4"]).entries()} == want


def test_values_equal_transformers_dequantization_bit_for_bit(dirs):
    src = open_source(dirs["mxfp4"])
    ref32 = transformers_dequantized(dirs["mxfp4"], torch.float32)
    ref16 = transformers_dequantized(dirs["mxfp4"], torch.bfloat16)
    bf16 = stored(dirs["bf16"])
    got = {e.name: src.read(e) for e in src.entries() if e.name in ref32}
    assert sorted(got) == sorted(EXPERTS)
    for n, v in got.items():
        assert same_bits(v, ref32[n]), n
        assert same_bits(v.to(torch.bfloat16), ref16[n]), n
        # the values of the BF16 weights, not codes read as numbers nor a transposed read
        err = (v - bf16[n].float()).norm() / bf16[n].float().norm()
        assert err < 0.2, (n, float(err))


def test_a_region_reads_as_that_part_of_the_whole(dirs, monkeypatch):
    """An EP shard's experts and any rectangle of them, chunk by chunk, as the whole gives."""
    d = dirs["mxfp4"]
    index = hf_index(d)
    w = source_layout(d, index).weights["model.layers.1.mlp.experts.gate_up_proj"]
    whole = transformers_dequantized(d, torch.float32)[w.name]
    monkeypatch.setattr(dq, "CHUNK_ELEMS", 64 * 7)  # 7 stored rows a chunk: partial chunks
    fetch = SafetensorsFetch(d, index)
    out = torch.empty(2, 40, 150)
    dq.dequantize_into(out, w, fetch, rows=(3, 43), cols=(21, 171), experts=(1, 3))
    assert same_bits(out, whole[1:3, 3:43, 21:171])
    assert fetch.bytes_read < 2 * 192 * 2 * 17  # two experts' codes and scales, not all four


def test_loaded_model_gives_transformers_logits(dirs):
    model = build_model(str(dirs["mxfp4"]), dtype="bfloat16", seed=3)
    rep = load_checkpoint(model, dirs["mxfp4"])
    assert rep.source_layout.startswith("gpt-oss-mxfp4")
    ref = transformers_model(dirs["mxfp4"])
    want = ref.state_dict()
    for k, v in model.state_dict().items():
        assert same_bits(v, want[k]), k
    assert torch.equal(logits(model), logits(ref))
    # and the quantization is visible: not the BF16 model's logits
    bf16 = build_model(str(dirs["bf16"]), dtype="bfloat16")
    load_checkpoint(bf16, dirs["bf16"])
    assert not torch.equal(logits(model), logits(bf16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_convert_writes_the_dequantized_checkpoint(dirs, tmp_path, dtype):
    out = tmp_path / dtype
    r = run_main("convert", str(dirs["mxfp4"]), str(out), "--to", "hf", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    assert "4 of 37 tensors dequantized from gpt-oss-mxfp4" in r.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == dtype
    got, src = stored(out), stored(dirs["mxfp4"])
    ref = transformers_dequantized(dirs["mxfp4"], getattr(torch, dtype))
    assert sorted(got) == sorted(stored(dirs["bf16"]))
    for k, v in got.items():
        assert same_bits(v, ref[k] if k in ref else src[k].to(v.dtype)), k
    if dtype == "bfloat16":  # transformers reads it back as the model it dequantized itself
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
        assert torch.equal(logits(back), logits(transformers_model(dirs["mxfp4"])))


def test_inspect_names_the_layout(dirs, tmp_path):
    r = run_main("inspect", str(dirs["mxfp4"]), "--json", str(tmp_path / "i.json"))
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "i.json").read_text())
    assert rep["quant_method"] == "mxfp4" and rep["scales"] == 4
    assert rep["ignore"] == fx.GPT_OSS_NOT_CONVERTED
    assert rep["source_layout"]["layout"] == "gpt-oss-mxfp4"
    assert rep["source_layout"]["scales"] == {"mxfp4 e8m0 per 32 (experts, transposed)": 4}


def _broken(src: Path, out: Path, edit) -> Path:
    shutil.copytree(src, out)
    t = stored(out)
    edit(t)
    save_file(t, str(out / "model.safetensors"))
    return out


BROKEN = {
    "no-scales": (
        lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
        "model.layers.1.mlp.experts.down_proj_scales: missing (the E8M0 scales of "
        "model.layers.1.mlp.experts.down_proj_blocks)",
    ),
    "no-blocks": (
        lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
        "model.layers.0.mlp.experts.gate_up_proj_scales: MXFP4 scales without their codes",
    ),
    "scales-shape": (
        lambda t: t.update(
            {
                "model.layers.0.mlp.experts.down_proj_scales": t[
                    "model.layers.0.mlp.experts.down_proj_scales"
                ][:, :, :2].contiguous()
            }
        ),
        "model.layers.0.mlp.experts.down_proj_scales: gpt-oss MXFP4 scales must be uint8 "
        "[4, 64, 3] (one E8M0 exponent per 32 codes of model.layers.0.mlp.experts."
        "down_proj_blocks); got torch.uint8 [4, 64, 2]",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_malformed_source_is_refused_in_one_line(dirs, tmp_path, case):
    edit, says = BROKEN[case]
    bad = _broken(dirs["mxfp4"], tmp_path / case, edit)
    for argv in (
        ("convert", str(bad), str(tmp_path / "out"), "--to", "hf"),
        ("inspect", str(bad), "--json", str(tmp_path / "i.json")),
    ):
        r = run_main(*argv)
        if argv[0] == "inspect":  # inspect reports the refusal as what qckpt would do
            refused = json.loads((tmp_path / "i.json").read_text())["source_layout"]["refused"]
            assert says in refused
            continue
        assert r.returncode == 2, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and str(bad) in lines[0], r.stderr
        assert not (tmp_path / "out").exists()
        assert not any("partial" in p.name for p in tmp_path.iterdir())


def test_blocks_without_a_quantization_config_are_not_read_as_values(dirs, tmp_path):
    bad = shutil.copytree(dirs["mxfp4"], tmp_path / "noqc")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run_main("convert", str(bad), str(tmp_path / "out"), "--to", "hf")
    assert r.returncode != 0 and "4 MXFP4 blocks tensors" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _recipe(tmp_path: Path, d: Path) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(
        f"model: {{source: {d}, dtype: bfloat16}}\n"
        f"checkpoint: {{path: {d}}}\n"
        "quant:\n"
        "  weights: {format: fp8, granularity: tensor}\n"
        "  inputs: {format: fp8, granularity: tensor, dynamic: false}\n"
        '  ignore: ["lm_head", "*.mlp.router"]\n'
        "calibrate:\n"
        "  data: {source: synthetic, num_samples: 4, seq_len: 16, batch_size: 2}\n"
        f"  output: {tmp_path / 'calib.safetensors'}\n"
        f"export: {{output: {tmp_path / 'fp8'}}}\n"
    )
    return p


@pytest.mark.parametrize("command", ["calibrate", "export"])
def test_commands_that_cannot_run_its_experts_refuse_naming_the_model_type(dirs, tmp_path, command):
    r = run_main(command, str(_recipe(tmp_path, dirs["mxfp4"])))
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"model_type gpt_oss: qckpt {command} does not support" in lines[0]
    assert not (tmp_path / "calib.safetensors").exists() and not (tmp_path / "fp8").exists()
    # load reads the same recipe's checkpoint
    r = run_main("load", str(_recipe(tmp_path, dirs["mxfp4"])))
    assert r.returncode == 0, r.stderr
    assert "loaded 37 tensors" in r.stdout
