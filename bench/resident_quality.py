"""What quantized-resident calibration changes in the result, against BF16-resident (CPU).

    python -m bench.resident_quality [--models tiny-moe,tiny-dense] [--json out.json]

For each model (seeded random BF16 weights, written with ``save_pretrained``): calibrate on the
same data with ``calibrate.weights_resident`` bf16, fp8, fp8_block and mxfp8 (per-tensor FP8
weights and static per-tensor FP8 inputs), export each (compressed-tensors), then measure:

* amaxes: weight amaxes bit-identical to bf16-resident (count); input amaxes' relative
  difference (max / median, dense linears vs routed experts);
* the exports: tensors bit-identical to the bf16-resident export (weights and weight scales
  should all be; only ``input_scale`` tensors may differ), and the exported model's next-token
  logits in transformers (compressed-tensors on CPU; the input scales do change its logits),
  against the BF16 model and against the bf16-resident export;
* W8A8 as a serving stack runs it (simulated: every quantized linear's input cast to E4M3 with
  its calibrated static scale, per expert for routed experts, weights cast with their scale):
  logits against the BF16 model (cosine min / mean, top-1 agreement), and the top-1 agreement
  and relative logit difference between the fp8-resident and bf16-resident W8A8 models.

Logits: 8 held-out random sequences of 32 tokens, every position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

RESIDENT = ("bf16", "fp8", "fp8_block", "mxfp8")
DATA = {"source": "synthetic", "num_samples": 32, "seq_len": 32, "batch_size": 4}


def _recipe(hf: Path, work: Path, resident: str):
    from qckpt import recipe_from_dict

    return recipe_from_dict(
        {
            "model": {"source": str(hf)},
            "checkpoint": {"path": str(hf)},
            "calibrate": {
                "data": DATA,
                "weights_resident": resident,
                "output": str(work / f"{resident}.safetensors"),
            },
            "export": {"output": str(work / f"export-{resident}")},
        }
    )


def _fq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 per-tensor fake quantization with a static amax (scale = amax / 448)."""
    s = amax.float().clamp_min(1e-12) / 448.0
    y = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return y.to(x.dtype)


def _w8a8(model, amax: dict[str, torch.Tensor]):
    """A copy of ``model`` computing as a static W8A8 FP8 export would (see the module doc):
    every calibrated linear's weight cast with its scale, its input cast with its static scale
    (a pre-hook), and each routed expert's inputs and weights cast with that expert's own."""
    import copy

    from qckpt.models.naming import expert_slices, ignored, is_fused_experts

    m = copy.deepcopy(model)
    mtype = m.config.model_type
    ignore = ["lm_head", "*.mlp.gate"]
    with torch.no_grad():
        for name, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and not ignored(name, ignore):
                mod.weight.copy_(_fq(mod.weight, amax[f"{name}.weight_amax"]))
                a = amax[f"{name}.input_amax"]
                mod.register_forward_pre_hook(lambda _m, args, a=a: (_fq(args[0], a), *args[1:]))
            elif is_fused_experts(mod):
                gu, dn = mod.gate_up_proj, mod.down_proj
                roles: dict[int, dict[str, str]] = {}
                for s in expert_slices(name, mtype, gu.shape, dn.shape):
                    w = s.take(gu if s.role != "down" else dn)
                    w.copy_(_fq(w, amax[f"{s.hf_module}.weight_amax"]))
                    roles.setdefault(s.expert, {})[s.role] = s.hf_module
                mod.forward = _experts_w8a8(mod, roles, amax)
    return m


