"""The quality benchmark: every export layout x format of a trained model, held-out bits per
byte through ``qckpt eval``, through transformers and through vLLM, side by side.

    python -m bench.quality [--model llama=../shared/quality/models/llama-textlm]
        [--model qwen3moe=DIR] [--extra NAME=DIR ...] [--windows 64] [--work /tmp/qckpt-quality]
        [--doc docs/QUALITY.md] [--json out.json] [--no-vllm] [--no-transformers]
        [--vllm-parallel N]

For each ``--model NAME=DIR`` (an HF dir of BF16 safetensors; default: the shared Llama), each
variant of :data:`VARIANTS` is calibrated on 128 x 512 bytes of ``calib.bin`` (``max``, batches
of 16) and exported (``qckpt calibrate`` and ``qckpt export``, all of one model in one process),
then measured on the held-out windows of the shared README (``heldout.bin``, 64 x 513, seed 7):

* ``qckpt eval``: the export emulated from its own files as a serving stack computes it (with
  mean KL(source || export) and top-1 agreement), and again with ``--inputs unquantized`` (the
  weights alone: what a weight-only kernel computes, as vLLM runs NVFP4 on Hopper) and with
  ``--weights unquantized`` (the inputs alone: the source's weights, the export's inputs);
* transformers: ``AutoModelForCausalLM.from_pretrained(EXPORT)`` (compressed-tensors' own
  quantizer; ModelOpt dirs are skipped: transformers has no ModelOpt quantizer and would read
  the codes as weights);
* vLLM (when importable): the export served, prompt log-probabilities (one process per engine;
  ``--vllm-parallel N`` runs N engines at once, each with 0.85/N of the GPU).

``--algorithms max,mse,awq,gptq,gptq+mse``: instead of the layouts, the NVFP4 W4A4 variant
calibrated with each ``calibrate.algorithm`` (a table of its own, "NAME, calibrate.algorithm");
``--algorithms-on fp8`` (or ``nvfp4,fp8``) calibrates the FP8 per-tensor variant instead (or too).

``--extra NAME=DIR``: another tool's export (llm-compressor's, ModelOpt's) of one of the models
(the one whose config.json matches), measured the same three ways. The table of each model goes
into ``--doc`` between markers named by the model and the machine, with the date, the machine
and the command; a run on another machine adds its own table, it never replaces this one's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUALITY = ROOT.parent / "shared" / "quality"

# name -> (export.format, (weights format, granularity), (inputs format, granularity, dynamic))
VARIANTS: dict[str, tuple[str, tuple[str, str], tuple[str, str, bool]]] = {
    "compressed-tensors FP8 per-tensor, static inputs": (
        "compressed-tensors",
        ("fp8", "tensor"),
        ("fp8", "tensor", False),
    ),
    "compressed-tensors FP8 per-channel, dynamic per-token inputs": (
        "compressed-tensors",
        ("fp8", "channel"),
        ("fp8", "tensor", True),
    ),
    "compressed-tensors FP8 block 128x128, dynamic per-group inputs": (
        "compressed-tensors",
        ("fp8", "block"),
        ("fp8", "block", True),
    ),
    "compressed-tensors NVFP4 W4A4": (
        "compressed-tensors",
        ("nvfp4", "tensor"),
        ("nvfp4", "tensor", False),
    ),
    # weight-only 4-bit (issue 42): what Hopper and Ampere serve; INT4 in groups of 128
    "compressed-tensors INT4 W4A16, group 128": (
        "compressed-tensors",
        ("int4", "group"),
        ("none", "tensor", False),
    ),
    "compressed-tensors INT8 W8A8 per-channel, dynamic per-token inputs": (
        "compressed-tensors",
        ("int8", "channel"),
        ("int8", "tensor", True),
    ),
    "compressed-tensors MXFP4A16": (
        "compressed-tensors",
        ("mxfp4", "tensor"),
        ("none", "tensor", False),
    ),
    "compressed-tensors MXFP8, dynamic per-32 inputs": (
        "compressed-tensors",
        ("mxfp8", "tensor"),
        ("mxfp8", "tensor", True),
    ),
    "compressed-tensors NVFP4A16": (
        "compressed-tensors",
        ("nvfp4", "tensor"),
        ("none", "tensor", False),
    ),
    "ModelOpt FP8": ("modelopt", ("fp8", "tensor"), ("fp8", "tensor", False)),
    "ModelOpt FP8_PER_CHANNEL_PER_TOKEN": ("modelopt", ("fp8", "channel"), ("fp8", "tensor", True)),
    "ModelOpt NVFP4": ("modelopt", ("nvfp4", "tensor"), ("nvfp4", "tensor", False)),
}

# several schemes in one export (``--mixes``): name -> (export.format, the recipe's quant section).
# The MLP (for an MoE: its routed experts; the router stays BF16 through ignore) in NVFP4 W4A4,
# attention in FP8 per-tensor with static inputs: what ModelOpt's nvfp4_mlp_only / experts-only
# recipes ship; compared in one table with the all-FP8 and all-NVFP4 exports of the same layout
_MIX_QUANT = """
  ignore: ["lm_head", "*.mlp.gate"]
  schemes:
    - targets: ["*.mlp.*"]
      weights: {format: nvfp4}
      inputs: {format: nvfp4}
    - targets: ["*.self_attn.*"]
      weights: {format: fp8, granularity: tensor}
      inputs: {format: fp8, granularity: tensor, dynamic: false}"""
# what Hopper and Ampere users mix: INT4 W4A16 (group 128) MLP / experts, FP8 per-channel
# attention with dynamic per-token inputs
_MIX_INT4 = """
  ignore: ["lm_head", "*.mlp.gate"]
  schemes:
    - targets: ["*.mlp.*"]
      weights: {format: int4, granularity: group, block_size: [128]}
      inputs: {format: none}
    - targets: ["*.self_attn.*"]
      weights: {format: fp8, granularity: channel}
      inputs: {format: fp8, granularity: tensor, dynamic: true}"""
MIX_INT4 = "compressed-tensors mixed: INT4 W4A16 MLP + FP8 per-channel attention"
MIXES: dict[str, tuple[str, str]] = {
    "compressed-tensors mixed: NVFP4 MLP + FP8 attention": ("compressed-tensors", _MIX_QUANT),
    MIX_INT4: ("compressed-tensors", _MIX_INT4),
    "ModelOpt mixed (MIXED_PRECISION): NVFP4 MLP + FP8 attention": ("modelopt", _MIX_QUANT),
}
MIX_BASES = [
    "compressed-tensors FP8 per-tensor, static inputs",
    "compressed-tensors NVFP4 W4A4",
    "ModelOpt FP8",
    "ModelOpt NVFP4",
]

# calibrate.algorithm runs (``--algorithms``): a variant (``--algorithms-on``: the NVFP4 W4A4 one
# unless said) calibrated with each algorithm; "+mse" / "+pow2" add the option that
# bench.algorithms_quality names the same way
ALGORITHM_SEP = ", calibrate.algorithm "
ALGORITHM_BASES = {
    "nvfp4": "compressed-tensors NVFP4 W4A4",
    "fp8": "compressed-tensors FP8 per-tensor, static inputs",
    "fp8-channel": "compressed-tensors FP8 per-channel, dynamic per-token inputs",
    "int4": "compressed-tensors INT4 W4A16, group 128",
    "nvfp4a16": "compressed-tensors NVFP4A16",
    "int8": "compressed-tensors INT8 W8A8 per-channel, dynamic per-token inputs",
    "mxfp4": "compressed-tensors MXFP4A16",
    "mxfp8": "compressed-tensors MXFP8, dynamic per-32 inputs",
    "int4-fp8": MIX_INT4,
}
ALGORITHMS: dict[str, dict[str, str]] = {
    "max": {"algorithm": "max"},
    "mse": {"algorithm": "mse"},
    "mse+hessian": {"algorithm": "mse", "mse_weighting": "hessian"},
    "awq": {"algorithm": "awq"},
    "gptq": {"algorithm": "gptq"},
    "gptq+mse": {"algorithm": "gptq", "gptq_block_scales": "mse"},
    "gptq+mse+qin": {
        "algorithm": "gptq",
        "gptq_block_scales": "mse",
        "gptq_inputs": "quantized",
    },
    "gptq+mse+hessian": {
        "algorithm": "gptq",
        "gptq_block_scales": "mse",
        "mse_weighting": "hessian",
    },
}


def variant_names(
    algorithms: list[str], on: list[str] | None = None, mixes: bool = False
) -> list[str]:
    """Every layout variant, or with ``algorithms`` each variant of ``on`` (keys of
    :data:`ALGORITHM_BASES`; NVFP4 W4A4 by default) once per algorithm, or with ``mixes`` the
    mixed exports beside the one-scheme ones they mix."""
    if mixes:
        return [*MIX_BASES, *MIXES]
    if not algorithms:
        return list(VARIANTS)
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad:
        raise SystemExit(f"--algorithms: unknown {bad}; known: {', '.join(ALGORITHMS)}")
    on = on or ["nvfp4"]
    bad = [b for b in on if b not in ALGORITHM_BASES]
    if bad:
        raise SystemExit(f"--algorithms-on: unknown {bad}; known: {', '.join(ALGORITHM_BASES)}")
    return [f"{ALGORITHM_BASES[b]}{ALGORITHM_SEP}{a}" for b in on for a in algorithms]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _recipe(model: Path, work: Path, name: str, calib_bin: Path, heldout: Path) -> Path:
    base, _, algo = name.partition(ALGORITHM_SEP)
    if base in MIXES:
        fmt, quant = MIXES[base]
    else:
        fmt, w, i = VARIANTS[base]
        quant = f"""
  weights: {{format: {w[0]}, granularity: {w[1]}}}
  inputs: {{format: {i[0]}, granularity: {i[1]}, dynamic: {str(i[2]).lower()}}}
  ignore: ["lm_head", "*.mlp.gate"]"""
    cal = "\n  ".join(f"{k}: {v}" for k, v in ALGORITHMS[algo or "max"].items())
    out = work / _slug(name)
    text = f"""
