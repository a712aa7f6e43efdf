"""``calibrate.offload: layer`` against a resident calibration: memory, time, and the same bits.

    # one run of the real CLI in this process, the GPU capped first (issue 17's acceptance)
    python bench/calibrate_offload.py run --gpu-mem-gib 20 --json off.json -- \\
        RECIPE --set calibrate.offload=layer --set calibrate.output=off.safetensors

    # two calibration files, amax by amax, bit for bit (exit 0 iff identical)
    python bench/calibrate_offload.py compare a.safetensors b.safetensors

    # CPU: a generated mid-size Qwen3-MoE, resident vs offload layer vs host, each in a fresh
    # process: whole-process peak RSS (VmHWM), wall time, and whether the files are the same
    python bench/calibrate_offload.py cpu --dir /tmp/offload-bench --layers 8 --hidden 1024

``run`` sets ``torch.cuda.set_per_process_memory_fraction`` for this process's GPU (so the
caching allocator refuses to go past the cap: an allocation beyond it is an OOM, as on a smaller
GPU), then runs ``qckpt calibrate`` in-process with the arguments after ``--`` and prints one
JSON line: exit code, wall seconds, the device peak (``torch.cuda.max_memory_allocated``, never
reset) and the host peak (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def _host_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    out: dict = {"argv": args.qckpt}
    dev = int(os.environ.get("LOCAL_RANK", "0"))
    if args.gpu_mem_gib is not None:
        if not torch.cuda.is_available():
            print("--gpu-mem-gib: no CUDA device", file=sys.stderr)
            return 2
        total = torch.cuda.get_device_properties(dev).total_memory
        frac = min(1.0, args.gpu_mem_gib * GiB / total)
        torch.cuda.set_per_process_memory_fraction(frac, dev)
        out.update(gpu_cap_bytes=int(frac * total), gpu_total_bytes=int(total))
    from qckpt.cli.app import main

    t0 = time.perf_counter()
    try:
        main(["calibrate", *args.qckpt])
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out.update(rc=rc, seconds=round(time.perf_counter() - t0, 2), host_peak_bytes=_host_peak())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    line = json.dumps(out)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return rc


def compare(args: argparse.Namespace) -> int:
    import torch

    from qckpt import load_calibration
    from qckpt.calib.state_file import calibration_differences

    diffs = calibration_differences(args.a, args.b)
    a, b = load_calibration(args.a).amax, load_calibration(args.b).amax
    rel = 0.0
    for k in set(a) & set(b):
        x, y = a[k].double(), b[k].double()
        if x.shape == y.shape and x.numel():
            d = ((x - y).abs() / y.abs().clamp_min(1e-30)).max()
            rel = max(rel, float(torch.nan_to_num(d, nan=float("inf"))))
    verdict = "bit-identical" if not diffs else f"{len(diffs)} differences"
    print(json.dumps({"same": not diffs, "amax": len(a), "differences": len(diffs),
                      "max_rel_diff": rel, "first": diffs[:5]}))  # fmt: skip
    print(f"{args.a} vs {args.b}: {verdict}", file=sys.stderr)
    return 0 if not diffs else 1


def _make_model(d: Path, layers: int, hidden: int, experts: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if (d / "config.json").is_file():
        return
    cfg = Qwen3MoeConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
        head_dim=128, num_experts=experts, num_experts_per_tok=4, decoder_sparse_step=1,
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(d)


def cpu(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    _make_model(d / "model", args.layers, args.hidden, args.experts)
    size = sum(f.stat().st_size for f in (d / "model").glob("*.safetensors"))
    rows = {}
    for mode in args.modes.split(","):
        out = d / f"{mode}.safetensors"
        sets = [f"model.source={d / 'model'}", f"checkpoint.path={d / 'model'}",
                f"calibrate.output={out}", f"calibrate.offload={mode}", "load.device=cpu",
                "calibrate.data.num_samples=16", "calibrate.data.seq_len=128",
                "calibrate.data.batch_size=4"]  # fmt: skip
        report = d / f"{mode}.json"
        cmd = [sys.executable, __file__, "run", "--", str(REPO / "configs/tiny-moe.yaml"),
               "--json", str(report)]  # fmt: skip
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode or not line:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        rows[mode] = json.loads(line[-1])
        # the command's own peaks: RssAnon leaves out the checkpoint's mapped file pages
        peaks = json.loads(report.read_text()).get("peaks", {})
        rows[mode]["anon_peak_bytes"] = peaks.get("host_peak_anon_bytes", 0)
        rows[mode]["offload"] = json.loads(report.read_text()).get("offload")
    from qckpt.calib.state_file import calibration_differences

    ref = d / f"{args.modes.split(',')[0]}.safetensors"
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.experts} experts: "
          f"{size / 2**20:.0f} MiB of BF16 safetensors")  # fmt: skip
    for mode, row in rows.items():
        same = not calibration_differences(ref, d / f"{mode}.safetensors")
        print(f"{mode:9s} host peak {row['host_peak_bytes'] / 2**20:6.0f} MiB (anonymous "
              f"{row['anon_peak_bytes'] / 2**20:6.0f} MiB)  {row['seconds']:7.1f} s   "
              f"same file as {ref.stem}: {same}")  # fmt: skip
        if row["offload"]:
            print("          " + json.dumps(row["offload"]))
    return 0


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="qckpt calibrate in this process, the GPU capped first")
    r.add_argument("--gpu-mem-gib", type=float, default=None)
    r.add_argument("--json", default=None, help="also write the result line here")
    r.add_argument("qckpt", nargs=argparse.REMAINDER, help="-- RECIPE [--set k=v ...] ...")
    c = sub.add_parser("compare", help="two calibration files, bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    m = sub.add_parser("cpu", help="resident vs offload on a generated model, on the CPU")
    m.add_argument("--dir", required=True)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--experts", type=int, default=16)
    m.add_argument("--modes", default="none,layer,host")
    a = p.parse_args(argv)
    if a.cmd == "run" and a.qckpt[:1] == ["--"]:
        a.qckpt = a.qckpt[1:]
    return a


if __name__ == "__main__":
    ns = _args(None)
    sys.exit({"run": run, "compare": compare, "cpu": cpu}[ns.cmd](ns))
