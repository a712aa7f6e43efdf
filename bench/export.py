"""``qckpt export`` as a user runs it, one process beside torchrun with N, on one checkpoint.

    python -m bench.export                                  # ~0.5 GB synthetic Llama, 1 vs 2
    python -m bench.export --src /data/qwen3-30b --nprocs 1,2 --json export.json
    python -m bench.export --src /data/qwen3-30b --nprocs 1 --lanes 1,2,4   # files at once

Each run is the real CLI in a fresh process (``python -m qckpt export RECIPE``, with
``--nproc-per-node N`` for N > 1: torchrun under it), timed from its start to its exit, and
its ``--json`` report read back: the export's own GB/s (source bytes / the main rank's export
seconds: from the start of planning, the calibration file's read, to the finished dir renamed
into place; the same span for every process count), the main rank's seconds per step, the
whole command's wall time and phases, and its memory, never reset: the whole process's peak
RSS (VmHWM, max over ranks), the peak of its anonymous memory (RssAnon, no file pages) and
how far that rose during the write, next to the documented bound ``2 x largest tensor +
256 MiB``. Every run's files are hashed (threads) and compared with the
first run's: "same files" means every file byte-identical. Outputs are deleted after hashing
(``--keep`` keeps the last), so a 61 GB checkpoint needs room for one export at a time.

``--src`` is an HF safetensors dir (config.json + shards). ``--calib`` is its calibration file;
when it does not exist yet it is made from the checkpoint's own weights (per-tensor weight amax,
every input amax 4.0: a throughput benchmark needs valid scales, not calibrated activations),
on the GPU when there is one, and kept for the next run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


def _llama_config(hidden: int, inter: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=128 if hidden >= 128 else hidden,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    return {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def make_checkpoint(work: Path, size_gb: float, hidden: int, inter: int, vocab: int) -> dict:
    """An HF safetensors dir of about ``size_gb`` GB plus a per-tensor calibration file."""
    import torch
    from safetensors.torch import save_file

    from qckpt.calib.state_file import CalibrationState, model_fingerprint, save_calibration

    probe = _llama_config(hidden, inter, 1, vocab)
    per_layer = sum(a * b for a, b in _layer_shapes(probe).values()) * 2
    fixed = 2 * vocab * hidden * 2
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    cfg = _llama_config(hidden, inter, layers, vocab)
    src = work / "src"
    src.mkdir(parents=True)
    cfg.save_pretrained(src)
    gen = torch.Generator().manual_seed(0)

    def rand(shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    names_shapes: list[tuple[str, tuple[int, ...]]] = []
    amax: dict[str, torch.Tensor] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shard, str(src / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes = {}, 0

    def add(name, t):
        nonlocal shard_bytes
        shard[name] = t
        shard_bytes += t.numel() * 2
        names_shapes.append((name, tuple(t.shape)))
        if shard_bytes >= 1e9:
            flush()

    add("model.embed_tokens.weight", rand((vocab, hidden)))
    for li in range(layers):
        for mod, shape in _layer_shapes(cfg).items():
            name = f"model.layers.{li}.{mod}"
            w = rand(shape)
            amax[f"{name}.weight_amax"] = w.float().abs().amax()
            amax[f"{name}.input_amax"] = torch.tensor(4.0)
            add(f"{name}.weight", w)
        add(f"model.layers.{li}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))
        add(
            f"model.layers.{li}.post_attention_layernorm.weight",
            torch.ones(hidden, dtype=torch.bfloat16),
        )
    add("model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    add("lm_head.weight", rand((vocab, hidden)))
    flush()
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    cal = work / "calib.safetensors"
    from qckpt.recipe import QuantConfig

    save_calibration(
        CalibrationState(
            amax=amax,
            model_type="llama",
            model_fingerprint=model_fingerprint(names_shapes),
            quant={"weights": {"format": "fp8", "granularity": "tensor"}},
        ),
        cal,
    )
    del QuantConfig
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = max(vocab * hidden, max(a * b for a, b in _layer_shapes(cfg).values())) * 2
    return {
        "src": str(src),
        "calib": str(cal),
        "layers": layers,
        "source_bytes": total,
        "largest_tensor_bytes": largest,
    }


def make_calibration_for(src: Path, out: Path) -> Path:
    """A calibration file for an existing HF dir: weight amax from its weights (see the doc)."""
    import torch

    from qckpt.calib.state_file import CalibrationState, model_fingerprint, save_calibration
    from qckpt.export.plan import model_modules
    from qckpt.models.build import load_config
    from qckpt.models.naming import ignored
    from qckpt.read.hf_names import hf_entries, iter_hf_tensors
    from qckpt.read.sources import SafetensorsSource
    from qckpt.recipe import QuantConfig

    cfg = load_config(str(src))
    mt = cfg.model_type
    q = QuantConfig()
    source = SafetensorsSource(src)
    entries = hf_entries(source.entries(), mt)
    linears, routers, _ = model_modules(cfg)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    amax: dict[str, torch.Tensor] = {}
    for he, t in iter_hf_tensors(source, entries, mt):
        module, _, leaf = he.name.rpartition(".")
        use = module in linears and module not in routers and not ignored(module, q.ignore)
        if leaf == "weight" and t.dim() == 2 and use:
            amax[f"{module}.weight_amax"] = t.to(dev).abs().amax().float().cpu()
            amax[f"{module}.input_amax"] = torch.tensor(4.0)
    from dataclasses import asdict

    state = CalibrationState(
        amax=amax,
        model_type=mt,
        model_fingerprint=model_fingerprint((e.name, e.shape) for e in entries),
        quant=asdict(q),
    )
    return save_calibration(state, out)


def file_digests(d: Path) -> dict[str, str]:
    """sha256 of every file of an export dir, several files at once."""

    def one(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(64 * MiB):
                h.update(chunk)
        return h.hexdigest()

    files = sorted(p for p in d.iterdir() if p.is_file())
    with cf.ThreadPoolExecutor(8) as pool:
        return dict(zip((p.name for p in files), pool.map(one, files), strict=True))


def _recipe(work: Path, src: Path, cal: Path, out: Path, args) -> Path:
    r = work / "export.yaml"
    r.write_text(
        f"model: {{source: {json.dumps(str(src))}}}\n"
        f"checkpoint: {{path: {json.dumps(str(src))}, format: safetensors}}\n"
        f"calibrate: {{output: {json.dumps(str(cal))}}}\n"
        f"export: {{output: {json.dumps(str(out))}, format: {args.format}, "
        f"device: {args.device}, max_shard_size: {args.max_shard_size}, writers: {args.writers}}}\n"
    )
    return r


def run_once(work: Path, src: Path, cal: Path, nproc: int, args, lanes: int | None = None) -> dict:
    """One whole CLI export; its report, wall time and file digests. ``lanes``: shard files
    one process writes at once (``QCKPT_EXPORT_LANES``; None: the export's default)."""
    tag = f"{nproc}" if lanes is None else f"{nproc}-lanes{lanes}"
    out = work / f"out-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    recipe = _recipe(work, src, cal, out, args)
    report = work / f"report-{tag}.json"
    cmd = [sys.executable, "-m", "qckpt", "export", str(recipe), "--json", str(report)]
    if args.profile and nproc == 1:  # where one process's threads spend the time
        prof = Path(args.profile).resolve()
        cmd[1:1] = ["-m", "bench.profile", "--out", str(prof), "--"]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    t0 = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    if lanes is not None:
        env["QCKPT_EXPORT_LANES"] = str(lanes)
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"export {tag} (processes, lanes) failed:\n{proc.stderr[-3000:]}")
    rep = json.loads(report.read_text())
    digests = file_digests(out)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return {"wall_seconds": wall, "report": rep, "digests": digests}


