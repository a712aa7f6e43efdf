"""Whole commands, as a user waits for them: ``qckpt load`` beside transformers' own loads.

    python -m bench.whole_command make DIR --preset tiny                 # CPU, seconds
    python -m bench.whole_command run DIR --json whole.json              # CPU: BF16 only
    python -m bench.whole_command make DIR --preset qwen3-30b-a3b        # GPU: 61 GB
    python -m bench.whole_command make DIR --preset qwen3-30b-a3b --layers 8   # GPU: 11 GB
    python -m bench.whole_command run DIR --device cuda --json whole.json

``make`` writes a Qwen3-MoE checkpoint with transformers' ``from_config`` (random BF16 weights,
made on the GPU when there is one) and ``save_pretrained``, into a temp dir renamed into place
at the end (a dir that exists is complete). ``--preset qwen3-30b-a3b`` is Qwen3-30B-A3B's
shape (48 layers, hidden 2048, 128 experts of 768, top-8, 32/4 heads of 128, vocab 151936:
30.5 B parameters, 61 GB); size knobs override any field.

``run`` times each contender as a whole process (interpreter start, imports, the load, exit),
one after the other, on a page cache warmed by reading every file once first:

* ``qckpt``: ``python -m qckpt load RECIPE --json`` into ``--params`` (default fp8); its JSON
  gives the phase breakdown, the whole command's peaks and the load window's figures;
* ``hf_bf16``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16, device_map=DEVICE)``;
* ``hf_fp8``: the same with ``quantization_config=FineGrainedFP8Config()`` (transformers
  quantizes on the fly; it refuses to without a GPU, so on CPU it is skipped, and said so);
* ``qckpt_epN`` (with ``--ep N``): the same load over N ranks (``--nproc-per-node N``,
  ``parallel.ep=N``); its peaks are the largest rank's;
* ``read_ceiling``: the host's own ceiling for this read: every file read from the page cache
  by ``--threads`` threads into reused buffers (no torch), GB/s.

Each reports its wall time (measured here, around the process) and its whole-process device
peak (``torch.cuda.max_memory_allocated``, never reset) and host peak (VmHWM; anonymous RSS
sampled). Printed side by side with the ratios qckpt / transformers; ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20

PRESETS = {
    # Qwen3-30B-A3B's config.json (checked against transformers' Qwen3MoeConfig: 30.53 B params)
    "qwen3-30b-a3b": {
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1e6,
    },
    # the same kinds of tensors, small enough for a CPU run in seconds
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1024,
        "max_position_embeddings": 512,
        "rope_theta": 1e6,
    },
}
KNOBS = {  # flag -> config field
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "moe_inter": "moe_intermediate_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab": "vocab_size",
}


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- make ---------------------------------------------------------------------------------------


def make(out: Path, fields: dict, device: str) -> dict:
    """A Qwen3-MoE checkpoint of ``fields`` at ``out`` (kept as it is when it exists)."""
    if (out / "config.json").is_file():
        return {"checkpoint": str(out), "made": False}
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    dev = _device(device)
    cfg = Qwen3MoeConfig(norm_topk_prob=True, tie_word_embeddings=False, **fields)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    t_init = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), max_shard_size="5GB")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "checkpoint": str(out),
        "made": True,
        "device": dev,
        "parameters": params,
        "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "init_seconds": round(t_init, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }


# ---- the contenders, each a child process ---------------------------------------------------------


def child_hf(ckpt: str, mode: str, device: str) -> dict:
    """transformers' own load of ``ckpt`` in this (fresh) process: BF16, or FP8 on the fly."""
    from qckpt import phases

    rec = phases.begin()
    import torch
    from transformers import AutoModelForCausalLM

    kw: dict = {"dtype": torch.bfloat16}
    if device != "cpu":  # a device_map needs accelerate (FP8 needs it anyway); CPU is the default
        kw["device_map"] = device
    if mode == "fp8":
        from transformers import FineGrainedFP8Config

        kw["quantization_config"] = FineGrainedFP8Config()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, **kw)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    dtypes: dict[str, int] = {}
    for p in model.parameters():
        dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + p.numel()
    return {
        "load_seconds": round(load_s, 3),
        "process_seconds": round(rec.total(), 3),
        "peaks": rec.peaks(),
        "param_numel_per_dtype": dtypes,
    }


