"""What a serving stack reads from an export dir: per quantized linear, its weight storage
(:mod:`qckpt.layouts.source_layout`) and how its input is quantized; the KV-cache scales.

From the export's own files only (``config.json``'s ``quantization_config``,
``hf_quant_config.json``, the tensors), never from qckpt's calibration state:

* compressed-tensors: each linear's ``config_groups`` entry (``targets``: ``Linear``, a module
  name or ``re:`` regex) gives its ``input_activations``: none (weight-only), FP8 ``tensor``
  static (``{m}.input_scale``) or dynamic, ``token`` dynamic, ``group`` dynamic
  (``group_size``), or NVFP4 ``tensor_group`` (``{m}.input_global_scale``, which multiplies the
  block scales), INT8 ``tensor`` static (``{m}.input_scale``) or ``token`` dynamic. KV:
  ``{attn}.k_scale`` / ``{attn}.v_scale``.
* ModelOpt: ``quant_algo`` ``FP8`` (static ``{m}.input_scale``), ``FP8_PER_CHANNEL_PER_TOKEN``
  (dynamic per-token), ``NVFP4`` (``{m}.input_scale`` = amax / (6 * 448); the global scale the
  kernels use is its float32 reciprocal, as vLLM computes it). KV: ``{attn}.k_proj.k_scale``.

MoE experts (``{...}.experts.{e}.{proj}``): static input scales are shared per layer as vLLM's
fused-MoE layers share them: the largest over the layer's experts for gate and up (one input),
and for down (for NVFP4 the smallest global scale, i.e. the largest amax).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from qckpt.errors import CheckpointError
from qckpt.evaluate.fused import fused_groups, plan_fused
from qckpt.formats.act_quant import InputQuant
from qckpt.formats.scheme import make_scheme, weight_only_on_hopper
from qckpt.layouts.registry import source_layout
from qckpt.layouts.source_layout import QuantWeight, SourceLayout, read_json_if_any
from qckpt.read.hf_reader import hf_index
from qckpt.storage.slices import SafetensorsFetch

_EXPERT = re.compile(r"^(?P<pre>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)$")
_GATE_UP = ("gate_proj", "up_proj", "w1", "w3")
# input modes whose stored scale is a global scale that divides (NVFP4's): clients share the
# smallest of a layer's, where FP8 scales share the largest
_GLOBAL_MODES = frozenset({make_scheme("nvfp4", kind="input").input_mode()})


@dataclass
class ExportScheme:
    """The export as a client runs it."""

    path: Path
    layout: SourceLayout
    weights: dict[str, QuantWeight]  # "{module}.weight" -> storage
    inputs: dict[str, InputQuant]  # module -> its input quantization
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)
    # what vLLM does to fused linears at load (qckpt.evaluate.fused)
    requant: dict[str, torch.Tensor] = field(default_factory=dict)
    nvfp4_global: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the linears keep the model's own (source) weights; only their inputs are quantized
    weights_from_model: bool = False

    def fetch(self) -> SafetensorsFetch:
        return SafetensorsFetch(self.path, self.index)

    def summary(self) -> dict[str, Any]:
        modes: dict[str, int] = {}
        for q in self.inputs.values():
            modes[q.describe()] = modes.get(q.describe(), 0) + 1
        return {
            **self.layout.summary(),
            "input_quantization": dict(sorted(modes.items())),
            "kv_cache_scales": len(self.kv),
            "fused_fp8_requantized": len(self.requant),
            "fused_nvfp4_global_scale_replaced": len(self.nvfp4_global),
        }


def weights_only(scheme: ExportScheme) -> ExportScheme:
    """``scheme`` with every linear's inputs left unquantized: what a client computes whose
    kernel dequantizes the weights and multiplies in the model dtype (``eval.inputs:
    unquantized``; the report's ``scheme.input_quantization`` then counts them as ``none``).
    The KV-cache scales stay: the cache is quantized whatever the linears do."""
    return replace(scheme, inputs={m: InputQuant("none") for m in scheme.inputs})


def as_on_hopper(scheme: ExportScheme) -> ExportScheme:
    """``scheme`` as a Hopper client runs it (``eval.inputs: hopper``): the inputs it has a
    GEMM for quantized as exported, the others (NVFP4's) left alone, the linear weight-only.
    A mixed export's figure then matches vLLM's on an H100 / H200, where neither
    ``as-exported`` (W4A4 everywhere) nor ``unquantized`` (no FP8 inputs either) does."""
    off = weight_only_on_hopper()
    inputs = {m: InputQuant("none") if q.mode in off else q for m, q in scheme.inputs.items()}
    return replace(scheme, inputs=inputs)


def inputs_only(scheme: ExportScheme, source_dir: Path) -> ExportScheme:
    """The export's input quantization on the source's weights (``eval.weights: unquantized``):
    the model is filled from ``source_dir`` and each quantized linear keeps its BF16 weight."""
    return replace(
        scheme,
        path=Path(source_dir),
        index=hf_index(source_dir),
        requant={},
        nvfp4_global={},
        weights_from_model=True,
    )


def _target_matches(target: str, module: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _ct_group_of(groups: dict[str, Any], module: str) -> dict[str, Any] | None:
    with_weights = [g for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if len(with_weights) == 1:
        return with_weights[0]
    for g in with_weights:
        if any(_target_matches(str(t), module) for t in g.get("targets") or []):
            return g
    return None


def _scalar(fetch: SafetensorsFetch, key: str, module: str) -> torch.Tensor:
    if key not in fetch.index:
        raise CheckpointError(f"{fetch.root}: {module} has static input quantization but no {key}")
    t = fetch(key, None, None).to(torch.float32)
    if t.numel() != 1:
        raise CheckpointError(f"{fetch.root}: {key} must hold one value, has {t.numel()}")
    return t.reshape(())


def _ct_input(args: dict[str, Any] | None, module: str, fetch: SafetensorsFetch) -> InputQuant:
    if not args:
        return InputQuant("none")
    bits, typ, strat, dyn = args.get("num_bits"), args.get("type"), args.get("strategy"), None
    dyn = args.get("dynamic")
    where = f"{fetch.root}: {module}: input_activations"
    mx = args.get("scale_dtype") in ("torch.uint8", "uint8") and args.get("group_size") == 32
    if (bits, typ, strat, dyn, mx) == (8, "float", "group", True, True):
        return InputQuant("mxfp8")
    if (bits, typ) == (8, "float"):
        if strat == "tensor" and dyn is False:
            return InputQuant("fp8_static", _scalar(fetch, f"{module}.input_scale", module))
        if strat == "tensor" and dyn is True:
            return InputQuant("fp8_tensor_dynamic")
        if strat == "token" and dyn is True:
            return InputQuant("fp8_token")
        if strat == "group" and dyn is True and isinstance(args.get("group_size"), int):
            return InputQuant("fp8_group", group=int(args["group_size"]))
    if (bits, typ) == (8, "int") and args.get("symmetric", True) is not False:
        if strat == "tensor" and dyn is False:
            return InputQuant("int8_static", _scalar(fetch, f"{module}.input_scale", module))
        if strat == "token" and dyn is True:
            return InputQuant("int8_token")
    if (bits, typ, strat) == (4, "float", "tensor_group") and dyn == "local":
        return InputQuant("nvfp4", _scalar(fetch, f"{module}.input_global_scale", module))
    raise CheckpointError(
        f"{where}: {bits}-bit {typ} strategy {strat!r} dynamic {dyn!r} is not an input "
        "quantization qckpt eval emulates"
    )


def _modelopt_input(algo: str, module: str, fetch: SafetensorsFetch) -> InputQuant:
    if algo == "FP8":
        return InputQuant("fp8_static", _scalar(fetch, f"{module}.input_scale", module))
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return InputQuant("fp8_token")
    s = _scalar(fetch, f"{module}.input_scale", module)
    return InputQuant("nvfp4", torch.ones((), dtype=torch.float32) / s)


def _modelopt_algos(path: Path) -> tuple[str, dict[str, str]]:
    """(the export's quant_algo, each module's for MIXED_PRECISION: its quantized_layers)."""
    hq = (read_json_if_any(path / "hf_quant_config.json") or {}).get("quantization") or {}
    qc = (read_json_if_any(path / "config.json") or {}).get("quantization_config") or {}
    layers = qc.get("quantized_layers") or hq.get("quantized_layers") or {}
    per = {
        m: str(e.get("quant_algo", "")).upper() for m, e in layers.items() if isinstance(e, dict)
    }
    return str(hq.get("quant_algo") or qc.get("quant_algo")), per


def _share_experts(inputs: dict[str, InputQuant]) -> dict[str, InputQuant]:
    """Static expert input scales made one per layer and input (gate+up, down), as vLLM does."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for m, q in inputs.items():
        hit = _EXPERT.match(m)
        if hit and q.scale is not None:
            groups.setdefault((hit["pre"], hit["proj"] in _GATE_UP), []).append(m)
    out = dict(inputs)
    for members in groups.values():
        scales = torch.stack([inputs[m].scale for m in members])  # type: ignore[misc]
        mode = inputs[members[0]].mode
        shared = scales.min() if mode in _GLOBAL_MODES else scales.max()
        for m in members:
            out[m] = InputQuant(mode, shared)
    return out


def _share_fused(inputs: dict[str, InputQuant], weights: dict) -> dict[str, InputQuant]:
    """Static input scales of a fused dense group (q/k/v, gate/up: one input) made one, as vLLM
    makes them: the max (FP8 ``input_scale``, compressed-tensors' NVFP4 global scale) of the
    values the files hold."""
    out = dict(inputs)
    for members in fused_groups(weights):
        qs = [inputs.get(m) for m in members]
        if ".experts." in members[0] or any(q is None or q.scale is None for q in qs):
            continue
        shared = torch.stack([q.scale for q in qs]).max()  # type: ignore[union-attr]
        for m, q in zip(members, qs, strict=True):
            out[m] = InputQuant(q.mode, shared)  # type: ignore[union-attr]
    return out


def _kv_scales(fetch: SafetensorsFetch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in fetch.index:
        for suffix, v_key in ((".k_proj.k_scale", ".v_proj.v_scale"), (".k_scale", ".v_scale")):
            if key.endswith(suffix):
                attn = key[: -len(suffix)]
                if attn + v_key in fetch.index and attn not in out:
                    k = fetch(key, None, None).to(torch.float32).reshape(-1).max()
                    v = fetch(attn + v_key, None, None).to(torch.float32).reshape(-1).max()
                    out[attn] = (k, v)
                break
    return out


def read_scheme(path: str | Path, fused: str = "vllm") -> ExportScheme:
    """The export at ``path`` as a client runs it; CheckpointError (one line) for a dir that is
    not a quantized export qckpt eval emulates. ``fused``: ``vllm`` (fused linears get one scale
    each, as vLLM gives them: :mod:`qckpt.evaluate.fused`) or ``as-stored``."""
    p = Path(path)
    index = hf_index(p)
    layout = source_layout(p, index)
    if not layout.quantized:
        raise CheckpointError(f"{p}: not a quantized export (no quantization_config)")
    smooth = [k for k in index if k.endswith(".pre_quant_scale")]
    if smooth:  # a per-channel input multiplier (AWQ / SmoothQuant) this emulation does not apply
        raise CheckpointError(f"{p}: {smooth[0]}: pre-quantization scales are not emulated")
    fetch = SafetensorsFetch(p, index)
    inputs: dict[str, InputQuant] = {}
    if layout.name == "compressed-tensors":
        qc = (read_json_if_any(p / "config.json") or {}).get("quantization_config") or {}
        groups = qc.get("config_groups") or {}
        for name in layout.weights:
            module = name[: -len(".weight")]
            g = _ct_group_of(groups, module)
            inputs[module] = _ct_input((g or {}).get("input_activations"), module, fetch)
    elif layout.name == "modelopt":
        algo, per_layer = _modelopt_algos(p)
        for name in layout.weights:
            module = name[: -len(".weight")]
            inputs[module] = _modelopt_input(per_layer.get(module, algo), module, fetch)
    else:
        for name in layout.weights:  # DeepSeek-style block FP8: dynamic per-group 128 inputs
            inputs[name[: -len(".weight")]] = InputQuant("fp8_group", group=128)
    requant, nvfp4_global, notes = plan_fused(layout.weights, fetch)
    inputs = _share_experts(inputs)
    if fused == "as-stored":
        requant, nvfp4_global, notes = {}, {}, []
    else:
        inputs = _share_fused(inputs, layout.weights)
    return ExportScheme(
        path=p,
        layout=layout,
        weights=dict(layout.weights),
        inputs=inputs,
        kv=_kv_scales(fetch),
        index=index,
        requant=requant,
        nvfp4_global=nvfp4_global,
        notes=notes,
    )
