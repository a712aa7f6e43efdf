"""Which scheme of a recipe quantizes each linear, checked against what clients fuse.

``quant.schemes`` is an ordered list: the first entry whose targets match a linear's name
quantizes it, a linear that no entry matches (or that ``quant.ignore`` matches) stays in the
model dtype. Serving stacks load some projections as one weight (q/k/v, gate/up, w1/w3, an
MoE layer's experts: :mod:`qckpt.models.fused`), and one weight has one quantization method,
so a recipe that gives two of them different schemes cannot be served: it is refused here, in
one line naming both modules, as is a target that matches no linear (a typo would otherwise
leave layers in BF16 without a word). Torch-free: ``qckpt plan`` and ``check`` call it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from qckpt.errors import SchemeError
from qckpt.models.fused import SCALE_FUSED_GROUPS
from qckpt.models.naming import ignore_matcher

# a per-expert linear in checkpoint naming: {...}.experts.{e}.{proj}
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")


def fused_key(module: str) -> str | None:
    """The one weight a client makes of ``module`` with others (its experts module, or its
    parent and fused group), or None when no client fuses it with anything."""
    m = _EXPERT.match(module)
    if m:
        return m["experts"]
    parent, _, leaf = module.rpartition(".")
    for gi, group in enumerate(SCALE_FUSED_GROUPS):
        if leaf in group:
            return f"{parent}#{gi}"
    return None


def _label(index: int | None, mixed: bool) -> str:
    if index is None:
        return "unquantized"
    return f"quant.schemes[{index}]" if mixed else "quant"


def assign_schemes(quant, modules: Iterable[str]) -> dict[str, int | None]:  # noqa: ANN001
    """Each linear's index into ``quant.entries()`` (None: model dtype); a ``SchemeError`` for
    a fused group split over schemes and for a target that matches no linear.

    ``quant`` is the recipe's ``QuantConfig``; ``modules`` the model's linears as the
    checkpoint names them (per-expert names for MoE)."""
    names = list(modules)
    # quant.entry_index's rule, its fnmatch patterns made into regexes once (a large MoE has
    # ~70k linears: one fnmatchcase per pattern per linear cost seconds)
    skip = ignore_matcher(quant.ignore)
    targets = [ignore_matcher(sc.targets) for sc in quant.entries()]

    def index(m: str) -> int | None:
        if skip(m):
            return None
        return next((i for i, hit in enumerate(targets) if hit(m)), None)

    out = {m: index(m) for m in names}
    if not quant.mixed:
        return out
    for i, sc in enumerate(quant.schemes):
        for j, pattern in enumerate(sc.targets):
            if not any(fnmatch.fnmatchcase(m, pattern) for m in names):
                raise SchemeError(
                    f"quant.schemes[{i}].targets[{j}]: {pattern!r} matches no linear of the model"
                )
    first: dict[str, str] = {}
    for m in names:
        key = fused_key(m)
        if key is None:
            continue
        other = first.setdefault(key, m)
        if out[other] != out[m]:
            raise SchemeError(
                f"quant.schemes: {other} ({_label(out[other], True)}) and {m} "
                f"({_label(out[m], True)}) are one weight in serving stacks; give them one scheme"
            )
    return out
