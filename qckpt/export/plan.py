"""The export's plan: everything an export decides, and every refusal it can meet, before a byte
is written (:func:`plan_export` -> :class:`ExportPlan`; :mod:`qckpt.export.writer` writes it).

Only metadata is read: the checkpoint's entries in HF checkpoint naming, the calibration file,
the model config (and the model built on the meta device, to know which modules are linears).
For each entry the plan says what it becomes (a quantized linear -> weight + scales, anything
else -> the model dtype), checks the calibration file against the model (model_type,
fingerprint, quant format, every amax present with the right shape) and assigns the outputs to
shards. Every failure is a one-line :class:`~qckpt.errors.ExportError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from qckpt.calib.state_file import CalibrationState, load_calibration, model_fingerprint
from qckpt.errors import CheckpointError, ExportError
from qckpt.export.shared_scales import share_fused_amax, share_moe_amax
from qckpt.formats.scheme import scheme_of
from qckpt.layouts.export_layout import BlockScales, ExportLayout, OutSpec
from qckpt.layouts.mixed import check_schemes
from qckpt.layouts.names import MOE_SHARED
from qckpt.layouts.registry import make_layout
from qckpt.models.build import transformers_config
from qckpt.models.naming import expert_slices, ignore_matcher, is_fused_experts
from qckpt.models.schemes import assign_schemes
from qckpt.outputs import check_export_target, guard
from qckpt.phases import PLAN, timed
from qckpt.read.hf_names import HFEntry, hf_entries
from qckpt.read.readers import open_source
from qckpt.read.source import CheckpointSource
from qckpt.recipe import ExportConfig, QuantConfig
from qckpt.storage.files import read_json
from qckpt.storage.shards import ShardPlan, plan_shards


@dataclass
class OutputGroup:
    """The outputs of one source entry (or of the KV scales), written together."""

    entry: HFEntry | None
    module: str | None  # set when the entry is a quantized linear's weight
    specs: list[OutSpec]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _config_dict(model_config: Any) -> dict:
    if isinstance(model_config, dict):
        return dict(model_config)
    return json.loads(model_config.to_json_string(use_diff=False))


def _is_router(name: str, module: torch.nn.Module) -> bool:
    cls = type(module).__name__.lower()
    return "router" in cls or name.endswith((".mlp.gate", ".block_sparse_moe.gate", ".router"))


def model_linears(model_config: Any, model_type: str) -> tuple[set[str], set[str], list[str]]:
    """(HF names of every linear, incl. per-expert ones; the MoE routers; the embeddings).

    The model is built on the meta device: no memory, and the module types say what is a linear
    (an embedding or a norm never is), which a guess from tensor shapes could not.
    """
    from transformers import AutoModelForCausalLM

    cfg = transformers_config(model_config, model_type)
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
        if is_fused_experts(mod):
            gate_up, down = mod.gate_up_proj.shape, mod.down_proj.shape
            linears.update(sl.hf_module for sl in expert_slices(name, model_type, gate_up, down))
    return linears, routers, embeddings


def model_modules(model_config: Any) -> tuple[set[str], set[str], list[str]]:
    """:func:`model_linears` of a transformers config: what calibrate records for export."""
    return model_linears(model_config, model_config.model_type)


def config_dict(model_config: Any) -> dict:
    return _config_dict(model_config)


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
    if quant.mixed:
        got_entries = cal.quant.get("schemes") or []
        if not got_entries:
            # a one-scheme calibration: its amaxes' shapes are checked one by one
            return
        if len(got_entries) != len(quant.schemes):
            raise ExportError(
                f"{where}: calibrated with {len(got_entries)} quant.schemes entries; the export "
                f"has {len(quant.schemes)}"
            )
        for i, (got, sc) in enumerate(zip(got_entries, quant.schemes, strict=True)):
            _check_sides(got, sc, f"quant.schemes[{i}].", where)
        return
    _check_sides(cal.quant, quant, "quant.", where)


def _check_sides(got_entry: dict, want_entry: Any, path: str, where: str) -> None:
    """A calibration's record of one scheme's weights / inputs against the export's."""
    for side in ("weights", "inputs"):
        got = got_entry.get(side) or {}
        want = asdict(getattr(want_entry, side))
        keys = ["format", "granularity"] + (["dynamic"] if side == "inputs" else [])
        if want["granularity"] == "block":
            keys.append("block_size")
        diff = [k for k in keys if k in got and got[k] != want[k]]
        if diff:
            have = ", ".join(f"{k}={got[k]}" for k in diff)
            asked = ", ".join(f"{k}={want[k]}" for k in diff)
            raise ExportError(
                f"{where}: calibrated for {path}{side} {have}; the export asks {asked}"
            )


