"""``qckpt eval``: an export's quality on held-out data, computed as a serving stack computes it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from qckpt import phases
from qckpt.cli import output
from qckpt.cli._options import JsonOpt, SetOpt
from qckpt.errors import UsageError
from qckpt.summary import finish

TargetArg = Annotated[
    Path,
    typer.Argument(
        metavar="RECIPE|EXPORT_DIR",
        help="A recipe (its export.output, checkpoint and eval: section) or an export dir.",
        show_default=False,
    ),
]

OffloadOpt = Annotated[
    str | None,
    typer.Option(help="none (both models resident) | layer (one decoder layer at a time)."),
]
FusedOpt = Annotated[
    str | None,
    typer.Option(
        help="vllm (one scale per fused q/k/v, gate/up weight, as vLLM loads it) | as-stored."
    ),
]
InputsOpt = Annotated[
    str | None,
    typer.Option(
        help="as-exported (inputs quantized as the export says) | unquantized (the weights "
        "alone: a weight-only kernel) | hopper (as an H100 / H200 client runs it: NVFP4 "
        "linears weight-only, as vLLM's Marlin; FP8 inputs quantized as exported)."
    ),
]

FailAboveOpt = Annotated[
    float | None,
    typer.Option(metavar="PCT", help="Exit 1 when the export is more than PCT % worse."),
]
WeightsOpt = Annotated[
    str | None,
    typer.Option(
        help="as-exported (dequantized from the export) | unquantized (the source's weights with "
        "the export's input quantization: what the inputs alone cost)."
    ),
]


def _has_weights(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*.safetensors"))


def _from_recipe(target: Path, set_: list[str] | None) -> tuple[Path, Path, Any]:
    from qckpt.recipe import load_recipe

    r = load_recipe(target, set_ or [])
    ckpt, model = Path(r.checkpoint.path).expanduser(), Path(r.model.source).expanduser()
    source = ckpt if _has_weights(ckpt) else model if _has_weights(model) else None
    if source is None:
        raise UsageError(
            f"checkpoint.path: {ckpt} is not an HF safetensors dir (nor is model.source); "
            "qckpt eval reads the source from one: write it with `qckpt convert DCP_DIR OUT "
            "--to hf`, then `qckpt eval EXPORT_DIR --source OUT --data FILE`"
        )
    if not r.eval.path:
        raise UsageError("eval.path: required by qckpt eval (the held-out data file)")
    return Path(r.export.output).expanduser(), source, r.eval


def _measured(options: dict[str, Any]) -> str:
    """What the export figure leaves out, when it does (``--inputs`` / ``--weights``)."""
    off = [k for k in ("weights", "inputs") if options.get(k, "as-exported") == "unquantized"]
    hopper = " as a Hopper client runs it" if options.get("inputs") == "hopper" else ""
    return (f" ({' and '.join(off)} unquantized)" if off else "") + hopper


def _summary(rep: dict[str, Any]) -> list[str]:
    unit = rep["unit"]
    src, exp = rep[f"source_bits_per_{unit}"], rep[f"export_bits_per_{unit}"]
    lines = [
        f"source  {src:.4f} bits/{unit}  (perplexity {rep['source_perplexity']:.4f})",
        f"export  {exp:.4f} bits/{unit}  (perplexity {rep['export_perplexity']:.4f}), "
        f"{rep['relative_increase'] * 100:+.2f} %{_measured(rep.get('options') or {})}",
    ]
    if rep.get("kl_mean") is not None:
        lines.append(
            f"KL(source || export) {rep['kl_mean']:.5f} nats/token (max {rep['kl_max']:.3f}), "
            f"top-1 agreement {rep['top1_agreement'] * 100:.2f} %"
            + (f" ({rep['kl_note']})" if rep.get("kl_note") else "")
        )
    moved = rep.get("layers_moved_most") or []
    if moved:
        lines.append(
            "layers moved most (relative L2 of their outputs): "
            + ", ".join(f"{m['layer']} {m['rel_l2'] * 100:.2f} %" for m in moved)
        )
    return lines


def eval_cmd(
    target: TargetArg,
    source: Annotated[
        Path | None,
        typer.Option("--source", metavar="MODEL_DIR", help="The BF16 model dir (with EXPORT_DIR)."),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            metavar="FILE",
            help="Held-out data: text/bytes, or token ids (.npy/.pt). With a recipe: eval.path.",
        ),
    ] = None,
    windows: Annotated[int | None, typer.Option(min=1, help="Windows (default 64).")] = None,
    seq_len: Annotated[
        int | None, typer.Option(min=1, help="Tokens read per window (512).")
    ] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Window draw seed (7).")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Windows per forward (16).")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda.")] = None,
    offload: OffloadOpt = None,
    fused: FusedOpt = None,
    inputs: InputsOpt = None,
    weights: WeightsOpt = None,
    client: Annotated[
        str, typer.Option(help="qckpt (emulated here) | vllm (served by vLLM, when installed).")
    ] = "qckpt",
    top_k: Annotated[int, typer.Option(min=1, help="vllm: prompt log-probabilities kept.")] = 20,
    fail_above: FailAboveOpt = None,
    set_: SetOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Bits per byte (perplexity) of the source and of the export on held-out data, the mean
    per-token KL(source || export), top-1 agreement, and the decoder layers whose outputs moved
    most. The export is computed from its own files as a serving stack computes it: weights
    dequantized from codes and scales, inputs quantized as its config says (FP8 static,
    dynamic per-token or per-group, NVFP4 per-16 blocks), FP8 KV-cache scales applied.

    Examples:

        qckpt eval runs/llama/fp8 --source models/llama --data heldout.bin

        qckpt eval recipe.yaml --json eval.json

        qckpt eval runs/llama/fp8 --source models/llama --data heldout.bin --client vllm

        qckpt eval runs/llama/nvfp4 --source models/llama --data heldout.bin --inputs unquantized

        qckpt eval runs/llama/nvfp4 --source models/llama --data heldout.bin --weights unquantized
    """
    opts, export_dir, source_dir, data_path = _resolve(target, source, data, set_)
    opts = _override(
        opts,
        windows=windows,
        seq_len=seq_len,
        seed=seed,
        batch_size=batch_size,
        device=device,
        offload=offload,
        fused=fused,
        inputs=inputs,
        weights=weights,
    )
    _check_client(client, opts)
    _guard(json_path, export_dir, source_dir, data_path)
    rep = _evaluate(client, export_dir, source_dir, data_path, opts, top_k)
    with phases.phase(phases.REPORT):
        full = output.with_phases(rep)
        output.write_json(json_path, full)
    for line in _summary(rep):
        output.result(line)
    # the whole command's peak against its bound and its time, as every command ends
    for line in finish([], full, rep.get("warnings") or []):
        output.log(line)
    inc = rep.get("relative_increase")
    if fail_above is not None and inc is not None and inc * 100 > fail_above:
        raise typer.Exit(1)


