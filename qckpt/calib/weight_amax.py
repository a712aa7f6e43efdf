"""Weight amaxes taken from the checkpoint's own values while a load streams them in.

Quantized-resident calibration (``calibrate.weights_resident: fp8 | fp8_block | mxfp8``) holds
the weights quantized; their dequantized codes are not the checkpoint's numbers, so an amax
taken from them would describe the re-quantized weight, not the one the export quantizes. A
:class:`CheckpointWeightAmax` is the load's tap (``load_checkpoint(tap=...)``): the streaming
planner hands it each quantized destination's whole value (this rank's block, in the model's
dtype) just before quantizing it, and it folds that value into the weight quantizers the
calibration will have, with the quantizers' own reduction. The amaxes are therefore those a
BF16-resident run computes from its parameters, bit for bit. ``calibrate_model(weight_amax=)``
then takes them instead of reading the (quantized) weights.

The quantizers are made by :func:`qckpt.calib.instrument.insert_quantizers` on the model and
the model is left as it was (instrumentation removed), so the keys, shapes, granularities and
the expert slices are the calibration's own, not a second description of them.

Under data parallelism every DP rank holds the same weights, so taking every weight's amax on
every rank is the same work N times. :func:`split_weights` deals the weight quantizers out over
the DP ranks (balanced by elements, the same answer on every rank); each rank takes the amaxes
of its share and the amax sync's MAX (exact: a max of values one rank holds and zeros) gives
every rank all of them, bit for bit what one rank computes alone.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import nn

from qckpt.calib.instrument import (
    WeightSource,
    insert_quantizers,
    instrumentation,
    remove_quantizers,
)
from qckpt.errors import CalibrationError
from qckpt.recipe import QuantConfig


class CheckpointWeightAmax:
    """``tap(name, value)`` for a load: the weight amaxes of ``model``'s quantizers from the
    checkpoint's values. Call it with every quantized destination; read :meth:`amax` after."""

    def __init__(
        self,
        model: nn.Module,
        quant_cfg: QuantConfig,
        *,
        calib_dtype: torch.dtype = torch.float32,
        split: tuple[int, int] = (0, 1),
    ) -> None:
        """``split=(dp_rank, dp)``: only this DP rank's share (:func:`split_weights`) of the
        amaxes is taken; the calibration's sync completes the others."""
        insert_quantizers(model, quant_cfg, calib_dtype=calib_dtype)
        try:
            sources = instrumentation(model).weights
        finally:
            remove_quantizers(model)
        mine = split_weights(sources, split[1], split[0])
        self._by_param: dict[str, list[WeightSource]] = {}
        for src in sources:
            if src.quantizer.enabled and src.quantizer.name in mine:
                self._by_param.setdefault(src.param, []).append(src)
        self.seen: set[str] = set()

    def __call__(self, name: str, value: torch.Tensor) -> None:
        sources = self._by_param.get(name)
        if not sources:
            return  # a quantized parameter no weight quantizer reads
        if name in self.seen:
            raise CalibrationError(f"{name}: the load delivered this weight twice")
        self.seen.add(name)
        with torch.no_grad():
            for src in sources:
                src.quantizer.collect(src.take(value))

    def amax(self) -> dict[str, torch.Tensor]:
        """Quantizer key -> amax, for every weight quantizer whose parameter was delivered."""
        out: dict[str, torch.Tensor] = {}
        for name in self.seen:
            for src in self._by_param[name]:
                a = src.quantizer.amax
                if a is not None:
                    out[src.quantizer.key] = a
        return out


def split_weights(sources: Sequence[WeightSource], world: int, rank: int) -> set[str]:
    """The module names of the weight quantizers that DP rank ``rank`` of ``world`` calibrates.

    Dealt by parameter: every quantizer that reads one parameter (a fused experts weight's
    gate, up or down slices) goes to the same rank, which then reduces that weight once
    (:func:`qckpt.calib.instrument.calibrate_weights` takes a fused weight's slices in one
    reduction; slices dealt apart made every rank reduce every fused weight, and the split
    saved nothing). Largest parameter first onto the least-loaded rank (ties: the lower rank,
    then the earlier parameter), by the elements its quantizers read: deterministic from the
    sources alone, so every rank that holds the same model deals the same shares, and each
    name belongs to exactly one rank.
    """
    groups: dict[str, list] = {}
    for s in sources:
        if s.quantizer.enabled:
            groups.setdefault(s.param, []).append(s.quantizer)
    if world <= 1:
        return {q.name for qs in groups.values() for q in qs}
    params = list(groups)
    size = {p: sum(math.prod(q.shape) for q in groups[p]) for p in params}
    order = sorted(range(len(params)), key=lambda i: (-size[params[i]], i))
    loads = [(0, r) for r in range(world)]  # a heap of (elements dealt, rank)
    mine: set[str] = set()
    for i in order:
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.update(q.name for q in groups[params[i]])
        heapq.heappush(loads, (load + size[params[i]], r))
    return mine