def _check_amax(
    cal: CalibrationState, needed: list[tuple[str, tuple[int, ...]]], where: str
) -> dict[str, float]:
    """Every amax ``needed`` is there, of its shape, and finite; returns the one-value ones as
    Python floats (what ``share_moe_amax`` compares), read in one go per shape."""
    missing = [k for k, _ in needed if k not in cal.amax]
    if missing:
        raise ExportError(
            f"{where}: {len(missing)} amax missing from the calibration file (first: {missing[0]}); "
            "an uncalibrated scale would load as zero and serve NaNs"
        )
    by_shape: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # grouped by shape
    values: dict[str, float] = {}
    for key, shape in needed:
        t = cal.amax[key]
        got = tuple(t.shape)
        ok = got == shape or (shape == () and math.prod(got) == 1) or (got == (*shape, 1))
        if not ok:
            raise ExportError(
                f"{where}: {key} has shape {list(got)}, the export needs {list(shape)}"
            )
        v = cal.float_of(key)  # read from the file in one go (load_calibration)
        if v is not None and math.isfinite(v):
            values[key] = v
        else:  # tested below, as a tensor
            by_shape.setdefault(got, {})[key] = t
    # one finiteness test per shape over the other amaxes (one stack each, no per-amax op),
    # then the first bad one by name
    for got, group in by_shape.items():
        stacked = torch.stack(list(group.values())).detach()
        if not bool(torch.isfinite(stacked).all()):
            bad = next(k for k, _ in needed if not torch.isfinite(cal.amax[k]).all())
            raise ExportError(f"{where}: {bad} is not finite")
        if math.prod(got) == 1:
            values.update(zip(group, stacked.double().reshape(-1).tolist(), strict=True))
    return values


def _gptq_source(src, cal: CalibrationState, model_type: str):
    """A gptq calibration's GPTQ'd weights (an awq one's folded weights) in place of the
    checkpoint's; else ``src``."""
    if cal.algorithm not in ("gptq", "awq"):
        return src
    from qckpt.read.gptq_source import GptqSource

    return GptqSource(src, cal.weights_dir, cal.weights_files, model_type)


def _block_scales(cal: CalibrationState, src) -> BlockScales:  # noqa: ANN001
    """Where the export's NVFP4 block scales come from, for the calibration's algorithm:
    searched (mse), the GPTQ'd weights' own (gptq), else the max rule."""
    if cal.algorithm == "gptq":
        return BlockScales(given=src.block_scale, given_zero_points=src.zero_point)
    if cal.algorithm != "mse":
        return BlockScales()
    return BlockScales(search=True, weights=partial(_hessian_diag, cal))


def _hessian_diag(cal: CalibrationState, module: str) -> torch.Tensor | None:
    """``module``'s ``H_jj`` from an mse calibration with hessian weighting (None: none: the
    plain search, as the calibration did for a cold expert)."""
    return cal.amax.get(f"{module}.hessian_diag")


def _algorithm_amax(cal, needed, values, quant, export, where: str):  # noqa: ANN001
    """(amaxes, their float values) the scales are made from, for the calibration's algorithm
    (see ``CalibrationState``)."""
    if cal.algorithm == "mse":
        return _with_clips(cal, needed, values, where)
    if cal.algorithm == "gptq":
        per_tensor = any(scheme_of(e.weights, "weight").scalar_amax for e in quant.entries())
        if export.moe_scales != MOE_SHARED and per_tensor:
            # GPTQ quantized an expert's gate and up with their shared scale
            raise ExportError(
                f"{where}: a gptq calibration of per-tensor weights exports with "
                "export.moe_scales: shared (its experts' gate and up were quantized with one scale)"
            )
    return cal.amax, values