def _experts_w8a8(mod, roles, amax):
    """transformers' eager experts loop with each expert's inputs cast to E4M3."""

    def forward(hidden, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            pos, tok = torch.where(top_k_index.t() == e)
            x = _fq(hidden[tok], amax[f"{roles[e]['gate']}.input_amax"])
            gate, up = F.linear(x, mod.gate_up_proj[e]).chunk(2, dim=-1)
            h = _fq(mod.act_fn(gate) * up, amax[f"{roles[e]['down']}.input_amax"])
            h = F.linear(h, mod.down_proj[e]) * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, h.to(final.dtype))
        return final

    return forward


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _vs(a: torch.Tensor, b: torch.Tensor) -> dict:
    cos = F.cosine_similarity(a, b, dim=-1)
    return {
        "cos_min": round(float(cos.min()), 5),
        "cos_mean": round(float(cos.mean()), 5),
        "top1": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
        "rel_diff": round(float((a - b).norm() / b.norm()), 5),
    }


def _amax_diff(got: dict, ref: dict) -> dict:
    weights = [k for k in ref if k.endswith(".weight_amax")]
    rel = {
        k: float(((got[k] - ref[k]).abs() / ref[k].abs()).max())
        for k in ref
        if k.endswith(".input_amax")
    }
    dense = [v for k, v in rel.items() if ".experts." not in k] or [0.0]
    expert = [v for k, v in rel.items() if ".experts." in k] or [0.0]
    return {
        "weight_identical": f"{sum(torch.equal(got[k], ref[k]) for k in weights)}/{len(weights)}",
        "input_dense_max": round(max(dense), 4),
        "input_dense_median": round(statistics.median(dense), 4),
        "input_experts_max": round(max(expert), 4),
        "input_experts_median": round(statistics.median(expert), 4),
    }


def _export_diff(out: Path, ref: Path) -> dict:
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict:
        t = {}
        for f in sorted(d.glob("*.safetensors")):
            t.update(load_file(f))
        return t

    a, b = tensors(out), tensors(ref)
    differ = [k for k in b if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]
    return {
        "tensors": len(b),
        "differ": len(differ),
        "differ_other_than_input_scale": [k for k in differ if not k.endswith("input_scale")],
    }


def run_model(source: str, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from qckpt import build_model, init_mesh
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.pipeline.export import export

    ref = build_model(source, dtype="bfloat16", seed=0).eval()
    hf = work / "hf"
    ref.save_pretrained(hf)
    ids = torch.randint(
        0, ref.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(7)
    )
    base = _logits(ref, ids)
    res: dict = {}
    for r in RESIDENT:
        recipe = _recipe(hf, work, r)
        state = calibrate(recipe, init_mesh(device="cpu")).state
        export(recipe)
        loaded = AutoModelForCausalLM.from_pretrained(work / f"export-{r}", dtype=torch.bfloat16)
        sim = _w8a8(ref, state.amax)
        res[r] = {
            "amax": state.amax,
            "export_logits": _logits(loaded.eval(), ids),
            "w8a8_logits": _logits(sim.eval(), ids),
        }
    out: dict = {}
    b = res["bf16"]
    for r in RESIDENT:
        row = {
            "export_vs_bf16_model": _vs(res[r]["export_logits"], base),
            "w8a8_vs_bf16_model": _vs(res[r]["w8a8_logits"], base),
        }
        if r != "bf16":
            row["amax_vs_bf16_resident"] = _amax_diff(res[r]["amax"], b["amax"])
            row["export_vs_bf16_resident_export"] = _export_diff(
                work / f"export-{r}", work / "export-bf16"
            )
            row["export_logits_vs_bf16_resident"] = _vs(res[r]["export_logits"], b["export_logits"])
            row["w8a8_vs_bf16_resident_w8a8"] = _vs(res[r]["w8a8_logits"], b["w8a8_logits"])
        out[r] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-moe,tiny-dense")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args(argv)
    report = {}
    for source in a.models.split(","):
        with tempfile.TemporaryDirectory(prefix="qckpt-rq-") as d:
            report[source] = run_model(source, Path(d))
        for r, row in report[source].items():
            print(f"{source} {r}:")
            for k, v in row.items():
                print(f"    {k}: {v}")
            sys.stdout.flush()
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
