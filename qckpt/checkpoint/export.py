"""``qckpt export``: a checkpoint plus its calibration file -> FP8/NVFP4 safetensors that serve.

The export runs in two passes over the checkpoint's *metadata* and one over its *data*:

1. plan (no tensor data read): list the source tensors in HF checkpoint naming, decide for each
   one what it becomes (quantized linear -> weight + scales, everything else -> model dtype),
   check the calibration file against the model (model_type, fingerprint, quant format, every
   amax present with the right shape), assign the outputs to shards. Every failure here is a
   one-line :class:`ExportError` and nothing has been written yet.
2. write: the safetensors headers are written from the plan first (all shapes are known), then
   each source tensor is read, quantized and appended to its shard, and dropped: one tensor in
   flight, so host memory stays near the largest tensor however large the model is.

Atomicity and safety (``qckpt.atomic``, ``qckpt.outputs``): the output may not equal, contain or
lie inside the source, the model dir or the calibration file (checked first); everything is
written into a temp dir beside the target and renamed to it at the very end, refusing atomically a
target that appeared meanwhile. With ``overwrite`` an existing target is replaced only when it is
an earlier export (it holds the :data:`~qckpt.outputs.EXPORT_MARKER` file every export carries).
SIGINT/SIGTERM remove the temp dir; after a SIGKILL it stays (under its hidden name) and the next
export to that target removes it once its pid is gone.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qckpt.atomic import atomic_dir
from qckpt.calib.state_file import CalibrationState, load_calibration, model_fingerprint
from qckpt.checkpoint.export_layouts import (
    MOE_SHARED,
    Layout,
    OutSpec,
    check_source_weight,
    make_layout,
    share_moe_amax,
)
from qckpt.checkpoint.model_files import copy_model_files
from qckpt.checkpoint.safetensors_io import (
    ShardPlan,
    plan_shards,
    read_json,
    write_json,
    write_shards,
)
from qckpt.checkpoint.sources import (
    CheckpointSource,
    HFEntry,
    hf_entries,
    iter_hf_tensors,
    open_source,
)
from qckpt.errors import CheckpointError, ExportError
from qckpt.models.naming import expert_slices
from qckpt.outputs import EXPORT_MARKER, check_export_target, export_marker, guard
from qckpt.recipe import ExportConfig, QuantConfig

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


@dataclass
class _Group:
    """The outputs of one source entry (or of the KV scales), written together."""

    entry: HFEntry | None
    module: str | None  # set when the entry is a quantized linear's weight
    specs: list[OutSpec]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


# --------------------------------------------------------------------------------------------
# planning


def _config_dict(model_config: Any) -> dict:
    if isinstance(model_config, dict):
        return dict(model_config)
    return json.loads(model_config.to_json_string(use_diff=False))


def _transformers_config(model_config: Any, model_type: str) -> Any:
    if not isinstance(model_config, dict):
        return model_config
    from transformers import AutoConfig

    d = {k: v for k, v in model_config.items() if k not in ("model_type", "quantization_config")}
    return AutoConfig.for_model(model_config.get("model_type", model_type), **d)


def _is_router(name: str, module: torch.nn.Module) -> bool:
    cls = type(module).__name__.lower()
    return "router" in cls or name.endswith((".mlp.gate", ".block_sparse_moe.gate", ".router"))


def _model_linears(model_config: Any, model_type: str) -> tuple[set[str], set[str], list[str]]:
    """(HF names of every linear, incl. per-expert ones; the MoE routers; the embeddings).

    The model is built on the meta device: no memory, and the module types say what is a linear
    (an embedding or a norm never is), which a guess from tensor shapes could not.
    """
    from transformers import AutoModelForCausalLM

    cfg = _transformers_config(model_config, model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    linears: set[str] = set()
    routers: set[str] = set()
    embeddings = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    for name, mod in model.named_modules():
        if _is_router(name, mod):
            routers.add(name)
            continue
        if isinstance(mod, torch.nn.Linear):
            linears.add(name)
        params = dict(mod.named_parameters(recurse=False))
        if "gate_up_proj" in params and "down_proj" in params:
            for sl in expert_slices(
                name, model_type, params["gate_up_proj"].shape, params["down_proj"].shape
            ):
                linears.add(sl.hf_module)
    return linears, routers, embeddings


def _model_dtype(cfg: dict, entries: list[HFEntry]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    for e in entries:
        if e.dtype.is_floating_point:
            return e.dtype
    return torch.bfloat16


def _check_calibration(
    cal: CalibrationState,
    model_type: str,
    fingerprint: str,
    quant: QuantConfig,
    where: str,
) -> None:
    if cal.model_type and cal.model_type != model_type:
        raise ExportError(
            f"{where}: calibration of a {cal.model_type} model, the export is of a {model_type} model"
        )
    if cal.model_fingerprint and cal.model_fingerprint != fingerprint:
        raise ExportError(
            f"{where}: calibration of another model (fingerprint {cal.model_fingerprint}, "
            f"this checkpoint has {fingerprint})"
        )
    for side in ("weights", "inputs"):
        got = cal.quant.get(side) or {}
        want = asdict(getattr(quant, side))
        keys = ["format", "granularity"] + (["dynamic"] if side == "inputs" else [])
        if want["granularity"] == "block":
            keys.append("block_size")
        diff = [k for k in keys if k in got and got[k] != want[k]]
        if diff:
            have = ", ".join(f"{k}={got[k]}" for k in diff)
            asked = ", ".join(f"{k}={want[k]}" for k in diff)
            raise ExportError(
                f"{where}: calibrated for quant.{side} {have}; the export asks {asked}"
            )


def _check_amax(
    cal: CalibrationState, needed: list[tuple[str, tuple[int, ...]]], where: str
) -> None:
    missing = [k for k, _ in needed if k not in cal.amax]
    if missing:
        raise ExportError(
            f"{where}: {len(missing)} amax missing from the calibration file (first: {missing[0]}); "
            "an uncalibrated scale would load as zero and serve NaNs"
        )
    for key, shape in needed:
        got = tuple(cal.amax[key].shape)
        ok = got == shape or (shape == () and math.prod(got) == 1) or (got == (*shape, 1))
        if not ok:
            raise ExportError(
                f"{where}: {key} has shape {list(got)}, the export needs {list(shape)}"
            )
        if not torch.isfinite(cal.amax[key]).all():
            raise ExportError(f"{where}: {key} is not finite")


# --------------------------------------------------------------------------------------------
# writing


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
    """Export ``source`` (DCP or HF safetensors dir) quantized with ``calibration`` into ``output``.

    ``model_config`` is the model's transformers config (or its dict); ``source_dir`` a model dir
    whose config.json, generation config and tokenizer files are carried over. Raises
    :class:`ExportError` (one line, before anything is written) for a refused target, a
    calibration file of another model or format, or a recipe the layout cannot express.
    """
    t0 = time.perf_counter()
    inputs = [("checkpoint.path", source), ("model.source", source_dir)]
    if not isinstance(calibration, CalibrationState):
        inputs.append(("calibrate.output", calibration))
    target = guard([("export.output", output)], inputs)["export.output"]
    check_export_target(target, export.overwrite)
    layout_name = export.format

    # -- plan ---------------------------------------------------------------------------------
    try:
        src = open_source(source, source_format)
        stored = src.entries()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if not stored:
        raise ExportError(f"{source}: the checkpoint holds no tensors")
    entries = hf_entries(stored, model_type)
    fingerprint = model_fingerprint((e.name, e.shape) for e in entries)

    if isinstance(calibration, CalibrationState):
        cal, where = calibration, "calibration"
    else:
        where = str(calibration)
        try:
            cal = load_calibration(calibration)
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None
    cfg_model_type = (
        model_config.get("model_type")
        if isinstance(model_config, dict)
        else getattr(model_config, "model_type", None)
    )
    if cfg_model_type and cfg_model_type != model_type:
        raise ExportError(
            f"model config is of a {cfg_model_type} model, the export was asked for {model_type}"
        )
    _check_calibration(cal, model_type, fingerprint, quant, where)

    cfg = _config_dict(model_config)
    if source_dir is not None and os.path.lexists(Path(source_dir) / "config.json"):
        cfg = read_json(Path(source_dir) / "config.json", what="model config")
    model_dtype = _model_dtype(cfg, entries)
    layout: Layout = make_layout(layout_name, quant, model_dtype)

    linears, routers, embeddings = _model_linears(model_config, model_type)

    def ignored(module: str) -> bool:
        return module in routers or any(fnmatch.fnmatchcase(module, p) for p in quant.ignore)

    groups: list[_Group] = []
    needed: list[tuple[str, tuple[int, ...]]] = []
    attn_modules: list[str] = []
    quantized = 0
    for e in entries:
        module, _, leaf = e.name.rpartition(".")
        if leaf == "weight" and module in linears and len(e.shape) == 2 and not ignored(module):
            groups.append(_Group(e, module, layout.linear_specs(module, e.shape)))
            needed += layout.needed_amax(module, e.shape)
            quantized += 1
            if module.endswith(".k_proj"):
                attn_modules.append(module.rpartition(".")[0])
        else:
            dtype = model_dtype if e.dtype.is_floating_point else e.dtype
            groups.append(_Group(e, None, [OutSpec(e.name, dtype, e.shape)]))
    if quantized == 0:
        raise ExportError(
            f"{source}: no linear weight left to quantize (check quant.ignore and model_type)"
        )
    if quant.kv_cache:
        kv_specs = [s for a in attn_modules for s in layout.kv_specs(a)]
        needed += [(f"{a}.{kv}_proj.output_amax", ()) for a in attn_modules for kv in ("k", "v")]
        groups.append(_Group(None, None, kv_specs))
    _check_amax(cal, needed, where)
    ignore_list = layout.ignore_entries(
        sorted(m for m in linears | routers if ignored(m)), embeddings
    )
    amax = cal.amax
    if export.moe_scales == MOE_SHARED:
        modules = [g.module for g in groups if g.module is not None]
        amax = share_moe_amax(cal.amax, modules, quant, model_type)

    plan: ShardPlan = plan_shards((g.specs for g in groups), export.max_shard_bytes)
    cfg["quantization_config"] = layout.quantization_config(ignore_list)

    # -- write --------------------------------------------------------------------------------
    stats = _WriteStats()
    largest = max(g.entry.source.nbytes for g in groups if g.entry is not None)
    replace = export.overwrite
    with atomic_dir(
        target, key="export.output", replace=replace, may_replace=_refuse_unmarked
    ) as tmp:
        tensors = _output_tensors(
            src, groups, layout, cal.amax, amax, attn_modules, model_type, stats, progress
        )
        bytes_written = write_shards(tmp, plan, tensors, metadata=layout.shard_metadata())
        write_json(tmp / "config.json", cfg)
        for fname, obj in layout.extra_files(ignore_list).items():
            write_json(tmp / fname, obj)
        if source_dir is not None:
            copy_model_files(source_dir, tmp)
        # last: overwrite replaces only a dir holding this file
        write_json(tmp / EXPORT_MARKER, export_marker(layout=layout_name, shards=len(plan.files)))
        _self_check(tmp, target)

    seconds = time.perf_counter() - t0
    return ExportReport(
        output=str(target),
        layout=layout_name,
        quant_format=layout.shard_metadata()["quant_format"],
        source_format=src.format,
        source_tensors=len(stored),
        tensors_written=stats.written,
        quantized_linears=quantized,
        bytes_read=stats.bytes_read,
        bytes_written=bytes_written,
        shards=len(plan.files),
        largest_tensor_bytes=largest,
        seconds=seconds,
        gbps=stats.bytes_read / seconds / 1e9 if seconds > 0 else 0.0,
        peak_rss_bytes=_peak_rss(),
        files=sorted(p.name for p in target.iterdir()),
        warnings=layout.warnings([g.module for g in groups if g.module is not None]),
    )