model: {{source: {model}}}
checkpoint: {{path: {model}}}
quant:{quant}
calibrate:
  data: {{source: text, path: {calib_bin}, num_samples: 128, seq_len: 512, batch_size: 16}}
  {cal}
  output: {out}.calib.safetensors
export: {{format: {fmt}, output: {out}, overwrite: true}}
eval: {{path: {heldout}}}
"""
    path = work / f"{_slug(name)}.yaml"
    path.write_text(text)
    return path


def make_exports(
    model: Path,
    work: Path,
    calib_bin: Path,
    heldout: Path,
    reuse: bool = False,
    variants: list[str] | None = None,
) -> dict[str, Path]:
    """Calibrate and export every variant (one process for all: one start-up); ``reuse``: keep
    the exports a previous run left in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    variants = variants or list(VARIANTS)
    names = [n for n in variants if not (reuse and (work / _slug(n) / "config.json").is_file())]
    recipes = [str(_recipe(model, work, n, calib_bin, heldout)) for n in names]
    if not recipes:
        return {n: work / _slug(n) for n in variants}
    # a variant whose calibrate or export fails is left out (its line says why), not the run
    code = (
        "import sys\nfrom qckpt.cli.app import main\n"
        "failed = 0\n"
        "for r in sys.argv[1:]:\n"
        "    for cmd in ('calibrate', 'export'):\n"
        "        try:\n            main([cmd, r])\n"
        "        except SystemExit as e:\n"
        "            if e.code not in (0, None):\n"
        "                print(f'VARIANT FAILED: {cmd} {r}: exit {e.code}', flush=True)\n"
        "                failed += 1\n                break\n"
        "sys.exit(1 if failed == len(sys.argv) - 1 else 0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, *recipes], cwd=ROOT, text=True)
    if p.returncode:
        raise SystemExit(f"calibrate/export failed for {model} (exit {p.returncode})")
    made = {n: work / _slug(n) for n in variants}
    return {n: d for n, d in made.items() if (d / "config.json").is_file()}


# what a linear's weight is stored as in an export: its codes and the scales that go with them
_WEIGHT_PARTS = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_scale_2",
    "weight_global_scale",
    "weight_scale_inv",
)


