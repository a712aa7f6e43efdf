"""The front door's own functions: thin wrappers where an internal signature is awkward for a
library user (``import qckpt``; the list of names is in ``qckpt/__init__.py``).

Each one calls the function the CLI's pipeline calls and adds nothing to what it computes: it
fills in a one-rank world when no mesh is given, accepts a model by name, directory, config or
module, and gathers the load's knobs into :class:`LoadOptions`. Everything heavy is imported
inside the functions, so that ``qckpt.LoadOptions`` costs no torch.

Where it sits: beside the CLI, over ``qckpt.pipeline`` (which holds the one order in which a
model becomes a rank's model) and the library packages; nothing inside ``qckpt`` imports it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qckpt.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from qckpt.calib.state_file import CalibrationState
    from qckpt.evaluate.options import EvalOptions
    from qckpt.export.plan import ExportPlan
    from qckpt.export.writer import ExportReport, WriteOptions
    from qckpt.load.loader import LoadReport
    from qckpt.parallel.mesh import Mesh
    from qckpt.read.source import CheckpointSource
    from qckpt.recipe import DataConfig, ExportConfig, QuantConfig

WEIGHTS = ("seeded", "empty")


def _one_rank(device: Any) -> Mesh:
    """The world of one process on ``device``: what ``init_mesh`` gives outside torchrun,
    without picking a device for the caller."""
    import torch

    from qckpt.parallel.mesh import Mesh

    return Mesh(device=torch.device(device))


def build_model(
    source: str,
    *,
    params: str = "none",
    weights: str = "seeded",
    dtype: str = "bfloat16",
    seed: int = 0,
    device: str | torch.device | None = None,
    mesh: Mesh | None = None,
    ignore: Collection[str] = (),
    backend: str = "native",
) -> nn.Module:
    """This rank's causal LM of ``source`` (a built-in name: ``tiny-dense``, ``tiny-moe``; or a
    local Hugging Face model dir), with ``params`` weights (``none`` keeps them ``dtype``; or
    ``fp8``, ``fp8_delayed``, ``mxfp8``, ``fp8_block``, ``nvfp4``) except the ``ignore`` names.

    ``weights="seeded"``: seeded random values (the same on every rank for one ``seed``), then
    quantized. ``weights="empty"``: built on meta and allocated straight in the final format
    with no high-precision copy, for :func:`load_checkpoint` to fill. Under a ``mesh`` with
    ``ep`` / ``tp`` > 1 the rank holds only its experts and linear shards. ``device``: where
    the model lives without a mesh (default ``cpu``); with one, ``mesh.device``.
    """
    from qckpt.pipeline.model import build

    if weights not in WEIGHTS:
        raise UsageError(f"build_model: weights must be seeded or empty, got {weights!r}")
    if mesh is None:
        mesh = _one_rank(device or "cpu")
    elif device is not None and str(mesh.device) != str(device):
        raise UsageError(f"build_model: device {device!r} is not the mesh's ({mesh.device})")
    built = build(
        source,
        mesh,
        dtype=dtype,
        seed=seed,
        seeded=weights == "seeded",
        params=params,
        ignore=ignore,
        backend=backend,
    )
    return built.model


@dataclass(kw_only=True)
class LoadOptions:
    """How :func:`load_checkpoint` reads (the recipe's ``checkpoint.format`` and ``load:``)."""

    format: str = "auto"  # auto | dcp | safetensors | megatron | torchtitan
    stream: bool = True  # one high-precision scratch at a time; False: the bulk baseline
    main_params: str | None = None  # "fp32": FP32 master copies of the quantized params too
    reader: str = "fast"  # fast (parallel reads) | plain (DCP's reader); the same values
    max_inflight: int = 1  # quantized destinations whose scratch may be live at once
    read_threads: int | None = None  # None: the fast reader's default


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    options: LoadOptions | None = None,
    *,
    mesh: Mesh | None = None,
    progress: Callable[[int], Any] | None = None,
    tap: Callable[[str, torch.Tensor], Any] | None = None,
    only: Collection[str] | None = None,
) -> LoadReport:
    """Load the checkpoint at ``path`` (a DCP dir, an HF safetensors dir, plain or quantized)
    into ``model`` in place; returns the ``LoadReport`` (``to_dict()`` is the CLI's JSON).

    Refuses a checkpoint that does not fit the model (a missing tensor, a shape) with a
    one-line ``CheckpointError`` naming the tensor. ``mesh``: the load is collective over its
    world. ``progress(n)``: called per tensor. ``tap(name, value)``: sees each high-precision
    value before it is quantized. ``only``: the state-dict names to fill.
    """
    from qckpt.load.loader import load_checkpoint as load

    o = options or LoadOptions()
    return load(
        model,
        path,
        format=o.format,
        stream=o.stream,
        main_params=o.main_params,
        mesh=mesh,
        progress=progress,
        tap=tap,
        reader=o.reader,
        max_inflight=o.max_inflight,
        read_threads=o.read_threads,
        only=only,
    )


