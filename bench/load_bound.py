"""Issue 17's memory bound for a whole ``qckpt load``: peak <= the quantized model + one scratch
(2 * max(numel) for BF16) + 64 MiB, counters never reset from the process start.

    python -m bench.load_bound CKPT_DIR [--params fp8] [--device cuda] [--json out.json]

The quantized model's bytes are computed here without loading anything: the model is built on
meta with its quantized parameters shape-only (the same build ``qckpt load`` does), and every
tensor of its state dict is counted as it will be held (a quantized parameter's codes, scales
and state; a plain tensor in its dtype; a tied one once). Then ``qckpt load`` runs as a whole
process with ``load.max_inflight=1`` (one scratch at a time, the bound's assumption), and its
``--json`` gives the whole command's peaks (``torch.cuda.max_memory_allocated``, never reset;
on CPU the host's VmHWM and anonymous RSS). Prints one JSON object; exit 1 if the device peak
is over the bound.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
IGNORE = ["lm_head", "*.mlp.gate"]  # the recipe's default quant.ignore


def model_bytes(source: str, params: str) -> dict[str, int]:
    """Bytes the loaded model holds and its largest quantized parameter's numel."""
    from qckpt import formats
    from qckpt.models.build import build_model
    from qckpt.models.quantize_params import quantize_model_params

    model = build_model(source, device="meta")
    names = quantize_model_params(model, params, ignore=IGNORE)
    held, max_numel, seen = 0, 0, set()
    for t in model.state_dict(keep_vars=True).values():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if formats.is_quantized(t):
            held += t.quantized_nbytes()
            max_numel = max(max_numel, t.numel())
        else:
            held += t.numel() * t.element_size()
    return {"model_bytes": held, "max_numel": max_numel, "quantized_params": len(names)}


def run_load(ckpt: Path, params: str, device: str, work: Path) -> dict:
    recipe = work / "load.yaml"
    recipe.write_text(
        f"model: {{source: {json.dumps(str(ckpt))}, dtype: bfloat16}}\n"
        f"checkpoint: {{path: {json.dumps(str(ckpt))}, format: auto}}\n"
        f"load: {{params: {params}, device: {device}, max_inflight: 1}}\n"
        f"quant: {{ignore: {json.dumps(IGNORE)}}}\n"
    )
    out = work / "load.json"
    cmd = [sys.executable, "-m", "qckpt", "load", str(recipe), "--json", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not out.is_file():
        tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise SystemExit(f"qckpt load failed (exit {r.returncode}): {tail}")
    return {"wall_seconds": round(wall, 3), **json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--params", default="fp8")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    ckpt = args.ckpt.resolve()
    sizes = model_bytes(str(ckpt), args.params)
    with tempfile.TemporaryDirectory(prefix="qckpt-bound-") as work:
        load = run_load(ckpt, args.params, args.device, Path(work))
    peaks = load.get("peaks", {})
    bound = sizes["model_bytes"] + 2 * sizes["max_numel"] + 64 * MiB
    dev_peak = peaks.get("device_peak_bytes")
    res = {
        "checkpoint": str(ckpt),
        "params": args.params,
        **sizes,
        "bound_bytes": bound,
        "device_peak_bytes": dev_peak,
        "device_peak_over_bound": None if not dev_peak else round(dev_peak / bound, 4),
        "within_bound": None if not dev_peak else dev_peak <= bound,
        "host_peak_rss_bytes": peaks.get("host_peak_rss_bytes"),
        "host_peak_anon_bytes": peaks.get("host_peak_anon_bytes"),
        "phases": load.get("phases"),
        "wall_seconds": load["wall_seconds"],
        "load_window": {
            k: load["runs"][0].get(k)
            for k in ("peak_bytes", "transient_bytes", "predicted_transient_bytes", "gbps")
        },
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if res["within_bound"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