def bits_per_weight(export: Path, source: Path) -> float:
    """The average bits a weight of the source's linears takes in ``export``: the bytes of each
    linear's stored weight and weight scales (BF16 for the linears left unquantized), over the
    source's count of linear weights. Embeddings, norms and input / KV scales are not counted."""
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, tuple[int, int]]:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    n = math.prod(sl.get_shape())
                    out[k] = (n, n * _itemsize(sl.get_dtype()))
        return out

    src = tensors(source)
    linears = [k[: -len(".weight")] for k, (n, _) in src.items() if k.endswith(".weight")]
    linears = [m for m in linears if "embed" not in m and "norm" not in m]
    got = tensors(export)
    numel = sum(src[f"{m}.weight"][0] for m in linears)
    nbytes = sum(got.get(f"{m}.{p}", (0, 0))[1] for m in linears for p in _WEIGHT_PARTS)
    return 8.0 * nbytes / numel


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I64": 8}.get(dtype, 1)


def _windows(model: Path, heldout: Path, windows: int) -> Any:
    from qckpt.evaluate.windows import make_windows, tokenizer_of
    from qckpt.layouts.source_layout import read_json_if_any

    cfg = read_json_if_any(model / "config.json") or {}
    return make_windows(
        heldout, vocab_size=int(cfg["vocab_size"]), tokenizer=tokenizer_of(model), windows=windows
    )


