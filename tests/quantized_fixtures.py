"""Quantized source dirs made from qckpt's tiny models, for the quantized-source tests.

* ``blockwise_fp8``: a DeepSeek-V3-style dir (``weight`` float8_e4m3fn + float32
  ``weight_scale_inv`` per block, ``quantization_config: {quant_method: fp8, weight_block_size}``),
  quantized here with ``qckpt.formats`` (``fp8_block``, the same per-tile rule as DeepSeek's
  ``act_quant``); any block size, partial edge blocks included.
* ``compressed_tensors``: written by compressed-tensors' own compressors (FP8 per-channel and
  per-block ``float-quantized``, ``nvfp4-pack-quantized``), scales computed here as
  llm-compressor's observers would (amax / qmax; NVFP4: global 448*6/amax, E4M3 per 16).
* qckpt's own exports (compressed-tensors per-tensor FP8, ModelOpt FP8 and NVFP4) come from
  ``tests.export_fixtures.run_export``.

As a script it writes the three kinds of dirs for a look: ``python -m tests.quantized_fixtures OUT``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qckpt.formats import quantize

# the linears a quantized release quantizes (routers, embeddings, norms and lm_head stay BF16)
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_MAX = 448.0


def bf16_dir(root: Path, source: str = "tiny-moe", seed: int = 0) -> Path:
    """The tiny model saved by transformers (BF16, per-expert names)."""
    from qckpt.models.build import build_model

    out = root / f"{source}-bf16"
    if not out.exists():
        build_model(source, dtype="bfloat16", seed=seed).save_pretrained(out)
    return out


def _tensors(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def blockwise_fp8(src: Path, out: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """A DeepSeek-V3-style blockwise FP8 dir of the BF16 dir ``src``."""
    tensors: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if QUANTIZED.search(k):
            q = quantize(t, "fp8_block", block_size=block)
            tensors[k] = q.qdata
            tensors[f"{k}_scale_inv"] = q.scale.to(torch.float32)
        else:
            tensors[k] = t
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    return _write(src, out, tensors, qc)


def _amax_blocks(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    r, c = w.shape
    rb, cb = math.ceil(r / b0), math.ceil(c / b1)
    wp = torch.nn.functional.pad(w.float().abs(), (0, cb * b1 - c, 0, rb * b0 - r))
    return wp.reshape(rb, b0, cb, b1).amax((1, 3))


def ct_args(kind: str, block: tuple[int, int]) -> dict:
    base = {"symmetric": True, "dynamic": False, "group_size": None, "block_structure": None}
    if kind == "nvfp4":
        return {
            **base,
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
        }
    args = {**base, "num_bits": 8, "type": "float", "strategy": kind}
    if kind == "block":
        args["block_structure"] = list(block)
    return args


def _ct_module(w: torch.Tensor, kind: str, block: tuple[int, int], scheme) -> dict:
    """One linear compressed by compressed-tensors' own compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    if kind == "nvfp4":
        amax = w.float().abs().amax().clamp_min(1e-12)
        gs = (FP8_MAX * 6.0 / amax).reshape(1)
        groups = _amax_blocks(w, 1, 16)
        sb = (gs * groups / 6.0).clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn).float()
        sd = {"weight": w, "weight_scale": sb, "weight_global_scale": gs}
        return dict(NVFP4PackedCompressor.compress(sd, scheme))
    if kind == "channel":
        scale = (w.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX).to(w.dtype)
    else:
        scale = (_amax_blocks(w, *block).clamp_min(1e-12) / FP8_MAX).to(w.dtype)
    return dict(FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme))


def compressed_tensors(
    src: Path, out: Path, kind: str = "channel", block: tuple[int, int] = (32, 32)
) -> Path:
    """A compressed-tensors dir (``kind``: channel | block | nvfp4), written by its compressors."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    wargs = ct_args(kind, block)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**wargs),
        input_activations=QuantizationArgs(
            num_bits=wargs["num_bits"], type="float", strategy="token", dynamic=True
        ),
    )
    tensors: dict[str, torch.Tensor] = {}
    for k, t in _tensors(src).items():
        if not QUANTIZED.search(k):
            tensors[k] = t
            continue
        mod = k[: -len(".weight")]
        for leaf, v in _ct_module(t, kind, block, scheme).items():
            tensors[f"{mod}.{leaf}"] = v
    fmt = "nvfp4-pack-quantized" if kind == "nvfp4" else "float-quantized"
    inputs = {"num_bits": wargs["num_bits"], "type": "float", "strategy": "token", "dynamic": True}
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": wargs,
                "input_activations": inputs,
                "format": fmt,
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    return _write(src, out, tensors, qc)


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "runs/quantized-sources")
    src = bf16_dir(root)
    for block in ((32, 32), (24, 40)):
        print(blockwise_fp8(src, root / f"fp8-blockwise-{block[0]}x{block[1]}", block))
    for kind in ("channel", "block", "nvfp4"):
        print(compressed_tensors(src, root / f"ct-{kind}", kind))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
