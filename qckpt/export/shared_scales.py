"""Scales the export shares between modules, as serving stacks load them.

``share_moe_amax`` (``export.moe_scales: shared``, the default): what vLLM uses and ModelOpt
writes: one per-tensor weight scale (NVFP4: one ``weight_scale_2``) for an expert's gate and up,
from the larger of their two amaxes, and one static input scale per projection over all experts
of a layer (the max). ``per_expert`` writes each expert linear's own calibrated scales, for
clients that keep gate and up apart. Per-channel and per-block weight scales are never shared.

``share_fused_amax``: one NVFP4 global scale per weight that serving stacks fuse. vLLM loads
q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (DeepSeek's ``q_a_proj`` /
``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``) and keeps a single NVFP4 global scale for the
fused weight, the largest of the parts' ``weight_global_scale`` (compressed-tensors: the
smallest amax) or of their ``weight_scale_2`` (ModelOpt: the largest amax). A part whose own
global scale differs is then dequantized with another part's and comes out scaled by the ratio
of the two amaxes: on the shared real-text Llama, per-linear global scales gave 4.79 bits per
byte in vLLM 0.26 on an H200 (BF16 1.09). ModelOpt and llm-compressor both give the parts of a
fused weight one global amax, the largest; so does qckpt, before the block scales are made
under it. FP8 per-tensor weights are left apart: vLLM requantizes those to the largest scale
itself, and the files stay what earlier releases wrote.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qckpt.formats.scheme import scheme_of
from qckpt.layouts.export_layout import EXPERT
from qckpt.models.fused import fused_parts
from qckpt.models.naming import expert_roles
from qckpt.recipe import QuantConfig

QuantOf = Callable[[str], QuantConfig]


def _quant_of(quant: QuantConfig | QuantOf) -> QuantOf:
    return quant if callable(quant) else (lambda _m: quant)


def _per_tensor_weight(q: QuantConfig) -> bool:
    return scheme_of(q.weights, "weight").scalar_amax


def _static_input(q: QuantConfig) -> bool:
    return scheme_of(q.inputs, "input").calibrates("input")


def _memo(fn: Callable[[QuantConfig], bool]) -> Callable[[QuantConfig], bool]:
    """``fn`` asked once per config (thousands of expert pairs share a handful of them)."""
    seen: dict[int, tuple[QuantConfig, bool]] = {}

    def ask(q: QuantConfig) -> bool:
        got = seen.get(id(q))
        if got is None:
            got = seen[id(q)] = (q, fn(q))
        return got[1]

    return ask


def share_moe_amax(
    amax: dict[str, torch.Tensor],
    modules: list[str],
    quant: QuantConfig | QuantOf,
    model_type: str,
    *,
    values: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The amaxes behind ``export.moe_scales: shared`` (see the module doc); a new dict.
    ``values``: one-value amaxes already read as floats (the plan's check makes them), by key.
    ``quant``: the recipe's one-scheme config, or each module's (the experts of one layer have
    one scheme).

    Per-tensor weight amax (FP8 ``tensor``, NVFP4's global amax): an expert's gate and up both
    get the larger of the two. Static input amax: every expert of a layer gets the max over the
    layer's experts, one for gate/up (they read the same input) and one for down.
    """
    roles = expert_roles(model_type)
    quant_of = _quant_of(quant)
    per_tensor_w, static_in = _memo(_per_tensor_weight), _memo(_static_input)
    pairs: dict[tuple[str, str], list[str]] = {}  # (experts, e) -> gate/up modules
    layer_in: dict[tuple[str, str], list[str]] = {}  # (experts, "gate_up"|"down") -> modules
    for m in modules:
        hit = EXPERT.match(m)
        role = roles.get(hit["proj"]) if hit else None
        if role is None:
            continue
        side = "down" if role == "down" else "gate_up"
        if side == "gate_up":
            pairs.setdefault((hit["experts"], hit["e"]), []).append(m)
        layer_in.setdefault((hit["experts"], side), []).append(m)
    out = dict(amax)
    got = values or {}
    ties: list[tuple[list[str], int]] = []  # (keys tied, the one whose value they all get)

    def tie(names: list[str], kind: str) -> None:
        keys = [k for k in (f"{n}.{kind}_amax" for n in names) if k in amax]
        if len(keys) > 1:
            # the largest as a Python float (exact for float32 amaxes; NaN wins, as in a
            # tensor max): thousands of expert pairs, a stack and a max each cost seconds, and
            # so did three tensor ops per amax (18k experts: 0.9 s)
            vals = [got[k] if k in got else float(amax[k]) for k in keys]
            i = next((j for j, v in enumerate(vals) if v != v), None)
            if i is None:
                i = max(range(len(vals)), key=vals.__getitem__)
            ties.append((keys, i))

    for names in pairs.values():
        if per_tensor_w(quant_of(names[0])):
            tie(names, "weight")
    for names in layer_in.values():
        if static_in(quant_of(names[0])):
            tie(names, "input")
    # each tie's value as its own float32 0-d tensor; from the floats in one call when every
    # winner's value is known finite (``values`` come from a finiteness check), else a clone
    # of the winner (a NaN keeps its bits)
    known = all(keys[i] in got for keys, i in ties)
    if known and ties:
        tops = torch.tensor([got[keys[i]] for keys, i in ties], dtype=torch.float32).unbind()
    else:
        tops = [amax[keys[i]].detach().float().reshape(()).clone() for keys, i in ties]
    for (keys, _), top in zip(ties, tops, strict=True):
        shaped = {(): top}
        for k in keys:
            shape = tuple(amax[k].shape)
            t = shaped.get(shape)
            if t is None:
                t = shaped[shape] = top.reshape(shape)
            out[k] = t
    return out


def share_fused_amax(
    amax: dict[str, torch.Tensor], modules: list[str], quant: QuantConfig | QuantOf
) -> dict[str, torch.Tensor]:
    """``amax`` with each fused group's per-tensor ``{kind}_amax`` set to the group's largest,
    where the group's scheme has a global scale clients keep one of (NVFP4: the weights', and
    the static inputs'); a new dict. ``quant``: as :func:`share_moe_amax`'s (a fused group has
    one scheme). Amaxes that are not one value (per-channel, per-block) are left alone."""
    out = dict(amax)
    quant_of = _quant_of(quant)
    for group in fused_parts(modules):
        q = quant_of(group[0])
        if not scheme_of(q.weights, "weight").fused_global:
            continue
        kinds = ("weight", "input") if _static_input(q) else ("weight",)
        for kind in kinds:
            keys = [k for k in (f"{m}.{kind}_amax" for m in group) if k in amax]
            if len(keys) < 2 or any(amax[k].numel() != 1 for k in keys):
                continue
            # torch's max propagates a NaN, so the export's finiteness check still sees it
            top = torch.stack([amax[k].detach().float().reshape(()) for k in keys]).max()
            for k in keys:
                out[k] = top.clone().reshape(amax[k].shape)
    return out