def _check_client(client: str, opts: Any) -> None:
    if client not in ("qckpt", "vllm"):
        raise UsageError(f"--client: qckpt or vllm; got {client!r}")
    for key in ("inputs", "weights"):
        if client == "vllm" and getattr(opts, key) != "as-exported":
            raise UsageError(
                f"--{key} {getattr(opts, key)}: the qckpt client's; vLLM runs the export its own way"
            )


def _choices(key: str) -> tuple[str, ...] | None:
    """The values ``eval.<key>`` takes, read from the recipe's ``Literal`` (one list for both)."""
    import typing

    from qckpt.recipe import EvalConfig

    hint = typing.get_type_hints(EvalConfig).get(key)
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _override(opts: Any, **given: Any) -> Any:
    """The options with the flags the user gave (each checked) in place of the recipe's."""
    for key, value in given.items():
        if value is None:
            continue
        allowed = _choices(key)
        if allowed is not None and value not in allowed:
            raise UsageError(f"--{key}: {', '.join(allowed[:-1])} or {allowed[-1]}; got {value!r}")
        opts = replace(opts, **{key: value})
    return opts


def _resolve(
    target: Path, source: Path | None, data: Path | None, set_: list[str] | None
) -> tuple[Any, Path, Path, Path]:
    from qckpt.recipe import EvalConfig

    if target.is_file():
        export_dir, src, ev = _from_recipe(target, set_)
        source = source or src
        data = data or Path(ev.path).expanduser()
    elif target.is_dir():
        if set_:
            raise UsageError("--set: only with a RECIPE")
        if source is None or data is None:
            raise UsageError("EXPORT_DIR needs --source MODEL_DIR and --data FILE")
        export_dir, ev = target, EvalConfig()
    else:
        raise UsageError(f"{target}: not found (a recipe file or an export dir)")
    if not export_dir.is_dir():
        raise UsageError(f"{export_dir}: the export dir does not exist (run qckpt export first)")
    if not source.is_dir():
        raise UsageError(f"--source: {source} is not a directory")
    if not data.is_file():
        raise UsageError(f"--data: {data} is not a file")
    from qckpt.evaluate.options import options_from

    return options_from(ev), export_dir, source, data


def _guard(json_path: Path | None, export_dir: Path, source: Path, data: Path) -> None:
    from qckpt.outputs import guard

    ins = [("EXPORT_DIR", export_dir), ("--source", source), ("--data", data)]
    guard([("--json", json_path)], ins, file_outputs=["--json"])


def _evaluate(
    client: str, export_dir: Path, source: Path, data: Path, opts: Any, top_k: int
) -> dict[str, Any]:
    if client == "vllm":
        from qckpt.evaluate.vllm_client import evaluate_vllm

        return evaluate_vllm(export_dir, source, data, opts, top_k=top_k, log=output.log)
    with phases.phase(phases.STARTUP):
        from qckpt.term import quiet_torch_logs

        quiet_torch_logs()
        from qckpt.evaluate.run import evaluate
    with phases.phase(phases.FORWARD), output.progress("evaluating", opts.windows) as step:
        return evaluate(export_dir, source, data, opts, progress=step, log=output.log)
