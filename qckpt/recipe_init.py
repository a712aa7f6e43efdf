"""The recipe ``qckpt init`` writes: its values (:func:`recipe_dict`) and the same values as
commented YAML (:func:`render_recipe`), so a person reads why each one is what it is."""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any

from qckpt.errors import UsageError
from qckpt.models.arch import Architecture
from qckpt.plan.layouts import Layout
from qckpt.report import human_bytes

SEQ_LEN = 512
NUM_SAMPLES = 64
BATCH = 4


@dataclass
class InitChoices:
    model_dir: str
    name: str
    fmt: str  # fp8 | nvfp4: the one-scheme spelling (--format), or a preset's name
    gpus: int
    layout: Layout


# FP8 block-wise weights (128x128) with dynamic per-token FP8 inputs in groups of 128: what
# DeepSeek's and ModelOpt's mixed exports give the layers that stay at 8 bits
FP8_BLOCK = (
    {"format": "fp8", "granularity": "block", "block_size": [128, 128]},
    {"format": "fp8", "granularity": "block", "block_size": [1, 128], "dynamic": True},
)
NVFP4 = (
    {"format": "nvfp4", "granularity": "tensor"},
    {"format": "nvfp4", "granularity": "tensor", "dynamic": False},
)
MIXED_PRESETS = ("nvfp4-experts", "nvfp4-mlp")  # quant.schemes; the others are --format's
# --preset NAME -> what it writes (the one-scheme presets are --format's recipes)
PRESETS = {
    "fp8": "FP8 E4M3, one scale per tensor, static inputs: vLLM's fp8 W8A8",
    "nvfp4": "NVFP4 (E2M1, an E4M3 scale per 16 values): compressed-tensors nvfp4-pack",
    "nvfp4-experts": "NVFP4 routed experts (weights and inputs); FP8 block 128x128 weights with "
    "dynamic 1x128 inputs for attention, shared experts and the rest (MoE only)",
    "nvfp4-mlp": "NVFP4 MLP (experts and shared experts of an MoE); FP8 block 128x128 weights "
    "with dynamic 1x128 inputs for attention and the rest",
}
# the checkpoint's name of a layer's MLP, where it is not "mlp"
_MLP_GLOB = {"mixtral": "*.block_sparse_moe.*"}


def preset_schemes(arch: Architecture, preset: str) -> list[dict[str, Any]]:
    """``quant.schemes`` of a mixed preset for ``arch`` (first match wins: the 4-bit part,
    then FP8 block for every other linear; ``ignore`` keeps lm_head and routers in BF16)."""
    if preset == "nvfp4-experts":
        if not arch.moe:
            raise UsageError(
                f"--preset nvfp4-experts: {arch.model_type} is dense (no routed experts); "
                "--preset nvfp4-mlp is its mix (NVFP4 MLP + FP8 attention)"
            )
        four = ["*.experts.*"]  # per-expert names; shared_experts.* and shared_expert.* differ
    else:
        four = [_MLP_GLOB.get(arch.model_type, "*.mlp.*")]
    return [
        {"targets": four, "weights": dict(NVFP4[0]), "inputs": dict(NVFP4[1])},
        {"targets": ["*"], "weights": dict(FP8_BLOCK[0]), "inputs": dict(FP8_BLOCK[1])},
    ]


def _quant(arch: Architecture, c: InitChoices) -> dict[str, Any]:
    if c.fmt in MIXED_PRESETS:
        return {"schemes": preset_schemes(arch, c.fmt), "ignore": list(arch.ignore)}
    q = {"format": c.fmt, "granularity": "tensor"}
    return {"weights": dict(q), "inputs": {**q, "dynamic": False}, "ignore": list(arch.ignore)}


def _seq_len(arch: Architecture) -> int:
    return min(SEQ_LEN, int(arch.max_positions or SEQ_LEN))


def recipe_dict(arch: Architecture, c: InitChoices) -> dict[str, Any]:
    run = f"runs/{c.name}"
    cal: dict[str, Any] = {
        "data": {
            "source": "synthetic",
            "num_samples": NUM_SAMPLES,
            "seq_len": _seq_len(arch),
            "batch_size": BATCH,
        },  # fmt: skip
        "output": f"{run}/calib.safetensors",
    }
    lay = c.layout
    if lay.quantized_resident:
        cal["weights_resident"] = lay.resident
    if lay.offloaded:
        cal["offload"] = lay.offload
    if lay.activations != "device":
        cal["activations"] = lay.activations
    return {
        "model": {"source": c.model_dir, "dtype": "bfloat16"},
        "checkpoint": {"path": c.model_dir if arch.has_weights else f"{run}/bf16"},
        "load": {"params": "fp8"},
        "quant": _quant(arch, c),
        "calibrate": cal,
        "parallel": {"ep": lay.ep, "tp": lay.tp},
        "export": {"format": "compressed-tensors", "output": f"{run}/{c.fmt}"},
    }


