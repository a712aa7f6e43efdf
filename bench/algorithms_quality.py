"""Held-out bits per byte of the shared Llama's exports, per ``calibrate.algorithm`` (CPU).

    python -m bench.algorithms_quality [--algorithms max,mse,awq] [--configs nvfp4,fp8] \
        [--windows 64] [--json out.json]

For each config and algorithm: ``qckpt calibrate`` (library call, one process) on the first
128 x 512 bytes of ``../shared/quality/calib.bin`` (as token ids: token = byte), ``qckpt
export`` (compressed-tensors), the export dequantized (``convert --to hf``'s function, float32)
and evaluated in transformers (float32) on the README's held-out windows (``heldout.bin``, 64
windows of 513 bytes from ``torch.Generator().manual_seed(7)``): bits per byte with the
dequantized weights alone ("weights"), and with every quantized linear's input also fake
quantized as the export says ("W4A4" / "W8A8": NVFP4 per-16 blocks under the exported global
input scale; FP8 per tensor with the exported static scale). The BF16 model is measured the
same way; the figures are the increase over it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
QUALITY = ROOT.parent / "shared" / "quality"
MODEL = QUALITY / "models" / "llama-textlm"
CONFIGS = {
    "nvfp4": {"weights": {"format": "nvfp4"}, "inputs": {"format": "nvfp4"}},
    "fp8": {"weights": {"format": "fp8", "granularity": "tensor"}, "inputs": {"format": "fp8"}},
    "fp8_channel": {
        "weights": {"format": "fp8", "granularity": "channel"},
        "inputs": {"format": "fp8"},
    },
}


def heldout_windows(n: int = 64, size: int = 513) -> torch.Tensor:
    data = (QUALITY / "heldout.bin").read_bytes()
    starts = torch.randint(0, len(data) - size, (64,), generator=torch.Generator().manual_seed(7))
    rows = [list(data[s : s + size]) for s in starts[:n].tolist()]
    return torch.tensor(rows, dtype=torch.long)


def bits_per_byte(model, windows: torch.Tensor, batch: int = 8) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            w = windows[i : i + batch]
            logits = model(input_ids=w[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll)
            count += w[:, 1:].numel()
    return total / count / math.log(2)


def _calib_tokens(work: Path) -> Path:
    raw = (QUALITY / "calib.bin").read_bytes()[: 128 * 512]
    path = work / "calib_tokens.npy"
    np.save(path, np.frombuffer(raw, dtype=np.uint8).astype(np.int64).reshape(128, 512))
    return path


def _run(config: str, algorithm: str, work: Path, tokens: Path, model: Path = MODEL) -> Path:
    from qckpt import init_mesh, recipe_from_dict
    from qckpt.pipeline.calibrate import calibrate
    from qckpt.pipeline.export import export

    tag = f"{config}-{algorithm}"
    # gptq+mse: GPTQ with each NVFP4 group's scale searched (calibrate.gptq_block_scales: mse)
    # awq+pow2: AWQ with its scales rounded to powers of two (calibrate.awq_scales: pow2)
    extra = {"gptq+mse": {"gptq_block_scales": "mse"}, "awq+pow2": {"awq_scales": "pow2"}}
    extra = extra.get(algorithm, {})
    algorithm = algorithm.split("+")[0]
    recipe = recipe_from_dict(
        {
            "model": {"source": str(model)},
            "checkpoint": {"path": str(model), "format": "safetensors"},
            # MoE routers stay in BF16, as in bench.quality and the peers' recipes
            "quant": {**CONFIGS[config], "ignore": ["lm_head", "*.mlp.gate"]},
            "calibrate": {
                "data": {"source": "tokens", "path": str(tokens), "num_samples": 128,
                         "seq_len": 512, "batch_size": 8},
                "algorithm": algorithm,
                **extra,
                "output": str(work / f"{tag}.safetensors"),
            },
            "export": {"output": str(work / tag), "format": "compressed-tensors"},
        }
    )  # fmt: skip
    calibrate(recipe, init_mesh(device="cpu"))
    export(recipe, None)
    return work / tag


def _fake_inputs(model, export_dir: Path, config: str) -> list:
    """Pre-hooks fake-quantizing every quantized linear's input as the export says."""
    from safetensors import safe_open

    from qckpt import quantize

    scales = {}
    for f in export_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no iteration
                if k.endswith((".input_scale", ".input_global_scale")):
                    scales[k.rpartition(".")[0]] = (k.rpartition(".")[2], h.get_tensor(k))
    handles = []
    for name, mod in model.named_modules():
        if name not in scales:
            continue
        kind, s = scales[name]
        if kind == "input_global_scale":  # NVFP4: amax = 6 * 448 / global scale
            amax = float(6 * 448 / s.float().reshape(()))

            def hook(_m, args, amax=amax):
                x = args[0]
                q = quantize(x.reshape(-1, x.shape[-1]).float(), "nvfp4", amax=amax)
                return (q.dequantize(torch.float32).reshape(x.shape).to(x.dtype),)
        else:
            scale = float(s.float().reshape(()))

            def hook(_m, args, scale=scale):
                x = args[0]
                y = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                return ((y * scale).to(x.dtype),)

        handles.append(mod.register_forward_pre_hook(hook))
    return handles


def _measure(
    export_dir: Path, config: str, windows: torch.Tensor, work: Path, weights_only: bool = False
) -> dict:
    from transformers import AutoModelForCausalLM

    from qckpt.pipeline.convert import dequantize_hf  # qckpt convert --to hf's body

    deq = work / f"{export_dir.name}-deq"
    dequantize_hf(export_dir, deq, "float32")
    model = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    out = {"weights": bits_per_byte(model, windows)}
    if weights_only:
        return out
    handles = _fake_inputs(model, export_dir, config)
    out["W4A4" if config == "nvfp4" else "W8A8"] = bits_per_byte(model, windows)
    for h in handles:
        h.remove()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--algorithms", default="max,mse")
    p.add_argument("--configs", default="nvfp4,fp8")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--weights-only", action="store_true", help="no W4A4 / W8A8 evaluation")
    p.add_argument("--json")
    p.add_argument(
        "--keep",
        type=Path,
        help="copy each export here as CONFIG-ALGORITHM (to serve it elsewhere)",
    )
    p.add_argument(
        "--model", type=Path, default=MODEL, help="an HF dir (default: the shared Llama)"
    )
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    windows = heldout_windows(args.windows)
    base = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    result = {"bf16": bits_per_byte(base, windows), "windows": args.windows, "runs": {}}
    print(f"BF16 weights (float32 compute): {result['bf16']:.4f} bits per byte")
    with tempfile.TemporaryDirectory(prefix="qckpt-algos-") as d:
        work = Path(d)
        tokens = _calib_tokens(work)
        for config in args.configs.split(","):
            for algo in args.algorithms.split(","):
                run = _run(config, algo, work, tokens, args.model)
                got = _measure(run, config, windows, work, args.weights_only)
                if args.keep:
                    shutil.copytree(run, args.keep / run.name, dirs_exist_ok=True)
                rel = {k: 100 * (v / result["bf16"] - 1) for k, v in got.items()}
                result["runs"][f"{config}/{algo}"] = {"bpb": got, "increase_pct": rel}
                line = ", ".join(f"{k} {v:.4f} (+{rel[k]:.3f} %)" for k, v in got.items())
                print(f"{config:12s} {algo:5s} {line}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
