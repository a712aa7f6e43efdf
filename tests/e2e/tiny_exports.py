"""The tiny Llama exported one scheme at a time, as the format tests (INT4, INT8, MX) run it:
a recipe per export, one BF16 checkpoint (DCP and HF) for all of a module's exports, the real
commands in this process, and the exported tensors read back."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from tests._inproc import run_main


def tiny_recipe(root: Path, name: str, weights: dict, inputs: dict, **over) -> Path:
    """``root/name.yaml``: the tiny Llama (its DCP under ``root/dcp``) quantized with
    ``weights`` / ``inputs``, calibrated into and exported under ``root/name``; ``over``:
    extra ``calibrate`` / ``export`` keys."""
    run = root / name
    recipe = {
        "model": {"source": "tiny-dense", "dtype": "bfloat16", "seed": 0},
        "checkpoint": {"path": str(root / "dcp")},
        "quant": {"weights": weights, "inputs": inputs, "ignore": ["lm_head"]},
        "calibrate": {
            "data": {"source": "synthetic", "num_samples": 8, "seq_len": 32, "batch_size": 4},
            "output": str(run / "calib.safetensors"),
            **over.get("calibrate", {}),
        },
        "export": {
            "format": "compressed-tensors",
            "output": str(run / "out"),
            **over.get("export", {}),
        },
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def tiny_root(root: Path, heldout_seed: int | None = None) -> Path:
    """``root`` with the tiny Llama converted to DCP (``dcp``) and to an HF dir (``hf``), and
    with ``heldout_seed``, 8 KiB of random held-out bytes (``heldout.bin``)."""
    rec = tiny_recipe(root, "base", {"format": "fp8"}, {"format": "fp8"})
    assert run_main("convert", str(rec), str(root / "dcp")).returncode == 0
    r = run_main("convert", str(root / "dcp"), str(root / "hf"), "--to", "hf")
    assert r.returncode == 0, r.stderr
    if heldout_seed is not None:
        g = torch.Generator().manual_seed(heldout_seed)
        data = torch.randint(0, 256, (8192,), generator=g).tolist()
        (root / "heldout.bin").write_bytes(bytes(data))
    return root


def export_once(root: Path, name: str, weights: dict, inputs: dict, **over) -> Path:
    """The export of :func:`tiny_recipe` ``name`` (calibrated and exported on first use)."""
    rec = tiny_recipe(root, name, weights, inputs, **over)
    out = root / name / "out"
    if not out.exists():
        for cmd in ("calibrate", "export"):
            r = run_main(cmd, str(rec))
            assert r.returncode == 0, r.stderr[-2000:]
    return out


def tensors_of(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dir's safetensors files, or of one file (the GPTQ sidecar)."""
    out = {}
    for f in [d] if d.is_file() else sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118
    return out


def modules_with(t: dict, leaf: str) -> list[str]:
    """The modules of ``t`` that hold a tensor named ``leaf``, sorted."""
    return sorted(k[: -len(leaf) - 1] for k in t if k.endswith("." + leaf))
