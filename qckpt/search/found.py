"""What ``qckpt search`` writes: the found recipe and the report of its choice.

The found recipe is the input recipe as written (``--set`` overrides applied), with
``search`` removed and ``quant.schemes`` made of the choice: one entry per chosen candidate
that quantizes something, in the candidates' order, its targets the units that took it
(a routed-experts unit as ``{experts}.*``, any other unit as its modules' names); the units
that took the model dtype are matched by no entry and stay in it (``quant.ignore`` is kept as
it was). ``qckpt calibrate`` and ``qckpt export`` run it unchanged. Where every unit took
the model dtype, ``quant.ignore`` gets ``"*"`` instead (nothing to quantize).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from qckpt.formats.scheme import scheme_of

_EXPERT = re.compile(r"^.+\.experts\.\d+\.[^.]+$")


def label(candidate) -> str:  # noqa: ANN001 - a recipe CandidateConfig
    """How the report names a candidate: its weights' scheme, and its inputs' if quantized."""
    w = scheme_of(candidate.weights, "weight")
    if not w.quantized:
        return "model dtype"
    x = scheme_of(candidate.inputs, "input")
    return f"{w.describe()} / {x.describe()}" if x.quantized else f"{w.describe()} (weight-only)"


def unit_targets(key: str, modules: list[str]) -> list[str]:
    """The globs that match exactly a unit's modules."""
    if all(_EXPERT.match(m) for m in modules) and modules[0].startswith(key + "."):
        return [f"{key}.*"]
    return list(modules)


def schemes_of(units, picks: list[int], candidates) -> list[dict[str, Any]]:  # noqa: ANN001
    """The ``quant.schemes`` of a choice (module doc)."""
    out = []
    for c, cand in enumerate(candidates):
        if not scheme_of(cand.weights, "weight").quantized:
            continue
        targets = [t for u, p in zip(units, picks, strict=True) if p == c
                   for t in unit_targets(u.key, u.modules)]  # fmt: skip
        if targets:
            out.append({
                "targets": targets,
                "weights": dataclasses.asdict(cand.weights),
                "inputs": dataclasses.asdict(cand.inputs),
            })  # fmt: skip
    return out


def found_recipe(raw: dict, schemes: list[dict[str, Any]]) -> dict:
    """The input recipe's mapping with the choice in (module doc)."""
    out = {k: v for k, v in raw.items() if k != "search"}
    quant = {k: v for k, v in dict(out.get("quant") or {}).items()
             if k not in ("weights", "inputs", "schemes")}  # fmt: skip
    if schemes:
        quant["schemes"] = schemes
    else:
        quant["ignore"] = [*quant.get("ignore", ["lm_head", "*.mlp.gate"]), "*"]
    out["quant"] = quant
    return out


def report_of(units, choice, candidates, sens, budget, rest: int) -> dict[str, Any]:  # noqa: ANN001
    """The report: per unit its choice and the alternatives; the totals against the budget."""
    labels = [label(c) for c in candidates]
    weights = sum(u.weights for u in units)
    rows = []
    for u, p in zip(units, choice.picks, strict=True):
        rows.append({
            "unit": u.key,
            "linears": len(u.modules),
            "weights": u.weights,
            "chosen": labels[p],
            "candidate": p,
            "error": u.error[p],
            "bytes": u.cost[p],
            "errors": u.error,
            "costs": u.cost,
        })  # fmt: skip
    return {
        "budget": budget.text,
        "candidates": labels,
        "units": rows,
        "linears": sum(len(u.modules) for u in units),
        "weights": weights,
        "linear_bytes": choice.bytes,
        "bits_per_weight": 8 * choice.bytes / weights if weights else 0.0,
        "limit_bytes": choice.limit,
        "minimum_bytes": choice.minimum,
        "other_bytes": rest,
        "export_bytes": rest + choice.bytes,
        "error": choice.error,
        "grid_bytes": choice.grid,
        # the choice is optimal for a budget at most this much smaller (choose's module doc)
        "slack_bytes": choice.grid * len(units),
        "cold_inputs": list(sens.cold),
        "collectives": sens.collectives,
        "seconds": round(sens.seconds, 4),
    }
