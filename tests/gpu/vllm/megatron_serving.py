"""vLLM serves an export made straight from a Megatron-Core checkpoint with the HF form's tokens.

    python -m tests.gpu.vllm.megatron_serving --out megatron_vllm.json [--work DIR] [--site DIR]

For the dense (Llama) and MoE (Qwen3-MoE) models of ``task.py`` (trained on strided counting,
so their tokens are checkable): the trained weights are saved as an HF dir and written in
Megatron-Core's ``torch_dist`` layout (tests/training_fixtures.py: stacked layers, TE norm
names, fused QKV per query group, fc1 as [gate; up] in 2·TP fragments, experts on an expert axis,
padded vocab, TP2 / EP2 chunks); both are calibrated once (from the model) and exported
(compressed-tensors, FP8 per tensor) from each source; the two exports must be byte-identical;
vLLM serves both (one process each, ``serve_one.py``) and their greedy tokens are compared with
each other and with the BF16 model's (transformers). Exit status 0 when every export served the
same tokens as its HF twin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.gpu.vllm import matrix, task

HERE = Path(__file__).parent


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _serve(d: Path, pfile: Path, out: Path, site: str) -> dict:
    env = dict(os.environ, **matrix.VLLM_ENV, PYTHONPATH=site)
    cmd = [sys.executable, str(HERE / "serve_one.py"), str(d), str(pfile), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(out.read_text())


def run_one(kind: str, work: Path, steps: int, site: str) -> dict:
    from qckpt.export.writer import export_checkpoint
    from qckpt.recipe import ExportConfig
    from tests.export_fixtures import hf_state
    from tests.training_fixtures import write_megatron

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = task.train(kind, steps=steps, device=dev)
    prompts, right = task.prompts(64)
    ref = task.greedy(model, prompts)
    model = model.cpu()
    hf_dir, mc = work / f"{kind}-hf", work / f"{kind}-megatron"
    model.save_pretrained(hf_dir)
    write_megatron(hf_state(model), model.config, mc, tp=2, ep=2)
    state = matrix.calibrate(model.to(dev), "tensor")
    outs = {}
    for name, src in (("hf", hf_dir), ("megatron", mc)):
        out = work / f"{kind}-{name}-fp8"
        export_checkpoint(
            source=src, calibration=state, output=out, model_type=model.config.model_type,
            model_config=model.config, quant=matrix.quant("tensor"),
            export=ExportConfig(format="compressed-tensors", output=str(out), overwrite=True),
            source_dir=hf_dir,
        )  # fmt: skip
        outs[name] = out
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps({"prompts": prompts, "expect": right}))
    served = {n: _serve(d, pfile, work / f"{kind}-{n}.vllm.json", site) for n, d in outs.items()}
    row = {
        "same_files": _digest(outs["hf"]) == _digest(outs["megatron"]),
        "bf16_task_accuracy": task.agreement(ref, right),
    }
    for n, r in served.items():
        row[n] = {"error": r["error"]} if "error" in r else {
            "load_s": r["load_s"],
            "agreement_with_bf16": task.agreement(r["tokens"], ref),
        }  # fmt: skip
    if all("tokens" in r for r in served.values()):
        row["same_tokens"] = served["hf"]["tokens"] == served["megatron"]["tokens"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/qckpt-megatron-vllm")
    ap.add_argument("--site", default=os.environ.get("QCKPT_VLLM_SITE", "/tmp/site"))
    ap.add_argument("--steps", type=int, default=1500)
    a = ap.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    res = {kind: run_one(kind, work, a.steps, a.site) for kind in ("dense", "moe")}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    ok = all(r.get("same_files") and r.get("same_tokens") for r in res.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
