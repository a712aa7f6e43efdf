"""What each scheme of a recipe quantizes, for ``qckpt plan``: linears, calibrated amaxes and
the bytes the export writes, every linear figured by its own scheme.

The recipe's schemes are assigned to the model's linears as the checkpoint names them
(:func:`qckpt.models.schemes.assign_schemes`: per-expert names for MoE), so a recipe that
splits a fused group, has a target that matches nothing, or asks a scheme for a granularity it
does not take is refused here, in one line (exit 2), before any figure is made. A one-scheme
recipe is one entry matching every linear that ``ignore`` leaves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from qckpt.errors import FormatError, SchemeError
from qckpt.formats.scheme import Scheme, scheme_bits, scheme_of
from qckpt.models.naming import expert_slices, is_fused_experts, is_router
from qckpt.models.schemes import assign_schemes

if TYPE_CHECKING:
    from torch import nn

AMAX_BYTES = 4  # a calibrated amax is float32


@dataclass(frozen=True)
class Linear:
    shape: tuple[int, int]  # the weight's (out, in)
    module: str  # the model's module holding it (a fused experts module for an expert)


def checkpoint_linears(model: nn.Module, model_type: str) -> dict[str, Linear]:
    """Every linear of ``model`` (on meta is enough) as the checkpoint names it: per-expert
    linears of fused experts; routers left out (no scheme quantizes one: they stay in the
    model dtype)."""
    from torch import nn

    out: dict[str, Linear] = {}
    for name, mod in model.named_modules():
        if is_router(name, mod):
            continue
        if isinstance(mod, nn.Linear):
            out[name] = Linear((int(mod.out_features), int(mod.in_features)), name)
        elif is_fused_experts(mod):
            gu, dn = mod.gate_up_proj.shape, mod.down_proj.shape
            for sl in expert_slices(name, model_type, gu, dn):
                cols = int(gu[-1]) if sl.role != "down" else int(dn[-1])
                out[sl.hf_module] = Linear((int(sl.rows), cols), name)
    return out


@dataclass(kw_only=True)
class SchemeRow:
    """One recipe entry (or the linears no entry quantizes) in a plan."""

    entry: str  # quant | quant.schemes[i] | unquantized
    weights: str
    inputs: str
    linears: int = 0
    parameters: int = 0
    export_bytes: int = 0  # the linears' codes and scales as the export stores them
    amax_bytes: int = 0  # what calibration records for them (float32 amaxes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.export_bytes / self.parameters if self.parameters else 0.0


@dataclass(kw_only=True)
class SchemePlan:
    rows: list[SchemeRow] = field(default_factory=list)
    mixed: bool = False  # quant.schemes (a one-scheme recipe's plan reads as it did before)
    other_bytes: int = 0  # embeddings, norms, routers, biases: at the model dtype
    # the model's modules no scheme quantizes (what calibration keeps no statistics for)
    unquantized: frozenset[str] = frozenset()

    def quantizes(self, module: str) -> bool:
        """Whether a scheme quantizes the model's ``module`` (a fused experts module: its
        experts, which share one scheme)."""
        return module not in self.unquantized

    @property
    def export_bytes(self) -> int:
        return self.other_bytes + sum(r.export_bytes for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schemes": [{**asdict(r), "bits_per_weight": r.bits_per_weight} for r in self.rows],
            "export_bytes": self.export_bytes,
            "other_bytes": self.other_bytes,
        }  # fmt: skip


def _schemes(quant: Any) -> list[tuple[Scheme, Scheme]]:
    """(weights, inputs) scheme of each entry; a granularity a scheme does not take is refused
    in one line naming the entry."""
    out = []
    for i, entry in enumerate(quant.entries()):
        where = f"quant.schemes[{i}]" if quant.mixed else "quant"
        pair = []
        for kind, cfg in (("weight", entry.weights), ("input", entry.inputs)):
            try:
                pair.append(scheme_of(cfg, kind))
            except FormatError as exc:
                raise SchemeError(f"{where}.{kind}s: {exc}") from None
        out.append((pair[0], pair[1]))
    return out


def _amax_numel(s: Scheme, kind: str, shape: tuple[int, int]) -> int:
    if not s.calibrates(kind):
        return 0
    return max(1, math.prod(s.amax_shape(kind, shape if kind == "weight" else (shape[1],))))


def plan_schemes(
    quant: Any, linears: dict[str, Linear], model_bytes: int, itemsize: int
) -> SchemePlan:
    """Each entry's linears, amaxes and export bytes (``model_bytes``: the whole model at its
    dtype of ``itemsize`` bytes). Raises ``SchemeError`` (exit 2) for a recipe no export of
    this model can be made of."""
    schemes = _schemes(quant)
    assigned = assign_schemes(quant, linears)
    plain = SchemeRow(entry="unquantized", weights="unquantized", inputs="unquantized")
    rows = [
        SchemeRow(
            entry=f"quant.schemes[{i}]" if quant.mixed else "quant",
            weights=w.describe(),
            inputs=x.describe(),
        )
        for i, (w, x) in enumerate(schemes)
    ]
    bits = 8 * itemsize
    unquantized = set()
    sized: dict[tuple[int, tuple[int, int]], tuple[int, int]] = {}  # a model repeats shapes
    for name, lin in linears.items():
        i, shape = assigned[name], lin.shape
        row = plain if i is None else rows[i]
        n = math.prod(shape)
        row.linears += 1
        row.parameters += n
        if i is None:
            row.export_bytes += n * itemsize
            unquantized.add(lin.module)
            continue
        if (i, shape) not in sized:
            w, x = schemes[i]
            amaxes = _amax_numel(w, "weight", shape) + _amax_numel(x, "input", shape)
            # a static input scale is one more float32 the export stores beside the weight
            scale_in = AMAX_BYTES * _amax_numel(x, "input", shape)
            stored = math.ceil(scheme_bits(w, shape, bits) / 8) + scale_in
            sized[i, shape] = (AMAX_BYTES * amaxes, stored)
        amax_bytes, stored = sized[i, shape]
        row.amax_bytes += amax_bytes
        row.export_bytes += stored
    linear_bytes = sum(math.prod(x.shape) for x in linears.values()) * itemsize
    used = [r for r in rows if r.linears] + ([plain] if plain.linears else [])
    return SchemePlan(
        rows=used,
        mixed=bool(quant.mixed),
        other_bytes=max(0, model_bytes - linear_bytes),
        unquantized=frozenset(unquantized),
    )
