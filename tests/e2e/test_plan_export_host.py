"""``qckpt plan``'s export host figure against a measured export (issue 30): the whole-process
peak of anonymous host memory (``host_peak_anon_bytes`` in the export's --json) within 10 %,
for a source of many small tensors (the plan's per-tensor part) and for a DCP source."""

from __future__ import annotations

import json

import pytest

from tests._inproc import run_main
from tests.conftest import run_qckpt


def _moe_dir(root, layers: int):
    """A Qwen3-MoE dir of many small tensors (128 experts a layer), saved per expert."""
    from transformers import Qwen3MoeConfig

    from qckpt import build_model

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=128, num_experts_per_tok=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    out = root / f"moe{layers}"
    cfg.save_pretrained(out)
    build_model(str(out), dtype="bfloat16", seed=0).save_pretrained(out)
    return out


@pytest.mark.parametrize("source", ["hf-2-layers", "dcp"])
def test_plans_export_host_figure_is_within_10_percent_of_a_measured_export(tmp_path, source):
    if source == "dcp":
        model, ckpt = "tiny-moe", tmp_path / "dcp"
        r = run_main("convert", str(_recipe(tmp_path, model, ckpt)), str(ckpt), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    else:
        model = ckpt = _moe_dir(tmp_path, 2)
    recipe = _recipe(tmp_path, model, ckpt)
    assert run_main("calibrate", str(recipe), cwd=tmp_path).returncode == 0
    r = run_main("plan", str(recipe), "--nproc-per-node", "1", "--json", "plan.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    predicted = json.loads((tmp_path / "plan.json").read_text())["commands"]["export"][0]
    # measured in a process of its own, as a user runs it
    e = run_qckpt("export", str(recipe), "--json", "export.json", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    measured = json.loads((tmp_path / "export.json").read_text())["peaks"]["host_peak_anon_bytes"]
    print("HOST", source, predicted["host_bytes"] / 2**20, measured / 2**20)
    assert abs(predicted["host_bytes"] - measured) <= 0.10 * measured, (predicted, measured)


def _recipe(d, model, ckpt):
    p = d / "r.yaml"
    p.write_text(
        f"model: {{source: {model}}}\ncheckpoint: {{path: {ckpt}}}\nload: {{device: cpu}}\n"
        f"calibrate: {{output: {d}/c.safetensors, data: {{num_samples: 4, seq_len: 32}}}}\n"
        f"export: {{output: {d}/out, device: cpu}}\n"
    )
    return p
