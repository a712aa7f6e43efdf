"""``qckpt search``'s choice: one candidate per unit, the least total error under a budget.

A unit is what a serving stack loads as one weight, so one scheme
(:func:`qckpt.models.schemes.fused_key`): q/k/v of one attention, gate/up of one MLP, every
expert of one routed-experts module; any other linear is a unit alone. A unit's cost under a
candidate is the bytes the export writes for its linears (:mod:`qckpt.search.sizes`), its
error the sum of its linears' ``E`` (:mod:`qckpt.search.sensitivity`).

Budget (:func:`parse_budget`): ``4.5bpw`` bounds the bits per weight over the linears the
search covers, ``8 * (their bytes as exported) / (their weights)``, scales, global scales and
the linears left in the model dtype included; a size (``18GB``, ``18GiB``, a byte count)
bounds the whole export, every other tensor (embeddings, norms, routers, ignored linears) at
the export's dtype counted too.

The choice is a multiple-choice knapsack solved exactly by dynamic programming over a byte
grid (:func:`choose`): each unit's extra bytes over its smallest candidate are rounded up to
``g = ceil(span / GRID)`` bytes (``span``: the sum over units of their largest minus smallest
cost; it depends on the model and candidates only, not on the budget), and the least total
error whose rounded extra fits is found. So: the choice always fits the budget (rounded costs
are upper bounds), it is optimal among the choices that fit with ``units * g`` bytes to spare
(at most ``units * span / GRID``: 0.005 % of the span for 100 units), a larger budget never
gives a larger total error (the grid does not move with it), the least budget gives every unit
its smallest candidate and a budget past the span the least-error candidate everywhere. Ties
go to the candidate listed first among the cheapest; every rank computes the same choice from
the same numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from qckpt.errors import UsageError
from qckpt.models.schemes import fused_key

GRID = 20000

_BPW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*bpw\s*$", re.I)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class Budget:
    text: str
    bpw: float | None = None  # bits per covered weight
    bytes: int | None = None  # the whole export

    def limit(self, weights: int, rest: int) -> int:
        """The bytes the covered linears may take (``weights``: their count, ``rest``: the
        export's other bytes)."""
        if self.bpw is not None:
            return math.floor(self.bpw * weights / 8)
        return int(self.bytes) - rest


def parse_budget(text: str | None) -> Budget:
    """``4.5bpw`` or a size (``18GB``, ``18GiB``, ``123456``); a one-line UsageError else."""
    if text is None or not str(text).strip():
        raise UsageError("--budget: give a budget, e.g. 4.5bpw or 18GB (or search.budget)")
    s = str(text)
    m = _BPW.match(s)
    if m:
        bpw = float(m.group(1))
        if not 0 < bpw <= 64:
            raise UsageError(f"--budget: {s!r}: bits per weight must be in (0, 64]")
        return Budget(s.strip(), bpw=bpw)
    m = _SIZE.match(s)
    if not m:
        raise UsageError(
            f"--budget: {s!r} is neither bits per weight (4.5bpw) nor a size (18GB, 18GiB)"
        )
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n < 1:
        raise UsageError(f"--budget: {s!r} must be positive")
    return Budget(s.strip(), bytes=n)


@dataclass
class Unit:
    """Linears that take one candidate; ``cost[c]`` bytes and ``error[c]`` E under candidate
    ``c`` (None: the export cannot write this unit in it)."""

    key: str
    modules: list[str]
    weights: int
    cost: list[int | None] = field(default_factory=list)
    error: list[float | None] = field(default_factory=list)

    def options(self) -> list[int]:
        """The candidates it can take, cheapest first (ties: the order listed)."""
        ok = [c for c, b in enumerate(self.cost) if b is not None and self.error[c] is not None]
        return sorted(ok, key=lambda c: (self.cost[c], c))


def units_of(modules: list[str]) -> list[tuple[str, list[str]]]:
    """The units of the covered linears, sorted by key: (key, its modules sorted)."""
    by: dict[str, list[str]] = {}
    for m in modules:
        by.setdefault(fused_key(m) or m, []).append(m)
    return [(k, sorted(v)) for k, v in sorted(by.items())]


@dataclass
class Choice:
    picks: list[int]  # per unit, the candidate index
    bytes: int  # the covered linears' bytes as exported
    error: float  # total E
    limit: int  # the bytes they were allowed
    minimum: int  # the least bytes they can take
    grid: int  # g of the module doc


def choose(units: list[Unit], limit: int, budget: Budget, min_text) -> Choice:  # noqa: ANN001
    """The choice of the module doc for ``limit`` bytes of covered linears; a UsageError
    (exit 2) naming the least budget (``min_text(bytes)``) when even that cannot fit."""
    opts = [u.options() for u in units]
    for u, o in zip(units, opts, strict=True):
        if not o:
            raise UsageError(f"search.candidates: no candidate can be exported for {u.key}")
    base = [u.cost[o[0]] for u, o in zip(units, opts, strict=True)]
    minimum = sum(base)
    if limit < minimum:
        raise UsageError(
            f"--budget {budget.text}: below the smallest export of these candidates, "
            f"{min_text(minimum)}"
        )
    span = sum(u.cost[o[-1]] - b for u, o, b in zip(units, opts, base, strict=True))
    g = max(1, -(-span // GRID))
    cap = min((limit - minimum) // g, -(-span // g) + len(units))
    # best[j]: least error of the units so far with rounded extra <= j
    best = np.zeros(cap + 1, dtype=np.float64)
    took = np.zeros((len(units), cap + 1), dtype=np.int16)
    for i, (u, o) in enumerate(zip(units, opts, strict=True)):
        new = np.full(cap + 1, np.inf)
        arg = np.zeros(cap + 1, dtype=np.int16)
        for slot, c in enumerate(o):
            r = -(-(u.cost[c] - base[i]) // g)
            if r > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[r:] = best[: cap + 1 - r] + u.error[c]
            better = cand < new  # strict: the earlier (cheaper) candidate keeps a tie
            new[better] = cand[better]
            arg[better] = slot
        best, took[i] = new, arg
    j = cap
    picks = [0] * len(units)
    for i in range(len(units) - 1, -1, -1):
        c = opts[i][int(took[i, j])]
        picks[i] = c
        j -= -(-(units[i].cost[c] - base[i]) // g)
    total = sum(u.cost[c] for u, c in zip(units, picks, strict=True))
    error = 0.0
    for u, c in zip(units, picks, strict=True):
        error += u.error[c]
    return Choice(picks, total, error, limit, minimum, g)
