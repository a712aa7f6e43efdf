"""``qckpt export``: a checkpoint plus its calibration file -> FP8/NVFP4 safetensors that serve.

Two steps: :func:`~qckpt.checkpoint.export_plan.plan_export` reads metadata only and decides
everything (what each tensor becomes, the checks of the calibration file, the shard
assignment, the config), so every refusal comes before a byte is written; :func:`write_export`
executes the plan: the safetensors headers are written from the plan first (all shapes are
known), then each source tensor is read, quantized and appended to its shard, and dropped: one
tensor in flight, so host memory stays near the largest tensor however large the model is.
:func:`export_checkpoint` is the two in a row.

Atomicity and safety (``qckpt.atomic``, ``qckpt.outputs``): the output may not equal, contain or
lie inside the source, the model dir or the calibration file (checked first); everything is
written into a temp dir beside the target, checked (``qckpt check``) and renamed to it at the
very end, refusing atomically a target that appeared meanwhile. With ``overwrite`` an existing
target is replaced only when it is an earlier export (it holds the
:data:`~qckpt.outputs.EXPORT_MARKER` file every export carries). SIGINT/SIGTERM remove the temp
dir; after a SIGKILL it stays (under its hidden name) and the next export to that target
removes it once its pid is gone.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qckpt.atomic import atomic_dir
from qckpt.calib.state_file import CalibrationState
from qckpt.checkpoint.export_layouts import Layout, check_source_weight
from qckpt.checkpoint.export_plan import ExportPlan, _Group, plan_export
from qckpt.checkpoint.model_files import copy_model_files
from qckpt.checkpoint.safetensors_io import write_json, write_shards
from qckpt.checkpoint.sources import CheckpointSource, iter_hf_tensors
from qckpt.errors import ExportError
from qckpt.outputs import EXPORT_MARKER, check_export_target, export_marker
from qckpt.recipe import ExportConfig, QuantConfig

__all__ = ["ExportPlan", "ExportReport", "export_checkpoint", "plan_export", "write_export"]

ProgressFn = Callable[[int, int, str], None]


@dataclass
class ExportReport:
    output: str
    layout: str
    quant_format: str
    source_format: str
    source_tensors: int  # stored tensors read (a fused experts parameter counts once)
    tensors_written: int
    quantized_linears: int
    bytes_read: int
    bytes_written: int  # tensor data, headers excluded
    shards: int
    largest_tensor_bytes: int
    seconds: float
    gbps: float  # bytes_read / seconds / 1e9
    peak_rss_bytes: int  # the process's peak RSS (VmHWM), so it includes what ran before
    files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what known clients cannot serve

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _peak_rss() -> int:
    """The process's peak RSS: VmHWM (ru_maxrss would carry a parent's peak over fork+exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class _WriteStats:
    written: int = 0  # output tensors
    sources: int = 0  # stored tensors read
    bytes_read: int = 0


