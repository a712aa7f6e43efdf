"""Layouts: how the ranks split a model (EP x TP) and how calibration holds it.

A :class:`Layout` is what a user sets in the recipe (``parallel.ep``, ``parallel.tp``,
``calibrate.weights_resident``, ``calibrate.offload``); :meth:`Layout.overrides` says it as
``--set`` arguments. :func:`candidates` lists the ones worth planning for a world, and
:func:`preference` orders them: the suggestion is the first that fits.

A layout holding weights or activations in host memory is suggested only when the host memory
is given. Order of preference (the "smallest" layout): no offload before host offload before layer
offload (offload re-reads or copies every layer and is the slowest), activations kept on the
device before on the host (copied both ways for every layer); BF16-resident weights
before quantized ones (calibration statistics from the model's own values); then the fewest
model-parallel ranks (ep x tp: the rest of the world is data parallel, the cheapest split), but
with offload the most (every rank reads its share of the weights, EP each expert once);
then EP before TP (expert-parallel results are bit-identical to one process, TP's to rounding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qckpt.errors import UsageError

# calibrate.weights_resident and calibrate.offload values (issue 17)
RESIDENT_FORMATS = ("bf16", "fp8", "fp8_block", "mxfp8")
OFFLOADS = ("none", "layer", "host")
ACTIVATIONS = ("device", "host")  # calibrate.activations: where offload keeps layer outputs
_KEYS = ("ep", "tp", "resident", "offload", "activations")
_CHOICES = {"resident": RESIDENT_FORMATS, "offload": OFFLOADS, "activations": ACTIVATIONS}


@dataclass(frozen=True, kw_only=True)
class Layout:
    ep: int = 1
    tp: int = 1
    resident: str = "bf16"
    offload: str = "none"
    activations: str = "device"

    @property
    def model_parallel(self) -> int:
        return self.ep * self.tp

    def dp(self, world: int) -> int:
        return world // self.model_parallel

    @property
    def quantized_resident(self) -> bool:
        """Weights held quantized while calibrating (not in the model dtype, the default)."""
        return self.resident != Layout.resident

    @property
    def offloaded(self) -> bool:
        """Weights waiting off the device while calibrating (the default: none)."""
        return self.offload != Layout.offload

    def label(self) -> str:
        parts = [f"ep={self.ep}", f"tp={self.tp}"]
        if self.quantized_resident:
            parts.append(f"resident={self.resident}")
        if self.offloaded:
            parts.append(f"offload={self.offload}")
        if self.activations != "device":
            parts.append(f"activations={self.activations}")
        return ",".join(parts)

    def overrides(self, base: Layout | None = None) -> list[str]:
        """The ``--set`` arguments that make a recipe of layout ``base`` use this one (the
        calibration keys only where they differ from ``base`` or from their defaults)."""
        base = base or Layout()
        out = [f"parallel.ep={self.ep}", f"parallel.tp={self.tp}"]
        for key, recipe_key in (
            ("resident", "weights_resident"),
            ("offload", "offload"),
            ("activations", "activations"),
        ):
            mine = getattr(self, key)
            if mine != getattr(base, key) or mine != getattr(Layout(), key):
                out.append(f"calibrate.{recipe_key}={mine}")
        return out

    @property
    def uses_host(self) -> bool:
        """Weights or activations held in host memory."""
        return self.offload == "host" or self.activations == "host"

    def problem(self) -> str | None:
        """Why the recipe would refuse this combination (None when it would not)."""
        if self.offloaded and self.quantized_resident:
            return "offload does not combine with resident weights other than bf16"
        if self.activations == "host" and not self.offloaded:
            return "activations=host needs offload=layer or host"
        return None


_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.I)


def parse_memory(text: str) -> int:
    """'141GB' -> 141 * 10**9, '139GiB' -> 139 * 2**30 (a memory size, up to 1 EiB)."""
    m = _MEMORY.match(str(text))
    if not m:
        raise ValueError(f"not a size like '141GB' or '139GiB': {str(text)[:40]!r}")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGTP".index(unit[0]) + 1)
    n = int(float(m.group(1)) * scale)
    if not 0 < n <= 2**60:
        raise ValueError(f"must be between 1 byte and 1 EiB, got {str(text)[:40]!r}")
    return n


def parse_layout(spec: str, base: Layout) -> Layout:
    """``ep=8,tp=1,resident=fp8,offload=layer`` (any subset; the rest from ``base``)."""
    values: dict[str, object] = {k: getattr(base, k) for k in _KEYS}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in _KEYS:
            raise UsageError(
                f"--layout {spec!r}: unknown layout key {key!r} (known: {', '.join(_KEYS)}, "
                "as key=value separated by commas)"
            )
        if key in ("ep", "tp"):
            if not value.isdigit() or int(value) < 1:
                raise UsageError(f"--layout {spec!r}: {key} must be a positive integer")
            values[key] = int(value)
        else:
            allowed = _CHOICES[key]
            if value not in allowed:
                raise UsageError(
                    f"--layout {spec!r}: {key} must be one of {', '.join(allowed)}; got {value!r}"
                )
            values[key] = value
    layout = Layout(**values)  # type: ignore[arg-type]
    if layout.problem():
        raise UsageError(f"--layout {spec!r}: {layout.problem()}")
    return layout


def check_world(layout: Layout, world: int, nproc_per_node: int) -> str | None:
    """Why ``layout`` cannot run on this world (None when it can)."""
    if world % layout.model_parallel:
        return f"ep x tp = {layout.model_parallel} does not divide the world size {world}"
    if layout.tp > nproc_per_node or nproc_per_node % layout.tp:
        return f"tp {layout.tp} does not divide the {nproc_per_node} GPUs of a node"
    return None


def splits(world: int, nproc_per_node: int) -> list[tuple[int, int]]:
    """Every (ep, tp) a world can run: ep x tp divides the world, TP stays inside a node."""
    out = []
    for tp in range(1, nproc_per_node + 1):
        if nproc_per_node % tp:
            continue
        for ep in range(1, world // tp + 1):
            if world % (ep * tp) == 0:
                out.append((ep, tp))
    return out


def preference(layout: Layout) -> tuple:
    """Sort key: the first layout that fits is the suggestion (see the module doc)."""
    offload = {"none": 0, "host": 1, "layer": 2}[layout.offload]
    resident = RESIDENT_FORMATS.index(layout.resident)
    moved = layout.activations != "device"
    # offloaded, every rank reads its share of the model for every calibration: the most
    # expert-parallel split reads the least; resident, the fewest model-parallel ranks
    split = -layout.model_parallel if offload else layout.model_parallel
    return (offload, moved, resident != 0, split, layout.tp, resident)


def recipe_layout(recipe: Any) -> Layout:
    """The layout a recipe asks for (calibration options that are not set: bf16, none)."""
    cal = recipe.calibrate
    return Layout(
        ep=recipe.parallel.ep,
        tp=recipe.parallel.tp,
        resident=str(getattr(cal, "weights_resident", "bf16")),
        offload=str(getattr(cal, "offload", "none")),
        activations=str(getattr(cal, "activations", "device")),
    )