def transformers_bpb(path: Path, win: Any, device: str) -> float | str:
    """Bits per byte of ``path`` loaded by transformers (its own quantizer), or why not."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    if (path / "hf_quant_config.json").is_file():
        return "n/a: no ModelOpt quantizer in transformers"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device)
        nll = 0.0
        with torch.no_grad():
            for i in range(0, win.ids.shape[0], 16):
                b = win.ids[i : i + 16].to(device)
                logits = model(b[:, :-1]).logits.float()
                nll += float(
                    F.cross_entropy(logits.flatten(0, 1), b[:, 1:].reshape(-1), reduction="sum")
                )
    except Exception as exc:
        # a package this machine lacks (an ImportError, or transformers' own "X is required
        # for" message) is not measured; a loader that refuses the dir is a result
        if isinstance(exc, ImportError) or "is required for" in str(exc):
            return not_measured(exc)
        return "fails: " + " ".join(str(exc).split())[:120]
    return nll / math.log(2) / sum(win.nbytes)


def not_measured(exc: BaseException) -> str:
    """The cell for a client that needs a package this machine lacks, naming the package."""
    text = " ".join(str(exc).split())
    m = re.search(r"(\S+) is required for", text) or re.search(r"No module named '([^']+)'", text)
    return f"not measured ({m.group(1)} not installed)" if m else f"not measured: {text[:80]}"


def failure_line(log: str) -> str:
    """The line of a worker's log that says why it failed: its last exception line (vLLM ends
    with shutdown warnings after it), else its last line."""
    lines = [ln.strip() for ln in log.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errs or lines or ["no output"])[-1][:160]


def vllm_runs(dirs: dict[str, Path], win: Any, k: int, parallel: int) -> dict[str, Any]:
    """Each dir served by vLLM (:mod:`qckpt.evaluate.vllm_worker`), up to ``parallel`` at once."""
    import torch

    from qckpt.evaluate.vllm_client import worker_env

    tmp = Path(tempfile.mkdtemp(prefix="qckpt-quality-vllm-"))
    wpath = tmp / "windows.pt"
    torch.save(win.ids, wpath)
    util = f"{0.85 / parallel:.3f}"

    def one(item: tuple[str, Path]) -> tuple[str, Any]:
        name, d = item
        out = tmp / f"{_slug(name)}.pt"
        env_cmd = [sys.executable, "-m", "qckpt.evaluate.vllm_worker", str(d), str(wpath)]
        r = subprocess.run(
            [*env_cmd, str(out), str(k), util],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=worker_env(),
        )
        if r.returncode or not out.is_file():
            return name, "fails: " + failure_line(r.stderr or r.stdout)
        return name, torch.load(out, weights_only=True)

    with vllm_lock(), ThreadPoolExecutor(parallel) as pool:
        return dict(pool.map(one, dirs.items()))


@contextlib.contextmanager
def vllm_lock() -> Iterator[None]:
    """Held while this process's vLLM engines run, where ``QCKPT_VLLM_LOCK`` names a file: the
    GPU round runs ``tests/gpu`` beside the bench on one GPU, and engines that start while
    another process's engines hold most of the memory fail their memory profile
    (tests/gpu/vllm/conftest.py holds it around each of its tests)."""
    path = os.environ.get("QCKPT_VLLM_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def inputs_alone(name: str, d: Path, model: Path, heldout: Path, opts: Any, cache: dict) -> Any:
    """The export's inputs on the source's weights (``--weights unquantized``); not for awq,
    whose input scales were calibrated on the smoothed model, not on the source's inputs."""
    from qckpt.evaluate.run import evaluate

    if name.endswith(f"{ALGORITHM_SEP}awq"):
        return "n/a (awq: its input scales are the smoothed model's)"
    rep = evaluate(d, model, heldout, replace(opts, weights="unquantized"), cache=cache)
    return rep["export_bits_per_byte"]


