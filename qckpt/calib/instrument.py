"""Putting quantizers into a model, non-destructively, and taking them out again.

* Every ``nn.Linear`` not matched by ``quant.ignore`` gets a weight and an input quantizer; the
  input is observed by a forward pre-hook.
* transformers 5 keeps a MoE block's routed experts fused (``experts.gate_up_proj`` [E, 2I, H],
  ``experts.down_proj`` [E, H, I]). Each expert gets its own weight quantizers (gate, up, down:
  slices of the fused weights, named as ``save_pretrained`` names them, see
  :func:`qckpt.models.naming.expert_slices`) and its own input quantizers. An expert's input
  quantizer must see only the tokens routed to it, which no hook on the fused module can tell
  apart, so the experts' ``forward`` is replaced (on the instance only) by one of
  :mod:`qckpt.calib.moe_forward` (eager: transformers' eager loop's GEMMs, or grouped GEMMs),
  which takes every expert's input amax as one segmented max over the routed tokens. gate and
  up read the same input and get the same amax.

Quantized-resident weights (``calibrate.weights_resident``): transformers' own experts forwards
cannot run on a quantized fused weight: the eager loop indexes ``gate_up_proj[expert_idx]`` (a
partial ``aten.select``, which ``QuantizedTensor`` refuses rather than dequantize the whole
tensor), ``batched_mm`` gathers ``gate_up_proj[expert_ids]`` (an index per token) and
``grouped_mm`` hands the whole 3-D weights to ``torch._grouped_mm``. The loop here asks for one
expert at a time (:func:`qckpt.formats.tensor.select_dequantized`): only that expert is
dequantized, and only for its two matmuls.

Nothing is registered as a submodule, parameter or buffer, so ``state_dict`` and
``named_modules`` are unchanged and :func:`remove_quantizers` restores the model exactly.

Under expert parallelism a rank holds only some experts: the ``ShardSpec`` of the fused
``gate_up_proj`` (:mod:`qckpt.parallel.shard`) gives their global ids and the global count.
Quantizers are still made for every global expert, so that every rank lays out the sync buffers
identically; those of remote experts are ``local=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from qckpt.calib.moe_forward import ExpertsObserver, MoeChoice, experts_forward
from qckpt.calib.quantizer import DTYPE_CODE, GRANULARITIES, AmaxStore, TensorQuantizer
from qckpt.errors import CalibrationError, FormatError, SchemeError
from qckpt.formats.scheme import SCHEMES, Fp8Scheme, Scheme, scheme_of
from qckpt.formats.tensor import is_quantized
from qckpt.models.naming import expert_slices, ignored, is_fused_experts
from qckpt.models.schemes import assign_schemes
from qckpt.parallel.shard import shard_of
from qckpt.recipe import QuantConfig

_ATTR = "_qckpt_instrumentation"


@dataclass
class ExpertsInfo:
    """One instrumented fused-experts module."""

    module_name: str
    num_experts: int  # global
    local_ids: list[int]
    # per global expert: quantizers by role ("gate", "up", "down") and kind
    weight_q: dict[int, dict[str, TensorQuantizer]] = field(default_factory=dict)
    input_q: dict[int, dict[str, TensorQuantizer]] = field(default_factory=dict)
    # tokens routed to each global expert on this rank, since instrumentation
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WeightSource:
    """Where a weight quantizer's values live: the parameter ``param`` (state-dict name) and
    ``take(tensor)``, the part of that parameter it calibrates (one expert's gate rows, ...).
    The same ``take`` reads the model's parameter or, during a load, the checkpoint's value
    of it (:mod:`qckpt.calib.weight_amax`)."""

    quantizer: TensorQuantizer
    param: str
    take: Callable[[torch.Tensor], torch.Tensor]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Instrumentation:
    quantizers: dict[str, TensorQuantizer]
    weights: list[WeightSource]
    experts: list[ExpertsInfo]
    hooks: list = field(default_factory=list)
    patched: list[nn.Module] = field(default_factory=list)
    # calibrate.moe_forward as asked and as run (auto decides on the first experts call)
    moe: MoeChoice = field(default_factory=lambda: MoeChoice(asked="eager"))


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", "") or ""


def insert_quantizers(
    model: nn.Module,
    quant_cfg: QuantConfig,
    *,
    share_expert_inputs: bool = True,
    calib_dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    moe_forward: str = "auto",
) -> dict[str, TensorQuantizer]:
    """Instrument ``model``; returns the quantizers keyed ``{hf_module}.{weight|input}_amax``.

    The amaxes live on each module's weight's device, or on ``device`` when given (a model
    built on meta whose layers come onto the device one at a time: :mod:`qckpt.calib.layerwise`).
    ``moe_forward``: the experts' instrumented forward, ``auto``, ``eager`` or ``grouped``
    (:mod:`qckpt.calib.moe_forward`); what ran: ``instrumentation(model).moe``.
    """
    choice = MoeChoice(asked=moe_forward)  # an unknown name: one line, before anything changes
    if getattr(model, _ATTR, None) is not None:
        raise CalibrationError("model already has quantizers; call remove_quantizers first")
    ignore = list(quant_cfg.ignore)
    mtype = _model_type(model)
    # every linear's scheme, checked (fused groups, targets that match nothing) before any
    # quantizer is made: a bad mixed recipe is one line and exit 2, before any data runs
    entries = _entries(model, quant_cfg, ignore, mtype)
    instr = Instrumentation(quantizers={}, weights=[], experts=[], moe=choice)
    # one store for every amax (one bank per device inside): the sync then moves the per-tensor
    # ones as one tensor per device
    store = AmaxStore(capacity=1024)
    schemes = _SchemeCache(quant_cfg)

    def make(name: str, kind: str, shape, dev, *, entry: int, **kw) -> TensorQuantizer:
        sch = schemes.get(entry, kind)
        q = TensorQuantizer(
            name,
            kind,
            shape=shape,
            granularity=sch.calib_granularity,
            scheme=sch,
            store=store,
            block_size=sch.block,
            # a dynamic input is scaled per batch at run time: nothing to calibrate or sync
            enabled=sch.calibrates(kind),
            calib_dtype=calib_dtype,
            device=device or dev,
            **kw,
        )
        instr.quantizers[q.key] = q
        return q

    for name, mod in model.named_modules():
        entry = entries.get(name)
        if entry is None:
            continue
        if isinstance(mod, nn.Linear):
            dev = device or mod.weight.device
            wq = make(name, "weight", tuple(mod.weight.shape), dev, entry=entry)
            iq = make(name, "input", (mod.in_features,), dev, entry=entry)
            instr.weights.append(WeightSource(wq, f"{name}.weight", _whole))
            instr.hooks.append(mod.register_forward_pre_hook(_input_hook(iq)))
            if quant_cfg.kv_cache and name.rpartition(".")[2] in ("k_proj", "v_proj"):
                # the KV-cache scales: the cache holds these outputs (k after its norm and
                # rotary, which a per-tensor amax of k_proj's output bounds only approximately)
                oq = TensorQuantizer(
                    name, "output", shape=(mod.out_features,), granularity="tensor",
                    scheme=KV_SCHEME, calib_dtype=calib_dtype, device=dev, store=store,
                )  # fmt: skip
                instr.quantizers[oq.key] = oq
                instr.hooks.append(mod.register_forward_hook(_output_hook(oq)))
        else:
            mk = partial(make, entry=entry)
            _instrument_experts(name, mod, mtype, mk, instr, share_expert_inputs)
    object.__setattr__(model, _ATTR, instr)
    return dict(instr.quantizers)


KV_SCHEME = Fp8Scheme()  # the KV cache's scales: FP8 per tensor, whatever the linears' scheme


class _SchemeCache:
    """Each recipe entry's weight and input :class:`Scheme`, made once (an MoE has thousands
    of expert linears of a few entries)."""

    def __init__(self, quant_cfg: QuantConfig) -> None:
        self.entries = quant_cfg.entries()
        self.made: dict[tuple[int, str], Scheme] = {}

    def get(self, entry: int, kind: str) -> Scheme:
        got = self.made.get((entry, kind))
        if got is None:
            e = self.entries[entry]
            got = self.made[(entry, kind)] = entry_scheme(
                e.weights if kind == "weight" else e.inputs, kind
            )
        return got


def entry_scheme(cfg, kind: str) -> Scheme:  # noqa: ANN001 - a recipe TensorQuantConfig
    """``cfg``'s scheme; one the scheme seam refuses for its granularity is made as
    calibration always made it (its calibrated granularity is the scheme's own: an NVFP4
    weight asked per channel calibrates its global amax, as before schemes existed)."""
    try:
        return scheme_of(cfg, kind)
    except FormatError as exc:
        cls = SCHEMES.get(cfg.format)
        if cls is None:
            raise
        made = cls(granularity=cfg.granularity, block=tuple(cfg.block_size), dynamic=cfg.dynamic)
        if made.calib_granularity not in GRANULARITIES:
            # nothing could calibrate it (INT8 per group): refused in one line, exit 2
            raise SchemeError(f"quant: {exc}") from None
        return made


def _entries(model: nn.Module, quant_cfg: QuantConfig, ignore, mtype: str) -> dict[str, int]:
    """Instrumented module -> its index into ``quant_cfg.entries()``; linears and fused
    experts modules no entry quantizes are absent. :func:`assign_schemes` sees every linear
    in checkpoint naming (each expert's gate / up / down): a recipe that splits a fused group
    or names a target no linear has raises its ``SchemeError`` here."""
    names: list[str] = []
    first: dict[str, str] = {}  # a module -> the checkpoint name its scheme is resolved from
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            names.append(name)
            first[name] = name
        elif is_fused_experts(mod):
            got = [s.hf_module for s in expert_slices(name, mtype, *_expert_shapes(mod))]
            names.extend(got)
            if got:
                first[name] = got[0]  # every expert of one module has one scheme (checked)
    assign_schemes(quant_cfg, names)
    out: dict[str, int] = {}
    for name, hf in first.items():
        if ignored(name, ignore):
            continue
        # one scheme: the ignore list above is the whole rule, as before schemes existed
        i = quant_cfg.entry_index(hf) if quant_cfg.mixed else 0
        if i is not None:
            out[name] = i
    return out


def _expert_shapes(mod: nn.Module) -> tuple[torch.Size, torch.Size]:
    """The global shapes of a fused experts module's two weights (an EP shard's ids too)."""
    gu, dn = mod.gate_up_proj, mod.down_proj
    spec = shard_of(mod, "gate_up_proj")
    n = spec.total if spec is not None else gu.shape[0]
    return torch.Size((n, *gu.shape[1:])), torch.Size((n, *dn.shape[1:]))


def _input_hook(q: TensorQuantizer):
    observe = q.observe  # bound once: the hook runs per module call, its Python is overhead

    def hook(_mod, args):
        if args:  # no host sync in the forward: the store checks finiteness when settled
            observe(args[0])

    return hook


def _output_hook(q: TensorQuantizer):
    observe = q.observe

    def hook(_mod, _args, out):
        observe(out)

    return hook


def _instrument_experts(name, mod, mtype, make, instr: Instrumentation, share: bool) -> None:
    for attr, ok in (("is_transposed", False), ("has_bias", False), ("has_gate", True)):
        if getattr(mod, attr, ok) != ok:
            raise CalibrationError(
                f"{name}: experts layout with {attr}={not ok} is not supported for calibration"
            )
    if getattr(mod, "is_concatenated", True) is not True:
        raise CalibrationError(f"{name}: interleaved gate/up experts are not supported")
    gu, dn = mod.gate_up_proj, mod.down_proj
    n_local = gu.shape[0]
    spec = shard_of(mod, "gate_up_proj")
    local_ids = list(spec.indices) if spec is not None else list(range(n_local))
    n_global = spec.total if spec is not None else n_local
    if len(local_ids) != n_local:
        raise CalibrationError(f"{name}: its shard has {len(local_ids)} ids for {n_local} experts")
    row_of = {e: r for r, e in enumerate(local_ids)}
    info = ExpertsInfo(module_name=name, num_experts=n_global, local_ids=local_ids)
    info.tokens = [0] * n_global
    gshape = torch.Size((n_global, *gu.shape[1:]))
    dshape = torch.Size((n_global, *dn.shape[1:]))
    dev = gu.device  # make() puts it on insert_quantizers' device when one is given
    for s in expert_slices(name, mtype, gshape, dshape):
        local = s.expert in row_of
        fused = gu if s.role in ("gate", "up") else dn
        wshape = (s.rows, fused.shape[2])
        common = dict(local=local, expert_layer=name, expert=s.expert)
        wq = make(s.hf_module, "weight", wshape, dev, **common)
        group = f"{name}:{'gate_up' if s.role != 'down' else 'down'}_input" if share else None
        iq = make(s.hf_module, "input", (fused.shape[2],), dev, share_group=group, **common)
        info.weight_q.setdefault(s.expert, {})[s.role] = wq
        info.input_q.setdefault(s.expert, {})[s.role] = iq
        if local:
            take = partial(_expert_rows, row=row_of[s.expert], start=s.row_start, rows=s.rows)
            instr.weights.append(WeightSource(wq, s.param_name, take))
    instr.experts.append(info)
    obs = ExpertsObserver([info.input_q[e] for e in local_ids], info.tokens, local_ids)
    if is_quantized(gu) or is_quantized(dn):
        instr.moe.held_quantized()
    mod.forward = experts_forward(mod, obs, instr.moe)
    instr.patched.append(mod)


def _expert_rows(fused: torch.Tensor, *, row: int, start: int, rows: int) -> torch.Tensor:
    return fused[row].narrow(0, start, rows)


def instrumentation(model: nn.Module) -> Instrumentation:
    instr = getattr(model, _ATTR, None)
    if instr is None:
        raise CalibrationError("model has no quantizers; call insert_quantizers first")
    return instr


def calibrate_weights(
    model: nn.Module,
    given: Mapping[str, torch.Tensor] | None = None,
    *,
    within: Callable[[str], bool] | None = None,
) -> int:
    """Weight amax from the weights themselves, for every local quantizer (cold experts too).

    ``given`` (quantizer key -> amax) holds amaxes already taken from the checkpoint's values
    (:mod:`qckpt.calib.weight_amax`): those quantizers take them as they are. A quantized
    weight must be among them: its dequantized codes are not the checkpoint's values.
    ``within``: only the quantizers whose module name it accepts (one decoder layer, when the
    layers come onto the device one at a time: :mod:`qckpt.calib.layerwise`).
    """
    instr = instrumentation(model)
    given = given or {}
    todo: list[WeightSource] = []
    n = 0
    for src in instr.weights:
        q = src.quantizer
        if not q.enabled or (within is not None and not within(q.name)):
            continue
        n += 1
        if q.key in given:
            q.amax = given[q.key]
        else:
            todo.append(src)
    with torch.no_grad():
        for src in fused_expert_amax(model, todo):
            q = src.quantizer
            w = model.get_parameter(src.param)
            if is_quantized(w):
                raise CalibrationError(
                    f"{q.key}: the weight {src.param} is held quantized and its amax was not "
                    "taken from the checkpoint while loading"
                )
            # no host sync per weight: the store checks finiteness once, when settled
            q.collect(src.take(w), check=False)
    return n


def fused_expert_amax(model: nn.Module, sources: list[WeightSource]) -> list[WeightSource]:
    """The per-tensor amaxes of the experts' slices of each fused weight at once; returns the
    sources left to take one by one.

    A fused ``[E, R, C]`` weight whose slices (gate rows, up rows; down's whole matrix) all
    have the same number of rows ``r`` that tiles ``R`` is viewed as ``[E * R / r, r * C]``;
    one ``aminmax`` per row gives every slice's ``max(-min, max)``, which is ``|x|``'s max
    exactly (the ``abs`` after it turns an all-zero slice's -0.0 into the 0.0 ``abs().amax()``
    gives; a NaN propagates, and the settle names it as before). One reduction and one fold
    per fused weight instead of a few small kernels per expert.
    """
    groups: dict[str, list[WeightSource]] = {}
    rest: list[WeightSource] = []
    for src in sources:
        take = src.take
        if getattr(take, "func", None) is _expert_rows and src.quantizer.is_scalar:
            groups.setdefault(src.param, []).append(src)
        else:
            rest.append(src)
    for param, group in groups.items():
        w = model.get_parameter(param)
        kws = [s.take.keywords for s in group]
        r = kws[0]["rows"]
        if (
            is_quantized(w)
            or w.dim() != 3
            or w.shape[1] % r
            or any(k["rows"] != r or k["start"] % r for k in kws)
        ):
            rest.extend(group)
            continue
        k = w.shape[1] // r
        lo, hi = torch.aminmax(w.reshape(w.shape[0] * k, -1), dim=1)
        seg = torch.maximum(-lo, hi).abs()
        at = torch.tensor([kw["row"] * k + kw["start"] // r for kw in kws], device=seg.device)
        vals = seg.index_select(0, at)
        by_bank: dict[tuple, list[int]] = {}
        for i, s in enumerate(group):
            q = s.quantizer
            by_bank.setdefault((id(q.bank), q.calib_dtype), []).append(i)
        for (_, dtype), ix in by_bank.items():
            qs = [group[i].quantizer for i in ix]
            part = vals if len(ix) == len(group) else vals[torch.tensor(ix, device=vals.device)]
            qs[0].bank.fold_max([q.slot for q in qs], part.to(dtype), DTYPE_CODE[dtype])
            qs[0].store.unchecked = qs[0].store.dirty = True  # checked when settled
    return rest


def settle(model: nn.Module) -> None:
    """Fold what the forwards deferred into the quantizers (one host sync per store), raising
    the non-finite error a hook would have raised; calibration calls it after its forwards."""
    seen = set()
    for q in instrumentation(model).quantizers.values():
        if id(q.store) not in seen:
            seen.add(id(q.store))
            q.store.settle()


def remove_quantizers(model: nn.Module) -> dict[str, TensorQuantizer]:
    """Undo :func:`insert_quantizers`; returns the quantizers (with their amax) for reuse."""
    instr = getattr(model, _ATTR, None)
    if instr is None:
        return {}
    for h in instr.hooks:
        h.remove()
    for mod in instr.patched:
        mod.__dict__.pop("forward", None)
    object.__delattr__(model, _ATTR)
    return instr.quantizers
