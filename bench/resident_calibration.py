"""BF16-resident vs quantized-resident calibration: whole-command peaks, time, amax agreement.

    python -m bench.resident_calibration RECIPE [--set key=value ...] [--formats bf16,fp8]
        [--json out.json] [--max-ratio 0.6]

Each format runs as its own ``python -m qckpt calibrate RECIPE --set
calibrate.weights_resident=FMT --json ...`` process, one after the other, so every peak is that
command's own: the device peak is the command's ``peaks.device_peak_bytes`` (the CLI's
``torch.cuda.max_memory_allocated``, never reset during the command; :mod:`qckpt.phases`), the
host peaks VmHWM and the sampled anonymous RSS. Printed per format: seconds (wall, the whole
process), the phases' seconds, the peaks; then each quantized format's peak as a ratio of the
first format's (bf16), and how its calibration file compares with the bf16 one: weight amaxes
bit-identical (they must all be), input amaxes' relative difference (max, median, dense vs
routed experts). ``--max-ratio`` makes the exit status 1 when a device ratio exceeds it (or a
weight amax differs).

CPU smoke run (seconds): ``python -m qckpt convert configs/tiny-moe.yaml /tmp/r/dcp`` then
``python -m bench.resident_calibration configs/tiny-moe.yaml --set checkpoint.path=/tmp/r/dcp``
(no device peak on CPU: the host figures are printed instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def _run(recipe: str, sets: list[str], fmt: str, tmp: Path) -> dict:
    out, js = tmp / f"calib-{fmt}.safetensors", tmp / f"report-{fmt}.json"
    cmd = [sys.executable, "-m", "qckpt", "calibrate", recipe]
    for s in [*sets, f"calibrate.weights_resident={fmt}", f"calibrate.output={out}"]:
        cmd += ["--set", s]
    cmd += ["--json", str(js)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{fmt}: qckpt calibrate exited {proc.returncode}")
    rep = json.loads(js.read_text())
    return {
        "format": fmt,
        "seconds": round(wall, 2),
        "phases": rep.get("phases", {}),
        "peaks": rep.get("peaks", {}),
        "param_bytes": rep.get("param_bytes"),
        "calibration": str(out),
    }


def _compare(path: str, ref_path: str) -> dict:
    from qckpt import load_calibration

    got, ref = load_calibration(path).amax, load_calibration(ref_path).amax
    weights = [k for k in ref if k.endswith(".weight_amax")]
    inputs = [k for k in ref if k.endswith(".input_amax")]
    same = sum(1 for k in weights if k in got and bool((got[k] == ref[k]).all()))
    rel = {}
    for k in inputs:
        if k in got:
            r, g = ref[k].float(), got[k].float()
            rel[k] = float(((g - r).abs() / r.abs().clamp_min(1e-30)).max())
    dense = [v for k, v in rel.items() if ".experts." not in k]
    expert = [v for k, v in rel.items() if ".experts." in k]
    return {
        "weight_amax_identical": same,
        "weight_amax_total": len(weights),
        "same_keys": sorted(got) == sorted(ref),
        "input_rel_max_dense": max(dense, default=0.0),
        "input_rel_median_dense": statistics.median(dense) if dense else 0.0,
        "input_rel_max_experts": max(expert, default=0.0),
        "input_rel_median_experts": statistics.median(expert) if expert else 0.0,
    }


def _peak(run: dict) -> tuple[str, float | None]:
    p = run["peaks"]
    if p.get("device_peak_bytes") is not None:
        return "device", p["device_peak_bytes"]
    return "host anon", p.get("host_peak_anon_bytes") or p.get("host_peak_rss_bytes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--formats", default="bf16,fp8", help="first one is the reference")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--max-ratio", type=float, default=None)
    a = ap.parse_args(argv)
    fmts = a.formats.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="qckpt-resident-") as d:
        for fmt in fmts:
            runs.append(_run(a.recipe, a.sets, fmt, Path(d)))
            r = runs[-1]
            kind, peak = _peak(r)
            pb = r["param_bytes"]
            print(
                f"{fmt:>10}: {r['seconds']:8.1f} s  {kind} peak {peak / GIB:8.2f} GiB  "
                f"params {pb / GIB if pb else 0:8.2f} GiB  phases {r['phases']}",
                flush=True,
            )
        ok = True
        for r in runs[1:]:
            kind, peak = _peak(r)
            ref_kind, ref_peak = _peak(runs[0])
            r["peak_ratio"] = peak / ref_peak if peak and ref_peak else None
            r["vs_reference"] = _compare(r["calibration"], runs[0]["calibration"])
            c = r["vs_reference"]
            print(
                f"{r['format']} / {runs[0]['format']}: {kind} peak ratio {r['peak_ratio']:.3f}; "
                f"weight amax bit-identical {c['weight_amax_identical']}/{c['weight_amax_total']}; "
                f"input amax rel diff dense max {c['input_rel_max_dense']:.4f} (median "
                f"{c['input_rel_median_dense']:.4f}), experts max {c['input_rel_max_experts']:.4f} "
                f"(median {c['input_rel_median_experts']:.4f})"
            )
            ok &= c["weight_amax_identical"] == c["weight_amax_total"] and c["same_keys"]
            if a.max_ratio is not None and r["peak_ratio"] is not None:
                ok &= r["peak_ratio"] <= a.max_ratio
    for r in runs:
        r.pop("calibration")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"runs": runs, "ok": ok}, indent=2))
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
