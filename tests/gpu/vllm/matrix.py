"""The vLLM serving matrix: train two checkable models, export every layout, serve each in vLLM.

    python -m tests.gpu.vllm.matrix --out results.json [--work DIR] [--no-vllm] [--steps N]

1. a Llama and a Qwen3-MoE are trained on strided counting (``task.py``) and saved in BF16; their
   greedy continuations of held-out prompts, computed with transformers, are the reference;
2. qckpt calibrates each (``calibrate_model`` on task sequences) and exports it in both layouts
   (compressed-tensors, ModelOpt) and three schemes: static per-tensor (``tensor``), per-channel
   weights with dynamic per-token inputs (``channel``), static per-tensor with FP8 KV-cache scales
   (``kv``); the MoE also with ``export.moe_scales: per_expert`` (the default is ``shared``);
3. vLLM serves the BF16 dir and every export, one process per engine (``serve_one.py``, several
   at once on the one GPU), greedy; the tokens are compared with the reference.

The results JSON has one row per served dir: accepted or the error, load time, token agreement
with the BF16 model, accuracy on the task, and whether vLLM's module quant methods match the
export's ignore list (lm_head and routers unquantized, everything else quantized).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.gpu.vllm import task

HERE = Path(__file__).parent
SCHEMES = {  # name -> (weights granularity, inputs dynamic, kv cache)
    "tensor": ("tensor", False, False),
    "channel": ("channel", True, False),
    "kv": ("tensor", False, True),
}
VLLM_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer is not carried (vLLM imports it otherwise)
}


def quant(scheme: str):
    from qckpt.recipe import QuantConfig, TensorQuantConfig

    gran, dynamic, kv = SCHEMES[scheme]
    return QuantConfig(
        weights=TensorQuantConfig(format="fp8", granularity=gran),
        inputs=TensorQuantConfig(format="fp8", granularity="tensor", dynamic=dynamic),
        ignore=["lm_head", "*.mlp.gate"],
        kv_cache=kv,
    )


def calibrate(model, scheme: str):
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.parallel.mesh import init_mesh

    dev = next(model.parameters()).device
    batches = [task.sequences(32, task.PROMPT + task.GEN, 777 + i).to(dev) for i in range(8)]
    state, _ = calibrate_model(model, batches, quant(scheme), init_mesh(ep=1, tp=1, timeout_s=60))
    return state


def _export(model, hf_dir: Path, state, out: Path, layout: str, scheme: str, moe: str) -> dict:
    from qckpt.export.writer import export_checkpoint
    from qckpt.recipe import ExportConfig

    t0 = time.perf_counter()
    export_checkpoint(
        source=hf_dir,
        calibration=state,
        output=out,
        model_type=model.config.model_type,
        model_config=model.config,
        quant=quant(scheme),
        export=ExportConfig(format=layout, output=str(out), overwrite=True, moe_scales=moe),
        source_dir=hf_dir,
    )
    from qckpt.layouts.check import check_export

    return {"export_s": time.perf_counter() - t0, "check": check_export(out).summary()}


def prepare(work: Path, steps: int, hidden: int, seconds: float, log) -> tuple[list[dict], dict]:
    """Train, save, export; returns the rows to serve and the models' own results."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict] = []
    models: dict = {}
    prompts, right = task.prompts(64)
    for kind in ("dense", "moe"):
        t0 = time.perf_counter()
        model = task.train(
            kind, steps=steps, device=dev, hidden=hidden, max_seconds=seconds, log=log
        )
        ref = task.greedy(model, prompts)
        hf_dir = work / f"{kind}-bf16"
        model.save_pretrained(hf_dir)
        models[kind] = {
            "train_s": time.perf_counter() - t0,
            "hf_bf16_task_accuracy": task.agreement(ref, right),
            "reference": ref,
        }
        log(f"{kind}: BF16 task accuracy {models[kind]['hf_bf16_task_accuracy']:.3f}")
        rows.append(
            dict(name=f"{kind}-bf16", model=kind, layout="bf16", scheme="-", dir=hf_dir, kv=False)
        )
        for scheme in SCHEMES:
            state = calibrate(model, scheme)
            variants = [("shared", layout) for layout in ("compressed-tensors", "modelopt")]
            if kind == "moe" and scheme == "tensor":
                variants += [
                    ("per_expert", layout) for layout in ("compressed-tensors", "modelopt")
                ]
            for moe, layout in variants:
                name = f"{kind}-{layout}-{scheme}" + ("-per_expert" if moe == "per_expert" else "")
                out = work / name
                row = dict(name=name, model=kind, layout=layout, scheme=scheme, dir=out)
                row["kv"] = SCHEMES[scheme][2]
                row["moe_scales"] = moe if kind == "moe" else None
                try:
                    row.update(_export(model, hf_dir, state, out, layout, scheme, moe))
                except Exception as exc:  # recorded: an export qckpt refuses is a result too
                    row["export_error"] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: {row.get('check') or row.get('export_error')}")
                rows.append(row)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows, models