def _model_device(model: nn.Module) -> Any:
    for p in model.parameters():
        return p.device
    return "cpu"


def calibrate_model(
    model: nn.Module,
    data: DataConfig | Sequence[torch.Tensor],
    quant: QuantConfig,
    mesh: Mesh | None = None,
    *,
    algorithm: Any = "max",
    model_source: str | None = None,
    share_expert_inputs: bool = True,
    moe_forward: str = "auto",
    progress: Callable[[int], Any] | None = None,
) -> tuple[CalibrationState, dict[str, Any]]:
    """Calibrate ``model`` for ``quant`` and sync the amaxes over ``mesh`` (default: one rank
    on the model's device); returns the ``CalibrationState`` (write it with
    :func:`save_calibration`) and the amax report.

    ``data``: the recipe's ``calibrate.data`` (this rank's share of its batches is taken here;
    ``model_source`` names the tokenizer of a ``text`` or ``dataset`` source) or this rank's
    batches of token ids ``[b, seq_len]``. ``algorithm``: ``max`` or ``mse`` (a name, or a
    ``qckpt.calib.algorithms`` object with its options); ``gptq`` and
    ``awq`` also rewrite the weights and write them beside the file, which ``qckpt calibrate``
    does.
    """
    from qckpt.calib.algorithms import ALGORITHMS, algorithm_named
    from qckpt.calib.calibrate import calibrate_model as calibrate
    from qckpt.recipe import DataConfig

    cls = ALGORITHMS.get(algorithm) if isinstance(algorithm, str) else type(algorithm)
    if cls is None or cls.sidecar:
        name = getattr(algorithm, "name", algorithm)
        raise UsageError(
            f"calibrate_model: algorithm must be max or mse, got {name!r} "
            "(gptq and awq write weights beside the calibration file: run qckpt calibrate)"
        )
    algorithm = algorithm_named(algorithm)
    mesh = mesh or _one_rank(_model_device(model))
    if isinstance(data, DataConfig):
        from qckpt.calib.data import calibration_batches, check_even_split

        cfg, stats = data, {}
        data = calibration_batches(
            cfg,
            vocab_size=model.config.vocab_size,
            model_source=model_source,
            data_rank=mesh.data_rank,
            data_world=mesh.data_parallel_size,
            stats=stats,
        )
        check_even_split(stats["samples"], cfg.batch_size, mesh.data_parallel_size, mesh.ep)
    return calibrate(
        model,
        data,
        quant,
        mesh,
        share_expert_inputs=share_expert_inputs,
        progress=progress,
        moe_forward=moe_forward,
        algorithm=algorithm,
    )


def _config_and_dir(model_config: Any) -> tuple[Any, Path | None]:
    """A model as the export wants it: its config (a transformers config or a dict) and the
    model dir whose config.json and tokenizer files travel with the export (None: none)."""
    if isinstance(model_config, (str, os.PathLike)):
        from qckpt.models.build import load_config

        cfg = load_config(str(model_config))
        return cfg, Path(model_config) if Path(model_config).is_dir() else None
    return getattr(model_config, "config", model_config), None