def _with_clips(
    cal: CalibrationState, needed: list[tuple[str, tuple[int, ...]]], values: dict, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The amaxes the scales are made from, for a searched calibration: each needed weight /
    input amax replaced by its ``_clip_amax`` where the file has one (of the same shape);
    ``values`` (one-value amaxes as floats) likewise. ``cal.amax`` itself stays the guard's."""
    amax, vals = dict(cal.amax), dict(values)
    for key, _ in needed:
        clip = cal.amax.get(key[: -len("_amax")] + "_clip_amax")
        if clip is None:
            continue
        if clip.numel() != cal.amax[key].numel() or not bool(torch.isfinite(clip).all()):
            raise ExportError(
                f"{where}: {key[:-5]}_clip_amax does not match {key} or is not finite"
            )
        amax[key] = clip.reshape(cal.amax[key].shape)
        if key in vals:
            vals[key] = float(clip.reshape(()))
    return amax, vals


@dataclass(kw_only=True)
class ExportPlan:
    """Everything an export decides before it writes a byte (:func:`plan_export`).

    Building one reads only metadata (the checkpoint's entries, the calibration file, the model
    config) and raises every refusal an export can meet in planning; :func:`write_export` then
    executes it. ``groups`` are the outputs in write order, one group per source entry (plus
    the KV scales), ``shards`` their assignment to files, ``config`` the config.json written.
    """

    target: Path
    overwrite: bool
    layout_name: str
    layout: ExportLayout
    source: CheckpointSource
    model_type: str
    source_tensors: int
    groups: list[OutputGroup]
    attn_modules: list[str]
    cal_amax: dict[str, torch.Tensor]  # as calibrated: each weight is checked against it
    amax: dict[str, torch.Tensor]  # what the scales are made from (MoE scales shared or not)
    shards: ShardPlan
    config: dict
    ignore_list: list[str]
    quantized_linears: int
    source_dir: str | os.PathLike | None = None

    @property
    def quantized_modules(self) -> list[str]:
        return [g.module for g in self.groups if g.module is not None]

    @property
    def largest_tensor_bytes(self) -> int:
        return max(g.entry.source.nbytes for g in self.groups if g.entry is not None)


def _open_entries(
    source: str | os.PathLike, source_format: str, model_config: Any = None
) -> tuple[CheckpointSource, list]:
    """The source and its stored entries (metadata only); a training checkpoint's in the HF
    names of ``model_config``."""
    try:
        src = open_source(source, source_format, config=model_config)
        stored = src.entries()
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    if not stored:
        raise ExportError(f"{source}: the checkpoint holds no tensors")
    return src, stored


def _calibration(calibration: str | os.PathLike | CalibrationState) -> tuple[CalibrationState, str]:
    """The calibration state and how to name it in a message."""
    if isinstance(calibration, CalibrationState):
        return calibration, "calibration"
    try:
        return load_calibration(calibration), str(calibration)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _check_model_type(model_config: Any, model_type: str) -> None:
    cfg_model_type = (
        model_config.get("model_type")
        if isinstance(model_config, dict)
        else getattr(model_config, "model_type", None)
    )
    if cfg_model_type and cfg_model_type != model_type:
        raise ExportError(
            f"model config is of a {cfg_model_type} model, the export was asked for {model_type}"
        )


def _model_config_dict(model_config: Any, source_dir: str | os.PathLike | None) -> dict:
    """The config.json to write: the model dir's own when there is one (kept as it is)."""
    if source_dir is not None and os.path.lexists(Path(source_dir) / "config.json"):
        return read_json(Path(source_dir) / "config.json", what="model config")
    return _config_dict(model_config)


@dataclass
class _Outputs:
    groups: list[OutputGroup] = field(default_factory=list)
    needed: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    attn_modules: list[str] = field(default_factory=list)
    quantized: int = 0


def _plan_outputs(
    entries: list[HFEntry],
    layout: ExportLayout,
    model_dtype: torch.dtype,
    quantize: Callable[[str], bool],
    kv_cache: bool,
) -> _Outputs:
    """What each entry becomes (``quantize(module)``: a linear the recipe quantizes) and the
    amaxes that needs, in entry order; the KV scales last."""
    out = _Outputs()
    for e in entries:
        module, _, leaf = e.name.rpartition(".")
        if leaf == "weight" and len(e.shape) == 2 and quantize(module):
            out.groups.append(OutputGroup(e, module, layout.linear_specs(module, e.shape)))
            out.needed += layout.needed_amax(module, e.shape)
            out.quantized += 1
            if module.endswith(".k_proj"):
                out.attn_modules.append(module.rpartition(".")[0])
        else:
            dtype = model_dtype if e.dtype.is_floating_point else e.dtype
            out.groups.append(OutputGroup(e, None, [OutSpec(e.name, dtype, e.shape)]))
    if kv_cache:
        attn = out.attn_modules
        kv_specs = [s for a in attn for s in layout.kv_specs(a)]
        out.needed += [(f"{a}.{kv}_proj.output_amax", ()) for a in attn for kv in ("k", "v")]
        out.groups.append(OutputGroup(None, None, kv_specs))
    return out


@timed(PLAN)
def plan_export(
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
    modules: tuple[set[str], set[str], list[str]] | None = None,
) -> ExportPlan:
    """The export of ``source`` with ``calibration`` into ``output``, decided and checked.

    Reads metadata only and writes nothing. Raises :class:`ExportError` (one line) for a refused
    target, a checkpoint without tensors or without a linear to quantize, a calibration file of
    another model or format (or missing an amax), or a recipe the layout cannot express.
    """
    inputs = [("checkpoint.path", source), ("model.source", source_dir)]
    if not isinstance(calibration, CalibrationState):
        inputs.append(("calibrate.output", calibration))
    check_schemes(quant)  # a scheme that cannot be, before anything is opened
    target = guard([("export.output", output)], inputs)["export.output"]
    check_export_target(target, export.overwrite)

    src, stored = _open_entries(source, source_format, model_config)
    entries = hf_entries(stored, model_type)
    cal, where = _calibration(calibration)
    src = _gptq_source(src, cal, model_type)
    _check_model_type(model_config, model_type)
    fingerprint = model_fingerprint((e.name, e.shape) for e in entries)
    _check_calibration(cal, model_type, fingerprint, quant, where)

    cfg = _model_config_dict(model_config, source_dir)
    model_dtype = _model_dtype(cfg, entries)
    # (linears, routers, embeddings): from the calibration file when it has them, else built
    linears, routers, embeddings = modules or model_linears(model_config, model_type)
    by_pattern = ignore_matcher(quant.ignore)
    assignment = _assignment(quant, linears, by_pattern)
    layout = make_layout(export.format, quant, model_dtype, _block_scales(cal, src), assignment)

    def ignored(module: str) -> bool:  # routers are never quantized, whatever quant.ignore says
        return module in routers or by_pattern(module) or assignment.get(module, 0) is None

    outs = _plan_outputs(
        entries, layout, model_dtype, lambda m: m in linears and not ignored(m), quant.kv_cache
    )
    if outs.quantized == 0:
        raise ExportError(
            f"{source}: no linear weight left to quantize (check quant.ignore and model_type)"
        )
    values = _check_amax(cal, outs.needed, where)
    ignore_list = layout.ignore_entries(
        sorted(m for m in linears | routers if ignored(m)), embeddings
    )
    amax, values = _algorithm_amax(cal, outs.needed, values, quant, export, where)
    amax = _shared_amax(amax, values, outs, layout, export, model_type)
    cfg["quantization_config"] = layout.quantization_config(ignore_list)
    return ExportPlan(
        target=target,
        overwrite=export.overwrite,
        layout_name=export.format,
        layout=layout,
        source=src,
        model_type=model_type,
        source_tensors=len(stored),
        groups=outs.groups,
        attn_modules=outs.attn_modules,
        # GPTQ'd weights may pass their own amax (the rounding errors it spread); they are
        # within the scales' range, which is what the guard then checks them against
        cal_amax=amax if cal.algorithm == "gptq" else cal.amax,
        amax=amax,
        shards=plan_shards((g.specs for g in outs.groups), export.max_shard_bytes),
        config=cfg,
        ignore_list=ignore_list,
        quantized_linears=outs.quantized,
        source_dir=source_dir,
    )


def _assignment(quant: QuantConfig, linears: set[str], by_pattern) -> dict[str, int | None]:  # noqa: ANN001
    """Each linear's entry of ``quant.entries()`` (None: left in the model dtype); for
    ``quant.schemes`` checked against what clients fuse and every target matching a linear
    (SchemeError, before any tensor is read)."""
    if not quant.mixed:
        return {m: None if by_pattern(m) else 0 for m in linears}
    out = assign_schemes(quant, sorted(linears))
    return {m: None if by_pattern(m) else i for m, i in out.items()}


def _shared_amax(amax, values, outs, layout: ExportLayout, export, model_type):  # noqa: ANN001
    """The amaxes shared as clients load them: MoE experts' (``export.moe_scales: shared``), then
    one NVFP4 global per weight a client fuses (q/k/v, gate/up: ``shared_scales.share_fused_amax``),
    each as its module's scheme says."""
    modules = [g.module for g in outs.groups if g.module is not None]
    if export.moe_scales == MOE_SHARED:
        amax = share_moe_amax(amax, modules, layout.quant_of, model_type, values=values)
    return share_fused_amax(amax, modules, layout.quant_of)