def _ignored(d: Path) -> list[str]:
    qc = json.loads((d / "config.json").read_text()).get("quantization_config") or {}
    return list(qc.get("ignore") or [])


def _names_check(methods: dict[str, str], ignored: list[str], layout: str) -> list[str]:
    """Problems: an ignored module vLLM quantizes, or a linear it leaves unquantized."""
    if layout == "bf16":
        return []
    bad = []
    for name, method in methods.items():
        unq = method.startswith("Unquantized")
        if name in ignored and not unq and "Embedding" not in method:
            bad.append(f"{name}: ignored but vLLM uses {method}")
        elif name not in ignored and unq and method == "UnquantizedLinearMethod":
            bad.append(f"{name}: quantized in the export but vLLM uses {method}")
    return bad


def serve_all(rows: list[dict], work: Path, a, refs: dict, save, log) -> None:
    """Serve every exported row, ``a.parallel`` engines at a time, until ``a.deadline``."""
    todo = [r for r in rows if "export_error" not in r]
    prompts, right = task.prompts(64)
    pfile = work / "prompts.json"
    pfile.write_text(json.dumps({"prompts": prompts, "expect": right}))
    env = dict(os.environ, **VLLM_ENV, PYTHONPATH=a.site)
    running: list[tuple[dict, subprocess.Popen, float]] = []
    while todo or running:
        late = time.perf_counter() - a.t0 > a.deadline
        while todo and len(running) < a.parallel and not late:
            r = todo.pop(0)
            logf = open(work / f"{r['name']}.vllm.log", "w")
            cmd = [sys.executable, str(HERE / "serve_one.py"), str(r["dir"]), str(pfile)]
            cmd += [str(work / f"{r['name']}.vllm.json")] + (["--kv-fp8"] if r["kv"] else [])
            p = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
            running.append((r, p, time.perf_counter()))
        if late:
            for r in todo:
                r["error"] = ["not served: the run's deadline came first"]
            todo = []
        time.sleep(0.5)
        for item in list(running):
            r, p, t0 = item
            over = time.perf_counter() - t0 > a.timeout or late
            if p.poll() is None and not over:
                continue
            if p.poll() is None:
                p.kill()
                p.wait()
            running.remove(item)
            _collect(r, work, p.returncode, time.perf_counter() - t0, refs, right)
            log(f"{r['name']}: {'served' if r['accepted'] else 'REFUSED'} {r.get('agreement')}")
            save()


def _collect(r: dict, work: Path, rc: int, wall: float, refs: dict, right: list) -> None:
    out = work / f"{r['name']}.vllm.json"
    text = (work / f"{r['name']}.vllm.log").read_text(errors="replace")
    r["wall_s"] = wall
    r["accepted"] = rc == 0 and out.is_file()
    notes = [ln.strip()[-200:] for ln in text.splitlines() if "not equal" in ln]
    r["vllm_notes"] = notes[:2]
    if not r["accepted"]:
        errs = [ln[-300:] for ln in text.splitlines() if "Error" in ln or "error" in ln]
        r["error"] = errs[-4:] if errs else [ln[-300:] for ln in text.splitlines()[-6:]]
        return
    res = json.loads(out.read_text())
    r.update({k: res[k] for k in ("vllm", "load_s", "import_s", "gen_s")})
    r["agreement"] = task.agreement(res["tokens"], refs[r["model"]])
    r["task_accuracy"] = task.agreement(res["tokens"], right)
    r["first_tokens"] = res["tokens"][0]
    if "methods" in res:
        r["methods"] = sorted(set(res["methods"].values()))
        r["name_problems"] = _names_check(res["methods"], _ignored(Path(r["dir"])), r["layout"])
    else:
        r["methods_error"] = res.get("methods_error")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/vllm-matrix")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--site", default="/tmp/site")
    ap.add_argument("--parallel", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds: serve nothing after")
    ap.add_argument("--no-vllm", action="store_true")
    a = ap.parse_args(argv)
    a.t0 = time.perf_counter()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - a.t0:6.1f}s] {msg}", flush=True)

    rows, models = prepare(work, a.steps, a.hidden, a.seconds, log)
    refs = {k: m.pop("reference") for k, m in models.items()}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"

    def save() -> None:
        res = {"torch": torch.__version__, "gpu": gpu, "models": models, "rows": rows}
        res["seconds"] = time.perf_counter() - a.t0
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))

    save()
    if not a.no_vllm:
        serve_all(rows, work, a, refs, save, log)
    save()
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