def measure_model(
    label: str, model: Path, exports: dict[str, Path], args: argparse.Namespace
) -> list[dict[str, Any]]:
    import torch

    from qckpt import EvalOptions
    from qckpt.evaluate.run import evaluate  # evaluate_export's body: it takes the source cache
    from qckpt.evaluate.vllm_client import figures, vllm_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    win = _windows(model, args.heldout, args.windows)
    opts = EvalOptions(windows=args.windows, device=device)
    cache: dict = {}
    rows: list[dict[str, Any]] = [{"export": "BF16 source", "dir": str(model), "bpw": 16.0}]
    for name, d in exports.items():
        rep = evaluate(d, model, args.heldout, opts, cache=cache)
        rows[0]["qckpt"] = rep["source_bits_per_byte"]
        row = {
            "export": name,
            "dir": str(d),
            "qckpt": rep["export_bits_per_byte"],
            "kl": rep["kl_mean"],
            "top1": rep["top1_agreement"],
            "moved": rep["layers_moved_most"],
            "warnings": rep["warnings"],
            "bpw": bits_per_weight(d, model),
        }
        w_only = evaluate(d, model, args.heldout, replace(opts, inputs="unquantized"), cache=cache)
        row["qckpt_weights"] = w_only["export_bits_per_byte"]
        # what vLLM computes on an H100 / H200 (NVFP4 weight-only, FP8 inputs as exported): the
        # figure its column is to match, for a mixed export too
        hop = evaluate(d, model, args.heldout, replace(opts, inputs="hopper"), cache=cache)
        row["qckpt_hopper"] = hop["export_bits_per_byte"]
        row["qckpt_inputs"] = inputs_alone(name, d, model, args.heldout, opts, cache)
        sch = rep["scheme"]
        if sch["fused_fp8_requantized"] or sch["fused_nvfp4_global_scale_replaced"]:
            stored = evaluate(d, model, args.heldout, replace(opts, fused="as-stored"), cache=cache)
            row["qckpt_as_stored"] = stored["export_bits_per_byte"]
        rows.append(row)
        print(f"[{label}] {name}: qckpt eval {rep['export_bits_per_byte']:.4f}", flush=True)
    for row in rows:
        row["transformers"] = (
            "not measured"
            if args.no_transformers
            else transformers_bpb(Path(row["dir"]), win, device)
        )
        print(f"[{label}] {row['export']}: transformers {row['transformers']}", flush=True)
    if args.no_vllm or not vllm_available():
        note = (
            "not measured (no vLLM importable here: QCKPT_VLLM_SITE names a vLLM site dir)"
            if not args.no_vllm
            else "not measured"
        )
        for row in rows:
            row["vllm"] = note
        return rows
    served = vllm_runs(
        {r["export"]: Path(r["dir"]) for r in rows}, win, args.top_k, args.vllm_parallel
    )
    src = served["BF16 source"]
    for row in rows:
        got = served[row["export"]]
        if isinstance(got, str) or isinstance(src, str):
            row["vllm"] = got if isinstance(got, str) else "source not served"
            continue
        fig = figures(src, got, win.ids, sum(win.nbytes), "byte", args.top_k)
        row["vllm"] = fig["export_bits_per_byte"]
        if row["export"] == "BF16 source":
            row["vllm"] = fig["source_bits_per_byte"]
        else:
            row["vllm_kl_topk"], row["vllm_top1"] = fig["kl_mean"], fig["top1_agreement"]
        print(f"[{label}] {row['export']}: vLLM {row['vllm']}", flush=True)
    return rows