def _flow(v: Any) -> str:
    """A YAML flow value (JSON is YAML; strings quoted where YAML could misread them)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str | list) else str(v)


def _layout_comment(
    c: InitChoices, peaks: dict[str, int], memory: str, misfits: list[str]
) -> list[str]:
    dp = c.layout.dp(c.gpus)
    figures = ", ".join(f"{cmd} {human_bytes(b)}" for cmd, b in peaks.items())
    warn = [f"# warning: {', '.join(misfits)} does not fit this layout (qckpt plan)"]
    return (warn if misfits else []) + [
        f"# {c.gpus} GPU(s) of {memory}:",
        f"# dp={dp} x ep={c.layout.ep} x tp={c.layout.tp} is the smallest layout `qckpt plan`",
        f"# found that fits; predicted peak per GPU: {figures}.",
        "# Only load and calibrate use ep/tp; export splits its work over whatever ranks it",
        f"# has. Check: qckpt plan THIS.yaml --nproc-per-node {c.gpus} --gpu-memory SIZE",
    ]


def _data_comment(arch: Architecture) -> list[str]:
    out = ["# synthetic tokens calibrate anything; real text calibrates better. Your own data:"]
    out.append("#   data: {source: dataset, path: my.jsonl, num_samples: 512, seq_len: 2048,")
    out.append("#          shuffle_seed: 0}   # JSONL/Parquet/Arrow or a save_to_disk dir;")
    if arch.chat_template:
        out.append("#   a 'messages' column is rendered with this model's chat template")
    else:
        out.append("#   a 'text' column ('messages' needs a chat template, this model has none)")
    return out


def _quant_lines(q: dict[str, Any], note: str) -> list[str]:
    if "schemes" not in q:
        return [
            f"  # {note}",
            f"  weights: {_flow(q['weights'])}",
            f"  inputs: {_flow(q['inputs'])}",
        ]
    out = ["  # " + ln for ln in textwrap.wrap(note + ".", 92)]
    out.append("  # First match wins; a linear no entry matches stays in BF16.")
    out.append("  schemes:")
    for s in q["schemes"]:
        out.append(f"    - targets: {_flow(s['targets'])}")
        out.append(f"      weights: {_flow(s['weights'])}")
        out.append(f"      inputs: {_flow(s['inputs'])}")
    return out


def render_recipe(
    arch: Architecture,
    c: InitChoices,
    peaks: dict[str, int],
    memory: str,
    misfits: list[str] | None = None,
) -> str:
    d = recipe_dict(arch, c)
    ckpt = (
        "# the model dir's own safetensors"
        if arch.has_weights
        else "# no weights in the model dir: convert or copy a checkpoint here first"
    )
    why_ignore = "lm_head" + (", the routers" if arch.moe else "")
    if len(arch.ignore) > len(["lm_head"]) + (1 if arch.moe else 0):
        why_ignore += f" and what {arch.model_type} needs"
    lines = [
        f"# qckpt recipe for {c.model_dir}, written by `qckpt init`.",
        f"# {arch.describe()}",
        "#",
        "# qckpt calibrate THIS.yaml --nproc-per-node N   then   qckpt export THIS.yaml",
        "model:",
        f"  source: {_flow(d['model']['source'])}",
        "  dtype: bfloat16",
        "checkpoint:",
        f"  path: {_flow(d['checkpoint']['path'])}   {ckpt}",
        "load:",
        "  params: fp8   # the format `qckpt load` holds parameters in (training-side choice)",
        "quant:",
        *_quant_lines(d["quant"], PRESETS[c.fmt]),
        f"  # left in BF16, as serving stacks expect: {why_ignore}",
        f"  ignore: {_flow(d['quant']['ignore'])}",
        "calibrate:",
        *("  " + ln for ln in _data_comment(arch)),
        f"  data: {_flow(d['calibrate']['data'])}",
        *(f"  {k}: {_flow(v)}" for k, v in d["calibrate"].items() if k not in ("data", "output")),
        f"  output: {_flow(d['calibrate']['output'])}",
        "parallel:",
        *("  " + ln for ln in _layout_comment(c, peaks, memory, misfits or [])),
        f"  ep: {d['parallel']['ep']}",
        f"  tp: {d['parallel']['tp']}",
        "export:",
        "  format: compressed-tensors   # or modelopt (hf_quant_config.json)",
        f"  output: {_flow(d['export']['output'])}",
    ]
    return "\n".join(lines) + "\n"