def summarize(key: int | str, runs: list[dict], source_bytes: int) -> dict:
    best = min(runs, key=lambda r: r["report"]["seconds"])
    rep = best["report"]
    peaks = rep.get("peaks", {})
    return {
        "nproc": rep["world_size"],
        "key": key,
        "lanes": rep.get("lanes", 1),  # shard files one process wrote at once
        "device": rep["device"],
        "export_seconds": round(rep["seconds"], 3),  # the main rank's plan + write
        "gbps": round(rep["gbps"], 3),
        "wall_seconds": round(best["wall_seconds"], 3),  # the whole process, start-up included
        "wall_gbps": round(source_bytes / best["wall_seconds"] / 1e9, 3),
        "phases": rep.get("phases", {}),
        # the main rank's seconds per step (ExportReport.steps): what does not shrink with ranks
        "steps": rep.get("steps", {}),
        "host_peak_rss_bytes": rep["peak_rss_bytes"],  # VmHWM, max over ranks, never reset
        "host_peak_anon_bytes": peaks.get("host_peak_anon_bytes", rep["peak_rss_anon_bytes"]),
        "write_anon_rise_bytes": rep["write_rss_anon_bytes"],
        "host_bound_bytes": rep["host_bound_bytes"],
        "meets_host_bound": rep["write_rss_anon_bytes"] <= rep["host_bound_bytes"],
        "ranks": rep.get("ranks", []),
        "median_export_seconds": sorted(r["report"]["seconds"] for r in runs)[len(runs) // 2],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=None, help="an HF safetensors dir (default: synthetic)")
    ap.add_argument("--calib", default=None, help="its calibration file (made when missing)")
    ap.add_argument("--size-gb", type=float, default=0.5, help="synthetic checkpoint size")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--nprocs", default="1,2", help="process counts to compare (default 1,2)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"]
    )
    ap.add_argument(
        "--lanes",
        default=None,
        help="shard files one process writes at once, to compare (e.g. 1,2,4; default: the "
        "export's own); every process count runs with each",
    )
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs per process count, alternating")
    ap.add_argument("--workdir", default=None, help="where outputs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the last export of each count")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", default=None, help="one process's sampled profile (bench.profile)")
    ap.add_argument(
        "--min-gbps", type=float, default=0.0, help="exit 1 if the first count is slower"
    )
    ap.add_argument(
        "--min-speedup",
        type=float,
        default=0.0,
        help="exit 1 if the last count's GB/s over the first is lower",
    )
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="qckpt-bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        if args.src:
            src = Path(args.src).resolve()
            cal = Path(args.calib or work / "calib.safetensors").resolve()
            if not cal.exists():
                make_calibration_for(src, cal)
        else:
            info = make_checkpoint(work, args.size_gb, args.hidden, args.intermediate, args.vocab)
            src, cal = Path(info["src"]), Path(info["calib"])
        setup_s = time.perf_counter() - t0
        source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        nprocs = [int(n) for n in args.nprocs.split(",")]
        lanes = [int(n) for n in args.lanes.split(",")] if args.lanes else [None]
        variants = {
            (n if lane is None else f"{n}x{lane}"): (n, lane) for lane in lanes for n in nprocs
        }
        counts = list(variants)
        runs: dict[int | str, list[dict]] = {k: [] for k in counts}
        for _ in range(args.repeat):  # alternating: a shared host's load hits every count alike
            for k, (n, lane) in variants.items():
                runs[k].append(run_once(work, src, cal, n, args, lane))
        first = runs[counts[0]][0]["digests"]
        same = all(r["digests"] == first for rs in runs.values() for r in rs)
        results = {n: summarize(n, rs, source_bytes) for n, rs in runs.items()}
        base = results[counts[0]]["gbps"]
        report = {
            "source": str(src),
            "source_bytes": source_bytes,
            "largest_tensor_bytes": runs[counts[0]][0]["report"]["largest_tensor_bytes"],
            "format": args.format,
            "setup_seconds": round(setup_s, 2),
            "same_files": same,
            "files": len(first),
            "runs": [results[n] for n in counts],
            "speedup_over_first": {n: round(results[n]["gbps"] / base, 2) for n in counts},
        }
        report["missed"] = _missed(report, counts, args)
        _print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if report["missed"] else 0


def _missed(report: dict, counts: list[int], args) -> list[str]:
    """The targets this run missed (exit 1 when any): same files, every run's anonymous-memory
    rise within the bound, and the --min-gbps / --min-speedup asked for."""
    out = [] if report["same_files"] else ["the runs wrote different files"]
    for r in report["runs"]:
        if not r["meets_host_bound"]:
            out.append(f"run {r['key']}: anon rise over 2 x largest + 256 MiB")
    first = report["runs"][0]
    if first["gbps"] < args.min_gbps:
        out.append(f"{counts[0]} process(es): {first['gbps']} GB/s < {args.min_gbps}")
    speedup = report["speedup_over_first"][counts[-1]]
    if speedup < args.min_speedup:
        out.append(
            f"{counts[-1]} processes: {speedup}x the first count's GB/s < {args.min_speedup}x"
        )
    return out


# ExportReport.steps in the order the main rank goes through them
_STEP_ORDER = {
    k: i
    for i, k in enumerate(
        "plan share create write wait check_written finish self_check commit".split()
    )
}


def _print(report: dict) -> None:
    gb = 1e9
    print(
        f"checkpoint {report['source_bytes'] / gb:.2f} GB, largest tensor "
        f"{report['largest_tensor_bytes'] / MiB:.0f} MiB; {report['files']} files, "
        f"same files in every run: {report['same_files']}"
    )
    print(
        f"{'run':>5} {'device':>7} {'export s':>9} {'GB/s':>7} {'wall s':>8} {'peak RSS':>10} "
        f"{'anon peak':>10} {'anon rise':>10} {'bound':>9}  ok"
    )
    for r in report["runs"]:
        print(
            f"{r['key']:>5} {r['device']:>7} {r['export_seconds']:>9.2f} {r['gbps']:>7.2f} "
            f"{r['wall_seconds']:>8.2f} {r['host_peak_rss_bytes'] / MiB:>8.0f}Mi "
            f"{r['host_peak_anon_bytes'] / MiB:>8.0f}Mi {r['write_anon_rise_bytes'] / MiB:>8.0f}Mi "
            f"{r['host_bound_bytes'] / MiB:>7.0f}Mi  {r['meets_host_bound']}"
        )
    for r in report["runs"]:
        if r.get("steps"):
            steps = sorted(r["steps"].items(), key=lambda kv: _STEP_ORDER.get(kv[0], 99))
            serial = sum(v for k, v in steps if k != "write")
            print(
                f"  {r['key']} (processes[x lanes]), main rank's steps (s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in steps)
                + f"; all but write {serial:.2f}"
            )
        _print_shares(r)
    print(f"GB/s over the first count: {report['speedup_over_first']}")
    print(
        "targets: " + ("met" if not report["missed"] else "MISSED: " + "; ".join(report["missed"]))
    )


def _print_shares(run: dict) -> None:
    """What each rank of a distributed run did: bytes read and written (what the shares are
    balanced on), files touched, its write phase, and the largest share of bytes moved over the
    mean (1.00: perfectly balanced; the slowest rank bounds the speed-up at nproc / this)."""
    rows = [r for r in run["ranks"] if "bytes_written" in r]
    if len(rows) < 2:
        return
    shares = [r["bytes_read"] + r["bytes_written"] for r in rows]
    mean = sum(shares) / len(shares)
    for r in rows:
        print(
            f"  {run['nproc']} procs, rank {r['rank']}: read {r['bytes_read'] / MiB:7.1f} MiB, "
            f"wrote {r['bytes_written'] / MiB:7.1f} MiB into {len(r['files'])} file(s), "
            f"write phase {r.get('phases', {}).get('write', 0.0):6.2f} s"
        )
    print(
        f"  {run['nproc']} procs: largest share (read + written) / mean = {max(shares) / mean:.3f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