def _cell(v: Any, base: Any) -> str:
    if not isinstance(v, float):
        return str(v) if v is not None else ""
    if isinstance(base, float) and base > 0:
        return f"{v:.4f} ({(v / base - 1) * 100:+.2f} %)"
    return f"{v:.4f}"


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    out = [
        "| export | bits per weight | qckpt eval | KL (qckpt eval) | top-1 (qckpt eval) | qckpt eval, weights alone "
        "(`--inputs unquantized`) | qckpt eval, as Hopper runs it (`--inputs hopper`) "
        "| qckpt eval, inputs alone (`--weights unquantized`) "
        "| qckpt eval, fused shards as stored | transformers | vLLM |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        kl = f"{r['kl']:.5f}" if isinstance(r.get("kl"), float) else "-"
        top1 = f"{r['top1'] * 100:.2f} %" if isinstance(r.get("top1"), float) else "-"
        first = r is base
        cells = [
            f"{r['bpw']:.2f}" if isinstance(r.get("bpw"), float) else "-",
            _cell(r.get("qckpt"), None if first else base.get("qckpt")),
            kl,
            top1,
            _cell(r.get("qckpt_weights"), base.get("qckpt")) if not first else "-",
            _cell(r.get("qckpt_hopper"), base.get("qckpt")) if not first else "-",
            _cell(r.get("qckpt_inputs"), base.get("qckpt")) if not first else "-",
            _cell(r.get("qckpt_as_stored"), None if first else base.get("qckpt"))
            if "qckpt_as_stored" in r
            else ("-" if first else "same"),
            _cell(r.get("transformers"), None if first else base.get("transformers")),
            _cell(r.get("vllm"), None if first else base.get("vllm")),
        ]
        out.append(f"| {r['export']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (CUDA)"
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({cpu})"


def update_doc(doc: Path, label: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    where = "gpu" if "CUDA" in machine() else "cpu"
    start, end = f"<!-- quality:{label}:{where}:start -->", f"<!-- quality:{label}:{where}:end -->"
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    block = "\n".join(
        [
            start,
            f"### {label} on {machine()}",
            "",
            f"{when}; `python -m bench.quality {' '.join(args.argv)}`; held-out bits per byte "
            f"({args.windows} windows of 513 bytes of `heldout.bin`, seed 7), relative to the BF16 "
            "source of the same column.",
            "",
            table(rows),
            end,
        ]
    )
    text = doc.read_text() if doc.is_file() else "# Quality\n\n"
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--calib", type=Path, default=QUALITY / "calib.bin")
    ap.add_argument("--heldout", type=Path, default=QUALITY / "heldout.bin")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qckpt-quality"))
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "QUALITY.md")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers column")
    ap.add_argument("--vllm-parallel", type=int, default=1)
    ap.add_argument(
        "--algorithms",
        default="",
        help="instead of the layouts: NVFP4 W4A4 calibrated with each of these (comma-separated: "
        + ", ".join(ALGORITHMS)
        + "), in a table of its own",
    )
    ap.add_argument(
        "--algorithms-on",
        default="nvfp4",
        help="with --algorithms: the variants calibrated with each (comma-separated: "
        + ", ".join(ALGORITHM_BASES)
        + ")",
    )
    ap.add_argument(
        "--mixes",
        action="store_true",
        help="instead of the layouts: the mixed-scheme exports beside all-FP8 and all-NVFP4",
    )
    ap.add_argument("--reuse", action="store_true", help="keep exports already in --work")
    args = ap.parse_args(argv)
    args.argv = argv
    args.model = args.model or [f"llama={QUALITY / 'models' / 'llama-textlm'}"]
    return args


def _pairs(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not name or not Path(path).is_dir():
            raise SystemExit(f"{flag} {it}: expected NAME=DIR with an existing DIR")
        out[name] = Path(path)
    return out


def _same_model(a: Path, b: Path) -> bool:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    return all(ca.get(k) == cb.get(k) for k in keys)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    models, extras = _pairs(args.model, "--model"), _pairs(args.extra, "--extra")
    report = {}
    on = [b for b in args.algorithms_on.split(",") if b]
    names = variant_names([a for a in args.algorithms.split(",") if a], on, args.mixes)
    for label, model in models.items():
        if args.mixes:
            label = f"{label}, mixed schemes"
        if args.algorithms:
            label = f"{label}, calibrate.algorithm"
        # the work dir of a model's algorithm runs whatever --algorithms-on says (--reuse)
        work = args.work / _slug(label)
        if args.algorithms and on != ["nvfp4"]:
            label = f"{label} ({', '.join(on)})"
        exports = make_exports(model, work, args.calib, args.heldout, args.reuse, names)
        exports |= {n: d for n, d in extras.items() if _same_model(model, d)}
        rows = measure_model(label, model, exports, args)
        update_doc(args.doc, label, rows, args)
        report[label] = rows
        print(table(rows), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "models": report}, indent=2, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
