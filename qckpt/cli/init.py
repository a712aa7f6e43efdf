"""``qckpt init``: a commented recipe for a model dir, whose layout ``qckpt plan`` accepts."""

from __future__ import annotations

import shutil
import subprocess
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from qckpt.cli import output as cli_output  # the command's --output option is "output"
from qckpt.errors import UsageError

DEFAULT_GPU_MEMORY = "80GiB"  # when no GPU answers here (the recipe says which was assumed)


class Fmt(str, Enum):
    fp8 = "fp8"
    nvfp4 = "nvfp4"


class Preset(str, Enum):
    """``qckpt.recipe_init.PRESETS``: the one-scheme ones are --format's recipes."""

    fp8 = "fp8"
    nvfp4 = "nvfp4"
    nvfp4_experts = "nvfp4-experts"
    nvfp4_mlp = "nvfp4-mlp"


def _gpu_memory_here() -> int | None:
    """The first GPU's memory from nvidia-smi (no torch); None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        return int(out.split()[0]) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _memory(text: str | None) -> tuple[int, str]:
    from qckpt.plan.layouts import parse_memory
    from qckpt.report import human_bytes

    if text is None:
        here = _gpu_memory_here()
        if here is not None:
            return here, f"{human_bytes(here)} (this machine's GPU)"
        text = DEFAULT_GPU_MEMORY
        note = f"{text} (assumed: no GPU here; --gpu-memory sets it)"
    else:
        note = text
    try:
        return parse_memory(text), note
    except ValueError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from None


_FormatOption = Annotated[
    Fmt | None,
    typer.Option("--format", help="One format for every linear (default fp8).", show_default=False),
]
_PresetOption = Annotated[
    Preset | None,
    typer.Option(
        "--preset",
        help="A common mix: nvfp4-experts (MoE: NVFP4 routed experts, FP8 block attention and "
        "shared experts), nvfp4-mlp (NVFP4 MLP, FP8 block attention), fp8, nvfp4.",
        show_default=False,
    ),
]


def init_cmd(
    model_dir: Annotated[
        Path, typer.Argument(help="An HF model dir (config.json, weights optional).")
    ],
    fmt: _FormatOption = None,
    preset: _PresetOption = None,
    gpus: Annotated[
        int, typer.Option("--gpus", min=1, metavar="N", help="GPUs to calibrate on.")
    ] = 1,
    gpu_memory: Annotated[
        str | None,
        typer.Option(
            "--gpu-memory",
            metavar="SIZE",
            help="Memory of one GPU (default: this machine's).",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="Where to write (default: NAME-FORMAT.yaml).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace PATH if it exists.")] = False,
) -> None:
    """Write a commented recipe for a model: its architecture (dense or MoE, experts fused or
    per expert), the ignore list serving stacks expect, a parallel layout that `qckpt plan`
    says fits the GPUs given, and calibration data defaults.

    Examples:

        qckpt init /models/Qwen3-30B-A3B --gpus 2 -o qwen3.yaml

        qckpt init /models/Llama-3.1-8B --format nvfp4 --gpu-memory 80GiB

        qckpt init /models/Qwen3-30B-A3B --preset nvfp4-experts --gpus 2
    """  # fmt: skip
    from qckpt.models.remote_code import refuse_custom_code

    if not (model_dir / "config.json").is_file():
        raise UsageError(f"MODEL_DIR: {model_dir}: no config.json there")
    refuse_custom_code(model_dir)
    if fmt is not None and preset is not None:
        raise UsageError("--format and --preset: give one (--preset fp8 is --format fp8)")
    what = (preset or fmt or Fmt.fp8).value
    out = output or Path(f"{model_dir.resolve().name}-{what}.yaml")
    if out.exists() and not force:
        raise UsageError(f"--output: {out} exists (--force replaces it)")
    gpu_bytes, note = _memory(gpu_memory)
    from qckpt.term import quiet_torch_logs

    quiet_torch_logs()
    from qckpt.atomic import write_text
    from qckpt.pipeline.init import make_recipe
    from qckpt.report import human_bytes

    res = make_recipe(str(model_dir), fmt=what, gpus=gpus, gpu_bytes=gpu_bytes, memory_note=note)
    write_text(out, res.text, key="--output")
    lay = res.layout
    peak = max(res.peaks.values())
    cli_output.summary([
        f"init: {res.arch.describe()}",
        f"  ignore {', '.join(res.arch.ignore)}",
        f"  layout dp={lay.dp(gpus)} ep={lay.ep} tp={lay.tp} on {gpus} GPU(s); predicted peak "
        f"{human_bytes(peak)} of {human_bytes(gpu_bytes)} per GPU",
    ])  # fmt: skip
    cli_output.result(f"wrote {out}")
