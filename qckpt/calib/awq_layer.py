"""One decoder layer as AWQ sees it: its groups (the linears that read one input), where each
group's rows come from, and how its scales fold into the op before it.

Groups, in the layer's order (every rank lists the same ones: experts of other EP ranks
included, so that the exchanges line up):

* ``input_layernorm``: every 2-D parameter of ``self_attn`` whose columns are the hidden size,
  ``o_proj`` aside (q/k/v; MLA's q_a / kv_a projections); the norm's weight is divided by ``s``;
* ``o_proj`` after ``v_proj``: v_proj's rows divided by ``s`` (attention is linear in v per
  channel). GQA: a KV head's row serves ``heads / kv_heads`` query heads, so their channels
  share one scale, searched on statistics pooled over those heads (``awq.pooled``). Skipped
  (and said so) when the shapes are not the plain MHA / GQA ones;
* ``post_attention_layernorm``: every 2-D parameter of ``mlp`` whose columns are the hidden
  size, the ``down_proj`` linears aside: a dense MLP's gate/up, a MoE block's router (folded,
  not quantized), every routed expert's gate and up (fused or per expert) and the shared
  experts': one search and one ``s`` for them all, since they read one norm;
* ``down_proj`` after ``up_proj`` in every gate/up/down MLP (a dense MLP, a shared expert, a
  per-expert expert) and in every fused expert (its own routed rows): up's rows divided by ``s``.

Rows ("sites"): a norm's output (a forward hook), a linear's input (a pre-hook), a fused
expert's routed rows (the instrumented forward's taps, ``{experts}:{e}:gate_up`` /
``{experts}:{e}:down``). A group's statistics come from one site (its ``stat``); each quantized
consumer's loss from the ``X^T X`` of the rows that reach it (an expert: its routed rows
only; q/k/v, or a dense MLP's gate/up, share the norm's).

What is refused (one line): a layer without ``self_attn`` / ``mlp`` / the two norms, or with a
norm between attention and MLP other than ``post_attention_layernorm`` (Gemma's
``pre_feedforward_layernorm``). Anything else a fold gets wrong (a norm that is not
``weight * x``, an MLP of another shape) is caught by the pass's check of the folded layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from qckpt.calib import awq
from qckpt.calib.instrument import ExpertsInfo, Instrumentation
from qckpt.errors import CalibrationError
from qckpt.formats.scheme import Scheme
from qckpt.models.naming import is_fused_experts


@dataclass
class Consumer:
    """A linear of a group whose output error the search measures (or only folds)."""

    key: str
    site: str  # where its rows come from (its input's X^T X)
    weight: Callable[[], torch.Tensor] | None  # its [out, in] weight here; None: another rank's
    wspec: Scheme | None  # its quantization; None: not quantized (folded only)
    ispec: Scheme | None = None  # its input's quantization (in the loss)


@dataclass
class Group:
    key: str  # the report's name (relative to the layer)
    stat: str  # the site of its statistics
    dim: int
    consumers: list[Consumer]
    # applies the scales (float64 [dim]) to the parameters here; the names it changed.
    # None: nothing of it here (another EP rank's expert)
    fold: Callable[[torch.Tensor], list[str]] | None
    tie: tuple[int, int, int] | None = None  # GQA: (heads, kv_heads, head_dim)

    @property
    def quantized(self) -> list[Consumer]:
        return [c for c in self.consumers if c.wspec is not None]


@dataclass
class LayerPlan:
    groups: list[Group] = field(default_factory=list)
    dense: dict[str, nn.Module] = field(default_factory=dict)  # site -> module (its input)
    norms: dict[str, nn.Module] = field(default_factory=dict)  # site -> module (its output)
    experts: list[tuple[ExpertsInfo, object]] = field(default_factory=list)  # (info, observer)
    skipped: list[str] = field(default_factory=list)
    # the layer's quantized weights (a view each, their spec): what the outputs pass quantizes
    quantized: list[tuple[Callable[[], torch.Tensor], Scheme]] = field(default_factory=list)

    @property
    def stats(self) -> dict[str, int]:
        """Every statistics site and its width, in group order (the exchanges' layout)."""
        out: dict[str, int] = {}
        for g in self.groups:
            out.setdefault(g.stat, g.dim)
        return out

    @property
    def inputs(self) -> dict[str, tuple[int, Scheme]]:
        """Every quantized consumer's input site whose input is quantized too: (its group's
        index, the input's spec), in group order."""
        out: dict[str, tuple[int, Scheme]] = {}
        for gi, g in enumerate(self.groups):
            for c in g.quantized:
                if c.ispec is not None:
                    out.setdefault(c.site, (gi, c.ispec))
        return out

    @property
    def hessians(self) -> dict[str, tuple[str, int, bool]]:
        """Every quantized consumer's input site: (the statistics site whose amax sets its
        grid, its width, whether it is here), in group order."""
        out: dict[str, tuple[str, int, bool]] = {}
        for g in self.groups:
            for c in g.quantized:
                here = c.weight is not None or (c.site in out and out[c.site][2])
                out[c.site] = (g.stat, g.dim, here)
        return out


def weight_spec(q) -> Scheme:
    """A weight quantizer's scheme (what AWQ's loss quantizes the weight as)."""
    return q.scheme


class _Specs:
    """The quantization of each weight / input the calibration quantizes (``on``: the
    enabled quantizers' ids, the caller pauses them while AWQ runs)."""

    def __init__(self, instr: Instrumentation, on: set[int]):
        self.q, self.on = instr.quantizers, on

    def _get(self, name: str, kind: str):
        q = self.q.get(f"{name}.{kind}_amax")
        return q if q is not None and id(q) in self.on else None

    def weight(self, name: str) -> Scheme | None:
        q = self._get(name, "weight")
        return None if q is None else weight_spec(q)

    def input(self, name: str) -> Scheme | None:
        q = self._get(name, "input")
        return None if q is None else awq.input_spec(q.scheme)

    def expert(self, info: ExpertsInfo, e: int, role: str) -> tuple[Scheme | None, Scheme | None]:
        wq, iq = info.weight_q.get(e, {}).get(role), info.input_q.get(e, {}).get(role)
        ws = weight_spec(wq) if wq is not None and id(wq) in self.on else None
        on_in = iq is not None and id(iq) in self.on
        return ws, awq.input_spec(iq.scheme) if on_in else None


def layer_plan(model: nn.Module, layer: nn.Module, prefix: str, instr, on: set[int]) -> LayerPlan:
    """The groups of decoder layer ``layer`` (named ``prefix``); see the module doc."""
    need = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    missing = [n for n in need if not isinstance(getattr(layer, n, None), nn.Module)]
    if missing or hasattr(layer, "pre_feedforward_layernorm"):
        what = f"has no {', '.join(missing)}" if missing else "has a pre_feedforward_layernorm"
        raise CalibrationError(
            f"calibrate.algorithm awq: {prefix} {what} (AWQ folds into input_layernorm before "
            "self_attn and post_attention_layernorm before mlp)"
        )
    specs = _Specs(instr, on)
    experts = {
        info.module_name: (info, mod.forward.observer)
        for info, mod in zip(instr.experts, instr.patched, strict=True)
        if info.module_name.startswith(prefix + ".")
    }
    plan = LayerPlan(experts=list(experts.values()))
    hidden = layer.input_layernorm.weight.shape[0]
    norm1, norm2 = f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"
    plan.norms = {norm1: layer.input_layernorm, norm2: layer.post_attention_layernorm}
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    plan.groups.append(
        _norm_group(plan, norm1, layer.self_attn, attn, hidden, "o_proj", specs, experts)
    )
    vo = _vo_group(plan, model, layer.self_attn, attn, specs)
    if vo is not None:
        plan.groups.append(vo)
    plan.groups.append(
        _norm_group(plan, norm2, layer.mlp, mlp, hidden, "down_proj", specs, experts)
    )
    for name, mod in layer.mlp.named_modules(prefix=mlp):
        if _mlp_like(mod):
            plan.groups.append(_down_group(plan, name, mod, specs, prefix))
        elif is_fused_experts(mod) and name in experts:
            plan.groups += _expert_down_groups(name, mod, *experts[name], specs, prefix)
    plan.quantized = _quantized_weights(model, instr, on, prefix)
    return plan


def _rel(name: str, prefix: str) -> str:
    return name[len(prefix) + 1 :] if name.startswith(prefix + ".") else name


def _norm_group(plan, site, region, region_name, hidden, skip, specs, experts) -> Group:
    """The consumers of the norm at ``site`` inside ``region`` (``skip``: the linears of the
    region that read something else), and the fold: the norm's weight (and bias) / s, every
    consumer's columns * s."""
    norm = plan.norms[site]
    cons: list[Consumer] = []
    params: list[tuple[str, torch.Tensor]] = []
    for name, mod in region.named_modules(prefix=region_name):
        if name.rpartition(".")[2] == skip:
            continue
        if is_fused_experts(mod):
            params.append((f"{name}.gate_up_proj", mod.gate_up_proj))
            if name in experts:
                cons += _expert_gate_up(name, mod, experts[name][0], specs)
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() != 2 or p.shape[-1] != hidden:
                continue
            params.append((f"{name}.{pname}", p))
            if isinstance(mod, nn.Linear) and pname == "weight":
                # a direct child of the region reads the norm's output itself (q/k/v; a dense
                # MLP's gate/up); deeper ones (per-expert experts, shared experts) their own
                direct = name.rpartition(".")[0] == region_name
                if not direct:
                    plan.dense[name] = mod
                where = site if direct else name
                cons.append(
                    Consumer(name, where, _getter(mod), specs.weight(name), specs.input(name))
                )
    norm_params = [(f"{site}.{n}", p) for n, p in norm.named_parameters(recurse=False)]
    if not norm_params or any(p.dim() != 1 or p.shape[0] != hidden for _, p in norm_params):
        raise CalibrationError(
            f"calibrate.algorithm awq: {site} has no per-channel weight of the hidden size to "
            "fold the scales into"
        )

    def fold(s: torch.Tensor) -> list[str]:
        for _, p in norm_params:
            awq.divide_rows_(p.data, s)
        for _, p in params:
            awq.scale_columns_(p.data, s)
        return [n for n, _ in norm_params] + [n for n, _ in params]

    return Group(_rel(site, site.rsplit(".", 1)[0]), site, hidden, cons, fold)


def _getter(mod: nn.Module) -> Callable[[], torch.Tensor]:
    return lambda: mod.weight.data


def _expert_gate_up(name: str, mod, info: ExpertsInfo, specs: _Specs) -> list[Consumer]:
    """Every global expert's gate and up (views of this rank's fused weight, or remote)."""
    row_of = {e: r for r, e in enumerate(info.local_ids)}
    inter = mod.gate_up_proj.shape[1] // 2
    out = []
    for e in range(info.num_experts):
        for role, lo in (("gate", 0), ("up", inter)):
            ws, ins = specs.expert(info, e, role)
            get = None
            if e in row_of:
                get = _fused_rows(mod, "gate_up_proj", row_of[e], lo, inter)
            out.append(Consumer(f"{name}:{e}:{role}", f"{name}:{e}:gate_up", get, ws, ins))
    return out


def _fused_rows(mod, attr: str, row: int, lo: int, n: int) -> Callable[[], torch.Tensor]:
    return lambda: getattr(mod, attr).data[row].narrow(0, lo, n)


def _head_shape(model: nn.Module, attn: nn.Module) -> tuple[int, int, int]:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hd = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    if not hd and heads:
        hd = int(cfg.hidden_size) // heads
    return heads, kv, int(hd or 0)


def _vo_group(plan: LayerPlan, model, attn: nn.Module, attn_name: str, specs) -> Group | None:
    """o_proj's group, folded into v_proj's rows (GQA: tied over the query heads of a KV
    head); None (and a line in ``plan.skipped``) where the shapes do not allow it."""
    v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
    if not isinstance(v, nn.Linear) or not isinstance(o, nn.Linear):
        plan.skipped.append("o_proj: no v_proj / o_proj linears")
        return None
    heads, kv, hd = _head_shape(model, attn)
    ok = heads and kv and hd and heads % kv == 0
    if not ok or o.in_features != heads * hd or v.out_features != kv * hd:
        plan.skipped.append("o_proj: v_proj's rows do not map onto o_proj's columns")
        return None
    o_name = f"{attn_name}.o_proj"
    plan.dense[o_name] = o
    rep = heads // kv
    params = [f"{attn_name}.v_proj.{n}" for n, _ in v.named_parameters(recurse=False)]

    def fold(s: torch.Tensor) -> list[str]:
        t = s.reshape(kv, rep, hd)[:, 0].reshape(-1)  # one value per v_proj row (tied)
        for p in v.parameters(recurse=False):
            awq.divide_rows_(p.data, t)
        awq.scale_columns_(o.weight.data, s)
        return [*params, f"{o_name}.weight"]

    cons = [Consumer(o_name, o_name, _getter(o), specs.weight(o_name), specs.input(o_name))]
    tie = (heads, kv, hd) if rep > 1 else None
    return Group("self_attn.o_proj", o_name, o.in_features, cons, fold, tie)


def _mlp_like(mod: nn.Module) -> bool:
    parts = [getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        return False
    return parts[1].out_features == parts[2].in_features


def _down_group(plan: LayerPlan, name: str, mod: nn.Module, specs, prefix: str) -> Group:
    """down_proj of a gate/up/down MLP, folded into up_proj's rows (and bias)."""
    up, down = mod.up_proj, mod.down_proj
    d_name = f"{name}.down_proj"
    plan.dense[d_name] = down
    params = [f"{name}.up_proj.{n}" for n, _ in up.named_parameters(recurse=False)]

    def fold(s: torch.Tensor) -> list[str]:
        for p in up.parameters(recurse=False):
            awq.divide_rows_(p.data, s)
        awq.scale_columns_(down.weight.data, s)
        return [*params, f"{d_name}.weight"]

    cons = [Consumer(d_name, d_name, _getter(down), specs.weight(d_name), specs.input(d_name))]
    return Group(_rel(d_name, prefix), d_name, down.in_features, cons, fold)


def _expert_down_groups(name, mod, info: ExpertsInfo, _obs, specs, prefix) -> list[Group]:
    """Every global expert's down_proj, on its routed rows, folded into its up rows."""
    row_of = {e: r for r, e in enumerate(info.local_ids)}
    inter = mod.down_proj.shape[2]
    out = []
    for e in range(info.num_experts):
        site = f"{name}:{e}:down"
        ws, ins = specs.expert(info, e, "down")
        row = row_of.get(e)
        get = None if row is None else _fused_rows(mod, "down_proj", row, 0, mod.down_proj.shape[1])
        fold = None if row is None else _expert_fold(mod, name, row, inter)
        cons = [Consumer(site, site, get, ws, ins)]
        out.append(Group(f"{_rel(name, prefix)}.{e}.down_proj", site, inter, cons, fold))
    return out


def _expert_fold(mod, name: str, row: int, inter: int) -> Callable[[torch.Tensor], list[str]]:
    def fold(s: torch.Tensor) -> list[str]:
        awq.divide_rows_(mod.gate_up_proj.data[row].narrow(0, inter, inter), s)
        awq.scale_columns_(mod.down_proj.data[row], s)
        return [f"{name}.gate_up_proj", f"{name}.down_proj"]

    return fold


def _quantized_weights(model, instr: Instrumentation, on: set[int], prefix: str):
    """(a getter of the view, its spec) of every quantized weight of the layer held here."""
    out = []
    for src in instr.weights:
        q = src.quantizer
        if id(q) in on and q.name.startswith(prefix + "."):
            param = model.get_parameter(src.param)
            out.append((_take(src, param), weight_spec(q)))
    return out


def _take(src, param) -> Callable[[], torch.Tensor]:
    return lambda: src.take(param.data)
