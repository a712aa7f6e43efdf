"""``qckpt plan``'s export host figure against a measured ``qckpt export`` (issue 30).

    python -m bench.plan_export_host --model configs/models/qwen3-30b-a3b --src CKPT_DIR \
        --calib CALIB.safetensors --out /dev/shm/plan_export_host [--gpu-memory 139GiB]

Writes a recipe for the model, checkpoint and calibration file given, runs ``qckpt plan`` (one
rank, the GPU memory given: the plan is for a GPU export) and then ``qckpt export`` into
``--out``, each as its own process, and prints the plan's ``host_bytes`` for export beside the
export's ``peaks.host_peak_anon_bytes`` and their ratio (target: within 10 %).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def _qckpt(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "qckpt", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"qckpt {args[0]} failed: {r.stderr.strip()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="model.source (a dir with config.json)")
    ap.add_argument("--src", required=True, help="checkpoint.path (HF safetensors or DCP dir)")
    ap.add_argument("--calib", required=True, help="calibrate.output of a calibrate run")
    ap.add_argument("--out", required=True, help="a scratch dir (removed first)")
    ap.add_argument("--gpu-memory", default="139GiB")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    work = Path(a.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(
        f"model: {{source: {a.model}}}\ncheckpoint: {{path: {a.src}}}\n"
        f"calibrate: {{output: {a.calib}}}\nexport: {{output: {work / 'fp8'}}}\n"
    )
    _qckpt("plan", str(recipe), "--nproc-per-node", "1", "--gpu-memory", a.gpu_memory,
           "--json", str(work / "plan.json"))  # fmt: skip
    _qckpt("export", str(recipe), "--json", str(work / "export.json"))
    predicted = json.loads((work / "plan.json").read_text())["commands"]["export"][0]["host_bytes"]
    measured = json.loads((work / "export.json").read_text())["peaks"]["host_peak_anon_bytes"]
    ratio = predicted / measured
    print(
        f"export host memory: plan {predicted / 2**30:.3f} GiB, measured (anonymous peak) "
        f"{measured / 2**30:.3f} GiB, plan/measured {ratio:.3f} "
        f"({'within' if abs(ratio - 1) <= 0.10 else 'OUTSIDE'} 10 %)"
    )
    if a.json:
        export_seconds = json.loads((work / "export.json").read_text()).get("seconds")
        Path(a.json).write_text(json.dumps({
            "plan_host_bytes": predicted, "measured_host_peak_anon_bytes": measured,
            "plan_over_measured": round(ratio, 4), "export_seconds": export_seconds,
        }, indent=1))  # fmt: skip
    shutil.rmtree(work / "fp8", ignore_errors=True)
    return 0 if abs(ratio - 1) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
