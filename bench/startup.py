"""Where a heavy command's start-up goes, and what bytecode caches change (issue 18).

    python -m bench.startup commands CKPT_DIR [--device cuda] [--repeat 2] [--pycache DIR]
                                              [--cuda-warmup]
    python -m bench.startup overlap [--device cuda] [--repeat 3]
    python -m bench.startup light [--repeat 5] [--work DIR]

``commands`` runs ``qckpt load`` and ``qckpt calibrate`` of an HF checkpoint dir as whole
processes, ``--repeat`` times each, and prints per run the wall time (measured here, around the
process), the ``startup`` phase and its parts (``--json``'s ``startup_parts``: before_main,
recipe, torch, model_code, qckpt_modules, other) and how many imported modules had no bytecode
cache (``compiled_at_import``: Python compiled them from source, as it does in every process
where caches are absent and cannot be written, e.g. under ``PYTHONDONTWRITEBYTECODE``).
With ``--pycache DIR`` the same runs are repeated with ``PYTHONPYCACHEPREFIX=DIR``: one
unmeasured run first writes the caches of everything the command imports into DIR (the install
is not touched), then the measured runs read them; the two sets side by side are what caches
are worth on that machine. ``--cuda-warmup`` adds runs with ``QCKPT_CUDA_WARMUP=0`` (the
start-up's CUDA warm-up off: by default the first CUDA tensor, the load's quantize kernels and
its pinned buffers are made on a thread during the imports, ``pipeline.imports.warm_imports``).

``light`` times the commands that need no model code (issue 30) on the tiny MoE recipe: it
makes a DCP checkpoint, a calibration file and an export in ``--work`` (once, unmeasured), then
runs ``export``, ``check``, ``inspect`` (of the DCP dir, the export, the calibration file) and
``plan`` as whole processes (and ``python -c "import torch"``, the floor under export's
start-up), interleaved, ``--repeat`` times each, and prints the medians: the
wall time around the process, and for export its ``startup`` phase (``--json``). check,
inspect and plan enter no phase after the start-up, so their start-up is the whole process.

``overlap`` measures, each variant a fresh process, whether starting work on another thread
while the main thread imports the model's code shortens the whole: ``seq`` (import torch, then
transformers' Qwen3-MoE modeling module, then the first CUDA tensor when ``--device cuda``),
``cuda_thread`` (the first CUDA tensor made on a thread while the main thread imports the
modeling module) and ``import_thread`` (``import transformers`` and ``transformers.models`` on a
thread while the main thread imports torch). Python runs one thread's bytecode at a time, so
only waits that release the GIL (file reads, the driver) can overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tiny-moe.yaml"


def _env(pycache: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = pycache
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # the caches go to the prefix, not the install
    return {**env, **(extra or {})}


def _command_args(cmd: str, ckpt: str, device: str, work: Path) -> list[str]:
    sets = [
        f"model.source={ckpt}",
        f"checkpoint.path={ckpt}",
        "checkpoint.format=safetensors",
        f"load.device={device}",
    ]
    if cmd == "load":
        sets.append("load.params=fp8")
    else:
        sets += ["calibrate.data.num_samples=8", f"calibrate.output={work / 'amax.safetensors'}"]
    args = [cmd, str(RECIPE)]
    for s in sets:
        args += ["--set", s]
    return args + ["--json", str(work / f"{cmd}.json")]


def _run_command(
    cmd: str, ckpt: str, device: str, pycache: str | None, extra: dict[str, str] | None = None
) -> dict:
    with tempfile.TemporaryDirectory(prefix="qckpt-startup-") as tmp:
        work = Path(tmp)
        argv = [sys.executable, "-m", "qckpt", *_command_args(cmd, ckpt, device, work)]
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=_env(pycache, extra), capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            return {"command": cmd, "rc": r.returncode, "error": r.stderr[-1500:]}
        data = json.loads((work / f"{cmd}.json").read_text())
    ph = data.get("phases", {})
    return {
        "command": cmd,
        "rc": 0,
        "wall_s": round(wall, 3),
        "startup_s": ph.get("startup"),
        "total_s": ph.get("total"),
        "phases": ph,
        "startup_parts": data.get("startup_parts"),
        "compiled_at_import": data.get("compiled_at_import"),
    }


def _print_row(label: str, row: dict) -> None:
    if row.get("rc"):
        print(f"{label:28s} FAILED rc={row['rc']}: {row.get('error', '')[-300:]}")
        return
    parts = " ".join(f"{k}={v:.2f}" for k, v in (row["startup_parts"] or {}).items())
    cc = row.get("compiled_at_import") or {}
    print(
        f"{label:28s} wall {row['wall_s']:6.2f}  startup {row['startup_s']:6.2f}  [{parts}]  "
        f"compiled from source: {cc.get('modules', '?')} modules "
        f"{(cc.get('source_bytes') or 0) / 2**20:.1f} MiB {cc.get('by_package', {})}"
    )


def commands(args: argparse.Namespace) -> dict:
    settings: list[tuple[str, str | None, dict]] = [("as installed", None, {})]
    if args.cuda_warmup:
        settings.append(("no cuda warm-up", None, {"QCKPT_CUDA_WARMUP": "0"}))
    if args.pycache:
        settings.append((f"caches in {args.pycache}", args.pycache, {}))
    out: dict[str, list] = {}
    if args.pycache:  # one run that writes every cache the commands need, not measured
        for cmd in ("load", "calibrate"):
            _run_command(cmd, args.ckpt, args.device, args.pycache)
    # interleaved: a busy host weighs on every setting alike
    for i in range(args.repeat):
        for label, pycache, extra in settings:
            for cmd in ("load", "calibrate"):
                row = _run_command(cmd, args.ckpt, args.device, pycache, extra)
                out.setdefault(label, []).append(row)
                _print_row(f"{label}: {cmd} #{i + 1}", row)
    print("\nmedian wall / startup (s):")
    for label, rows in out.items():
        for cmd in ("load", "calibrate"):
            ok = [r for r in rows if r["command"] == cmd and not r.get("rc")]
            if ok:
                w = statistics.median(r["wall_s"] for r in ok)
                s = statistics.median(r["startup_s"] for r in ok)
                print(f"  {label:30s} {cmd:10s} wall {w:6.2f}  startup {s:6.2f}")
    return out


OVERLAP = r"""
import sys, threading, time
t0 = time.perf_counter()
mode, device = sys.argv[1], sys.argv[2]
errors = []