def _model_type(cfg: Any) -> str:
    return cfg["model_type"] if isinstance(cfg, dict) else cfg.model_type


def _export_args(
    model_config: Any,
    model_type: str | None,
    export: ExportConfig | None,
    source_dir: str | os.PathLike | None,
) -> dict[str, Any]:
    from qckpt.recipe import ExportConfig

    cfg, found_dir = _config_and_dir(model_config)
    return {
        "model_config": cfg,
        "model_type": model_type or _model_type(cfg),
        "export": export or ExportConfig(),
        "source_dir": source_dir if source_dir is not None else found_dir,
    }


def plan_export(
    *,
    source: str | os.PathLike,
    calibration: str | os.PathLike | CalibrationState,
    output: str | os.PathLike,
    model_config: Any,
    quant: QuantConfig,
    export: ExportConfig | None = None,
    model_type: str | None = None,
    source_dir: str | os.PathLike | None = None,
    source_format: str = "auto",
) -> ExportPlan:
    """The export of checkpoint ``source`` with ``calibration`` (a file or a state) into
    ``output``, decided and checked; reads metadata only and writes nothing.

    ``model_config``: a built-in name, a model dir (its config.json and tokenizer files then
    travel with the export unless ``source_dir`` says otherwise), a transformers config, its
    dict, or the model itself. ``export``: format (``compressed-tensors`` | ``modelopt``),
    shard size, ``overwrite``; default ``ExportConfig()``. Raises a one-line ``ExportError``
    for a refused target, a calibration of another model or format, or a recipe the layout
    cannot express.
    """
    from qckpt.export.plan import plan_export as plan

    args = _export_args(model_config, model_type, export, source_dir)
    return plan(
        source=source,
        calibration=calibration,
        output=output,
        quant=quant,
        source_format=source_format,
        **args,
    )


def export_checkpoint(
    *,
    source: str | os.PathLike,
    calibration: str | os.PathLike | CalibrationState,
    output: str | os.PathLike,
    model_config: Any,
    quant: QuantConfig,
    export: ExportConfig | None = None,
    model_type: str | None = None,
    source_dir: str | os.PathLike | None = None,
    source_format: str = "auto",
    progress: Callable[..., Any] | None = None,
    mesh: Mesh | None = None,
    options: WriteOptions | None = None,
) -> ExportReport:
    """:func:`plan_export`, then :func:`write_export`: the files in a temp dir beside
    ``output``, checked and renamed to it at the end (nothing half-written on a failure)."""
    from qckpt.export.writer import write_export

    t0 = time.perf_counter()
    plan = plan_export(
        source=source,
        calibration=calibration,
        output=output,
        model_config=model_config,
        quant=quant,
        export=export,
        model_type=model_type,
        source_dir=source_dir,
        source_format=source_format,
    )
    return write_export(plan, progress=progress, started=t0, mesh=mesh, options=options)


def open_checkpoint(
    path: str | os.PathLike, format: str = "auto", *, model_config: Any = None
) -> CheckpointSource:
    """The checkpoint at ``path`` as a source of tensors: ``entries()`` (names, shapes,
    dtypes), ``read(entry)``, ``iter_tensors()``; a quantized source's tensors come back
    dequantized. A training checkpoint (``megatron``, ``torchtitan``) needs ``model_config``
    (as in :func:`plan_export`): the HF model its tensors map onto."""
    from qckpt.read.readers import open_source

    config = None if model_config is None else _config_and_dir(model_config)[0]
    return open_source(path, format, config=config)


def evaluate_export(
    export_dir: str | os.PathLike,
    source_dir: str | os.PathLike,
    data: str | os.PathLike,
    options: EvalOptions | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``qckpt eval``'s report (a JSON-able dict): the export's outputs against its source
    model's on held-out ``data`` (KL divergence, top-1 agreement, perplexities), the export's
    quantization emulated as a serving engine runs it."""
    from qckpt.evaluate.options import EvalOptions
    from qckpt.evaluate.run import evaluate

    opts = options or EvalOptions()
    return evaluate(Path(export_dir), Path(source_dir), Path(data), opts, progress, log)