def _files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def read_ceiling(ckpt: Path, threads: int, chunk: int = 64 * MiB) -> dict:
    """Every file read once by ``threads`` threads (chunks handed out in order), GB/s."""
    jobs = [(f, off) for f in _files(ckpt) for off in range(0, f.stat().st_size, chunk)]
    lock = threading.Lock()
    total = [0]

    def worker() -> None:
        buf = bytearray(chunk)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    f, off = jobs.pop()
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY)
                n = os.preadv(fd, [view], off)
                with lock:
                    total[0] += n
        finally:
            for fd in fds.values():
                os.close(fd)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    secs = time.perf_counter() - t0
    return {"bytes": total[0], "seconds": round(secs, 3), "gbps": total[0] / secs / 1e9}


def _recipe(ckpt: Path, work: Path, params: str, device: str) -> Path:
    text = (
        f"model: {{source: {json.dumps(str(ckpt))}, dtype: bfloat16}}\n"
        f"checkpoint: {{path: {json.dumps(str(ckpt))}, format: safetensors}}\n"
        f"load: {{params: {params}, device: {device}}}\n"
        'quant: {ignore: ["lm_head", "*.mlp.gate"]}\n'
    )
    path = work / "load.yaml"
    path.write_text(text)
    return path


def _run_child(cmd: list[str], out_json: Path, timeout: float) -> dict:
    """Run ``cmd`` as a whole process; its wall time as measured here, plus its JSON."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    wall = time.perf_counter() - t0
    if r.returncode != 0 or not out_json.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {r.returncode}: " + " | ".join(tail)}
    return {"wall_seconds": round(wall, 3), **json.loads(out_json.read_text())}


def _contenders(ckpt: Path, work: Path, args) -> dict[str, list[str] | None]:
    py = sys.executable
    recipe = _recipe(ckpt, work, args.params, args.device)
    me = [py, "-m", "bench.whole_command", "child-hf", str(ckpt), "--device", args.device]
    fp8_ok = args.device.startswith("cuda")
    load = [py, "-m", "qckpt", "load", str(recipe)]
    cmds = {
        "qckpt": [*load, "--json", str(work / "qckpt.json")],
        "hf_bf16": [*me, "--mode", "bf16", "--json", str(work / "hf_bf16.json")],
        # transformers refuses to quantize to FP8 without a GPU ("A GPU or XPU is needed")
        "hf_fp8": [*me, "--mode", "fp8", "--json", str(work / "hf_fp8.json")] if fp8_ok else None,
    }
    if fp8_ok:  # the default keeps one scratch (issue 18's bound); 2 overlaps more reads
        cmds["qckpt_inflight2"] = [
            *load,
            "--set",
            "load.max_inflight=2",
            "--json",
            str(work / "qckpt_inflight2.json"),
        ]
    if args.ep > 1:  # the same load over N ranks with experts sharded (one GPU each)
        n = str(args.ep)
        ep = [*load, "--nproc-per-node", n, "--set", f"parallel.ep={n}"]
        cmds[f"qckpt_ep{n}"] = [*ep, "--json", str(work / f"qckpt_ep{n}.json")]
    return cmds


def run(ckpt: Path, args) -> dict:
    ckpt = ckpt.resolve()
    work = Path(tempfile.mkdtemp(prefix="qckpt-whole-"))
    try:
        warm = read_ceiling(ckpt, args.threads)  # the page cache warmed; its rate not kept
        result: dict = {
            "checkpoint": _describe(ckpt),
            "device": args.device,
            "params": args.params,
            "page_cache_warmup_gbps": round(warm["gbps"], 2),
            "runs": {},
        }
        cmds = _contenders(ckpt, work, args)
        reps: dict[str, list[dict]] = {n: [] for n, c in cmds.items() if c is not None}
        for _ in range(args.repeat):  # interleaved, so a drift hits every contender alike
            for name in reps:
                cmd = cmds[name]
                reps[name].append(_run_child(cmd, work / f"{name}.json", args.timeout))
        for name in cmds:
            skipped = {"skipped": "transformers' FP8 quantization needs a GPU"}
            result["runs"][name] = _best(reps[name]) if name in reps else skipped
        result["runs"]["read_ceiling"] = read_ceiling(ckpt, args.threads)
        result["ratios"] = _ratios(result["runs"])
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _best(got: list[dict]) -> dict:
    """The fastest of the repeats, with every wall time kept beside it."""
    ok = [g for g in got if "wall_seconds" in g]
    if not ok:
        return got[-1]
    best = min(ok, key=lambda g: g["wall_seconds"])
    walls = [g["wall_seconds"] for g in ok]
    return {**best, "wall_seconds_all": walls, "wall_seconds_median": statistics.median(walls)}


def _describe(ckpt: Path) -> dict:
    from safetensors import safe_open

    numel_max, tensors = 0, 0
    for f in _files(ckpt):
        with safe_open(str(f), "np") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = h.get_slice(k).get_shape()
                n = 1
                for s in shape:
                    n *= int(s)
                numel_max = max(numel_max, n)
                tensors += 1
    cfg = json.loads((ckpt / "config.json").read_text())
    return {
        "path": str(ckpt),
        "bytes": sum(f.stat().st_size for f in _files(ckpt)),
        "tensors": tensors,
        "max_numel": numel_max,
        "layers": cfg.get("num_hidden_layers"),
        "experts": cfg.get("num_experts", cfg.get("num_local_experts")),
    }


def _peak(run: dict, key: str) -> float | None:
    """A run's peak; over several ranks, the largest rank's (each rank is one GPU)."""
    ranks = run.get("ranks") or []
    if ranks:
        got = [r["peaks"].get(key) for r in ranks if r["peaks"].get(key) is not None]
        return max(got) if got else None
    return (run.get("peaks") or {}).get(key)


def _ratios(runs: dict) -> dict:
    q = runs.get("qckpt", {})
    out: dict = {}
    for other in ("hf_bf16", "hf_fp8"):
        o = runs.get(other, {})
        for mine in ("qckpt", "qckpt_inflight2"):
            m = runs.get(mine, {})
            if "wall_seconds" in m and "wall_seconds" in o:
                out[f"wall_{mine}_over_{other}"] = round(m["wall_seconds"] / o["wall_seconds"], 3)
        for key in ("device_peak_bytes", "host_peak_rss_bytes"):
            a, b = _peak(q, key), _peak(o, key)
            if a and b:
                out[f"{key.replace('_bytes', '')}_qckpt_over_{other}"] = round(a / b, 3)
    for name, r in runs.items():
        if (
            name.startswith("qckpt_ep")
            and _peak(r, "device_peak_bytes")
            and _peak(q, "device_peak_bytes")
        ):
            # issue 17: each rank's whole-command peak against the one-GPU load's
            ratio = _peak(r, "device_peak_bytes") / _peak(q, "device_peak_bytes")
            out[f"{name}_max_rank_device_peak_over_qckpt"] = round(ratio, 3)
    for mine in ("qckpt", "qckpt_inflight2"):
        m = runs.get(mine, {})
        peak = _peak(m, "device_peak_bytes")
        if peak and m.get("runs"):
            # issue 18: the whole command's peak against the FP8 model + 2*max(numel) + 64 MiB
            # (one BF16 scratch of the largest quantized tensor, whatever max_inflight is; the
            # model is freed before the report, so its bytes come from the load's report)
            r = m["runs"][0]
            scratch = r["predicted_transient_bytes"] // max(1, r["max_inflight"])
            bound = r["param_bytes"] + scratch + 64 * MiB
            out[f"{mine}_device_peak_over_one_scratch_bound"] = round(peak / bound, 4)
    if "runs" in q:  # qckpt's read rate against the host's ceiling for the same files
        ceiling = runs["read_ceiling"]["gbps"]
        out["qckpt_read_gbps"] = round(q["runs"][0]["gbps"], 3)
        out["read_ceiling_gbps"] = round(ceiling, 3)
        if _peak(q, "device_peak_bytes"):
            # the whole command's peak against the model + max_inflight scratches + 64 MiB
            r = q["runs"][0]
            bound = r["param_bytes"] + r["predicted_transient_bytes"] + 64 * MiB
            out["qckpt_device_peak_over_bound"] = round(_peak(q, "device_peak_bytes") / bound, 3)
    return out


# ---- printing -------------------------------------------------------------------------------------


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def table(res: dict) -> str:
    ck = res["checkpoint"]
    lines = [
        f"{ck['path']}: {ck['bytes'] / 1e9:.1f} GB, {ck['tensors']} tensors, "
        f"{ck['layers']} layers; device {res['device']}; qckpt into {res['params']}",
        f"{'':14}{'wall s':>9}{'load s':>9}{'dev peak GiB':>14}{'host peak GiB':>15}"
        f"{'anon GiB':>10}",
    ]
    for name, r in res["runs"].items():
        if name == "read_ceiling":
            continue
        if "wall_seconds" not in r:
            lines.append(f"{name:14}{r.get('skipped') or r.get('error')}")
            continue
        load_s = r["runs"][0]["seconds"] if name.startswith("qckpt") else r.get("load_seconds")
        lines.append(
            f"{name:14}{r['wall_seconds']:9.2f}{load_s:9.2f}"
            f"{_gib(_peak(r, 'device_peak_bytes')):>14}{_gib(_peak(r, 'host_peak_rss_bytes')):>15}"
            f"{_gib(_peak(r, 'host_peak_anon_bytes')):>10}"
        )
    q = res["runs"].get("qckpt", {})
    if "phases" in q:
        ph = " ".join(f"{k} {v:.2f}" for k, v in q["phases"].items() if v >= 0.005)
        lines.append(f"qckpt phases (s): {ph}")
    rc = res["runs"]["read_ceiling"]
    lines.append(f"read ceiling: {rc['gbps']:.2f} GB/s ({rc['bytes'] / 1e9:.1f} GB)")
    lines.append("ratios: " + ", ".join(f"{k} {v}" for k, v in res["ratios"].items()))
    return "\n".join(lines)


# ---- the command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a Qwen3-MoE checkpoint (kept when it exists)")
    mk.add_argument("dir", type=Path)
    mk.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for flag in KNOBS:
        mk.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    mk.add_argument("--device", default="auto")
    rn = sub.add_parser("run", help="time qckpt load beside transformers' loads")
    rn.add_argument("dir", type=Path)
    rn.add_argument("--device", default="auto")
    rn.add_argument("--params", default="fp8")
    rn.add_argument("--repeat", type=int, default=1)
    rn.add_argument("--ep", type=int, default=1, help="also load over N ranks with parallel.ep=N")
    rn.add_argument("--threads", type=int, default=8, help="threads of the read ceiling")
    rn.add_argument("--timeout", type=float, default=900.0, help="per child process, seconds")
    rn.add_argument("--json", type=Path, default=None)
    ch = sub.add_parser("child-hf", help=argparse.SUPPRESS)
    ch.add_argument("dir")
    ch.add_argument("--mode", choices=["bf16", "fp8"], required=True)
    ch.add_argument("--device", required=True)
    ch.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)

    if args.cmd == "make":
        fields = dict(PRESETS[args.preset])
        fields |= {KNOBS[k]: v for k in KNOBS if (v := getattr(args, k)) is not None}
        print(json.dumps(make(args.dir, fields, args.device)))
        return 0
    if args.cmd == "child-hf":
        args.json.write_text(json.dumps(child_hf(args.dir, args.mode, args.device)))
        return 0
    args.device = _device(args.device)
    res = run(args.dir, args)
    print(table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