def _output_tensors(
    src: CheckpointSource,
    groups: list[_Group],
    layout: Layout,
    cal_amax: dict[str, torch.Tensor],
    amax: dict[str, torch.Tensor],
    attn_modules: list[str],
    model_type: str,
    stats: _WriteStats,
    progress: ProgressFn | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The export's tensors in plan order (the groups' order), one source tensor in flight.

    Each quantized weight is first checked against its calibrated amax (``cal_amax``: finite,
    and no larger than what was calibrated); ``amax`` is what the scales are made from."""
    by_name = {g.entry.name: g for g in groups if g.entry is not None}
    n_source = len(src.entries())
    last_source = None
    for he, t in iter_hf_tensors(src, [g.entry for g in groups if g.entry], model_type):
        g = by_name[he.name]
        if g.module is not None:
            check_source_weight(g.module, t, cal_amax[f"{g.module}.weight_amax"])
            outs = layout.quantize_linear(g.module, t, amax)
        else:
            outs = iter([(he.name, t.to(g.specs[0].dtype))])
        for name, q in outs:
            stats.written += 1
            yield name, q
            del q
        del t
        if he.source is not last_source:
            last_source = he.source
            stats.sources += 1
            stats.bytes_read += he.source.nbytes
            if progress is not None:
                progress(stats.sources, n_source, he.source.name)
    if any(g.entry is None for g in groups):  # the KV scales: from the calibration file only
        for a in attn_modules:
            for name, q in layout.kv_tensors(a, amax):
                stats.written += 1
                yield name, q


def _self_check(tmp: Path, target: Path) -> None:
    """``qckpt check`` on the finished temp dir: a layout bug never reaches the target name."""
    from qckpt.check import check_export

    res = check_export(tmp)
    if not res.ok:
        more = f" (and {len(res.problems) - 1} more)" if len(res.problems) > 1 else ""
        raise ExportError(f"{target}: the export failed its own check: {res.problems[0]}{more}")


def _refuse_unmarked(target: Path) -> None:
    check_export_target(target, overwrite=True)


def write_export(
    plan: ExportPlan, *, progress: ProgressFn | None = None, started: float | None = None
) -> ExportReport:
    """Execute ``plan``: every file into a temp dir beside the target, renamed to it at the end.

    ``started`` (a ``time.perf_counter()``) is when the export began, planning included.
    """
    t0 = time.perf_counter() if started is None else started
    stats = _WriteStats()
    layout = plan.layout
    with atomic_dir(
        plan.target, key="export.output", replace=plan.overwrite, may_replace=_refuse_unmarked
    ) as tmp:
        tensors = _output_tensors(
            plan.source,
            plan.groups,
            layout,
            plan.cal_amax,
            plan.amax,
            plan.attn_modules,
            plan.model_type,
            stats,
            progress,
        )
        bytes_written = write_shards(tmp, plan.shards, tensors, metadata=layout.shard_metadata())
        write_json(tmp / "config.json", plan.config)
        for fname, obj in layout.extra_files(plan.ignore_list).items():
            write_json(tmp / fname, obj)
        if plan.source_dir is not None:
            copy_model_files(plan.source_dir, tmp)
        # last: overwrite replaces only a dir holding this file
        marker = export_marker(layout=plan.layout_name, shards=len(plan.shards.files))
        write_json(tmp / EXPORT_MARKER, marker)
        _self_check(tmp, plan.target)

    seconds = time.perf_counter() - t0
    return ExportReport(
        output=str(plan.target),
        layout=plan.layout_name,
        quant_format=layout.shard_metadata()["quant_format"],
        source_format=plan.source.format,
        source_tensors=plan.source_tensors,
        tensors_written=stats.written,
        quantized_linears=plan.quantized_linears,
        bytes_read=stats.bytes_read,
        bytes_written=bytes_written,
        shards=len(plan.shards.files),
        largest_tensor_bytes=plan.largest_tensor_bytes,
        seconds=seconds,
        gbps=stats.bytes_read / seconds / 1e9 if seconds > 0 else 0.0,
        peak_rss_bytes=_peak_rss(),
        files=sorted(p.name for p in plan.target.iterdir()),
        warnings=layout.warnings(plan.quantized_modules),
    )


def export_checkpoint(
    *,
    source: str | os.PathLike,
    calibration: str | os.PathLike | CalibrationState,
    output: str | os.PathLike,
    model_type: str,
    model_config: Any,
    quant: QuantConfig,
    export: ExportConfig,
    source_dir: str | os.PathLike | None = None,
    source_format: str = "auto",
    progress: ProgressFn | None = None,
) -> ExportReport:
    """Export ``source`` (DCP or HF safetensors dir) quantized with ``calibration`` into ``output``:
    :func:`plan_export`, then :func:`write_export`.

    ``model_config`` is the model's transformers config (or its dict); ``source_dir`` a model dir
    whose config.json, generation config and tokenizer files are carried over. Raises
    :class:`ExportError` (one line, before anything is written) for a refused target, a
    calibration file of another model or format, or a recipe the layout cannot express.
    """
    t0 = time.perf_counter()
    plan = plan_export(
        source=source,
        calibration=calibration,
        output=output,
        model_type=model_type,
        model_config=model_config,
        quant=quant,
        export=export,
        source_dir=source_dir,
        source_format=source_format,
    )
    return write_export(plan, progress=progress, started=t0)