def cuda_first_use():
    try:
        import torch
        torch.zeros(1, device="cuda")
    except Exception as e:  # reported below
        errors.append(repr(e))

def transformers_package():
    try:
        import transformers, transformers.models  # noqa: F401 (neither imports torch)
    except Exception as e:
        errors.append(repr(e))

if mode == "import_thread":
    th = threading.Thread(target=transformers_package); th.start()
    import torch
    th.join()
else:
    import torch
th = None
if mode == "cuda_thread" and device == "cuda":
    th = threading.Thread(target=cuda_first_use); th.start()
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
if th is not None:
    th.join()
elif device == "cuda":
    cuda_first_use()
import resource
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", round(time.perf_counter() - t0, 3), round(ru.ru_utime + ru.ru_stime, 3), errors)
"""


def overlap(args: argparse.Namespace) -> dict:
    modes = ["seq", "import_thread"] + (["cuda_thread"] if args.device == "cuda" else [])
    got: dict[str, list] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for m in modes:  # interleaved, so a busy host weighs on every variant alike
            r = subprocess.run(
                [sys.executable, "-c", OVERLAP, m, args.device], capture_output=True, text=True
            )
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
            if line is None:
                got[m].append({"error": r.stderr[-800:]})
                continue
            _, wall, cpu, errs = line.split(" ", 3)
            got[m].append({"wall_s": float(wall), "cpu_s": float(cpu), "errors": errs})
    for m, rows in got.items():
        ok = [r for r in rows if "wall_s" in r]
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in ok)
        cpus = ", ".join(f"{r['cpu_s']:.2f}" for r in ok)
        med = statistics.median(r["wall_s"] for r in ok) if ok else float("nan")
        print(
            f"{m:14s} wall median {med:6.2f}  ({walls})  cpu ({cpus})  {rows[-1].get('errors') or rows[-1].get('error', '')}"
        )
    return got


LIGHT = ("export", "check", "inspect dcp", "inspect export", "inspect calibration", "plan",
         "import torch")  # fmt: skip
# the floor under export's start-up: ``import torch`` alone, in a process of its own


def _light_argv(cmd: str, work: Path) -> list[str]:
    sets = [
        "--set", f"checkpoint.path={work / 'dcp'}",
        "--set", f"calibrate.output={work / 'calib.safetensors'}",
        "--set", f"export.output={work / 'fp8'}",
        "--set", "export.overwrite=true",
        "--set", "calibrate.data.num_samples=4",
    ]  # fmt: skip
    return {
        "convert": ["convert", str(RECIPE), str(work / "dcp"), *sets],
        "calibrate": ["calibrate", str(RECIPE), *sets],
        "export": ["export", str(RECIPE), *sets, "--json", str(work / "export.json")],
        "check": ["check", str(work / "fp8")],
        "inspect dcp": ["inspect", str(work / "dcp")],
        "inspect export": ["inspect", str(work / "fp8")],
        "inspect calibration": ["inspect", str(work / "calib.safetensors")],
        "plan": ["plan", str(RECIPE), "--nproc-per-node", "1", *sets],
    }[cmd]


def light(args: argparse.Namespace) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="qckpt-light-"))
    work.mkdir(parents=True, exist_ok=True)
    for cmd in ("convert", "calibrate", "export"):  # the inputs, and every bytecode cache
        if cmd != "convert" or not (work / "dcp").exists():
            r = subprocess.run(
                [sys.executable, "-m", "qckpt", *_light_argv(cmd, work)],
                env=_env(None), capture_output=True, text=True, cwd=str(work),
            )  # fmt: skip
            if r.returncode != 0:
                raise SystemExit(f"{cmd} failed: {r.stderr[-1500:]}")
    got: dict[str, list[dict]] = {c: [] for c in LIGHT}
    for _ in range(args.repeat):
        for cmd in LIGHT:  # interleaved: a busy host weighs on every command alike
            argv = ["-c", "import torch"] if cmd == "import torch" else None
            t0 = time.perf_counter()
            r = subprocess.run(
                [sys.executable, *(argv or ["-m", "qckpt", *_light_argv(cmd, work)])],
                env=_env(None), capture_output=True, text=True, cwd=str(work),
            )  # fmt: skip
            row: dict = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 3)}
            if cmd == "export" and r.returncode == 0:
                row["startup_s"] = json.loads((work / "export.json").read_text())["phases"][
                    "startup"
                ]
            got[cmd].append(row)
    print(f"medians of {args.repeat} (s), work dir {work}:")
    for cmd, rows in got.items():
        ok = [r for r in rows if r["rc"] in (0, 1) and (cmd != "check" or r["rc"] == 0)]
        walls = [r["wall_s"] for r in ok]
        line = f"  {cmd:20s} wall {statistics.median(walls):5.2f} ({', '.join(map(str, walls))})"
        if cmd == "export" and ok:
            starts = [r["startup_s"] for r in ok]
            line += f"  startup {statistics.median(starts):5.2f} ({', '.join(map(str, starts))})"
        if len(ok) < len(rows):
            line += f"  {len(rows) - len(ok)} FAILED"
        print(line)
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("commands")
    c.add_argument("ckpt")
    c.add_argument("--pycache", default=None)
    c.add_argument("--cuda-warmup", action="store_true", help="also with QCKPT_CUDA_WARMUP=0")
    o = sub.add_parser("overlap")
    li = sub.add_parser("light")
    li.add_argument("--work", default=None, help="where the inputs go (kept; made once)")
    for p in (c, o, li):
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
        p.add_argument("--repeat", type=int, default=2)
        p.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"commands": commands, "overlap": overlap, "light": light}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
