"""Several schemes in one export (``quant.schemes``): each linear written by its entry's layout.

A :class:`MixedLayout` holds one one-scheme layout of its family per recipe entry (built from
``quant.single(entry)``, so a linear's tensors are byte for byte what the one-scheme export of
its scheme writes) and the assignment of every linear to an entry (None: left in the model
dtype, and listed in the ignore list). It dispatches by module; a stack of the bulk path holds
linears of one entry only (:meth:`stack_key`). Each family merges the config its clients read:
:mod:`qckpt.layouts.compressed_tensors` one ``config_groups`` entry per scheme,
:mod:`qckpt.layouts.modelopt` ``MIXED_PRECISION`` with a ``quantized_layers`` map.

A scheme no layout of the family can write is refused here, before any work, in one line
naming the recipe path (:class:`~qckpt.errors.SchemeError`, exit 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from qckpt.errors import ExportError, FormatError, SchemeError
from qckpt.formats.scheme import scheme_of
from qckpt.layouts.export_layout import BlockScales, ExportLayout, OutSpec
from qckpt.recipe import QuantConfig

SingleMaker = Callable[[QuantConfig, torch.dtype, BlockScales | None], ExportLayout]


def entry_path(quant: QuantConfig, index: int) -> str:
    """How a message names recipe entry ``index``."""
    return f"quant.schemes[{index}]" if quant.mixed else "quant"


def check_schemes(quant: QuantConfig) -> None:
    """Every entry's weights and inputs are a registered scheme of a granularity it takes (NVFP4
    per channel is not); a one-line SchemeError naming the recipe path otherwise."""
    for i, entry in enumerate(quant.entries()):
        for side, kind in (("weights", "weight"), ("inputs", "input")):
            try:
                scheme_of(getattr(entry, side), kind)
            except FormatError as exc:
                raise SchemeError(f"{entry_path(quant, i)}.{side}: {exc}") from None


def build_parts(
    quant: QuantConfig,
    make: SingleMaker,
    model_dtype: torch.dtype,
    block_scales: BlockScales | None,
    assignment: dict[str, int | None],
) -> list[ExportLayout | None]:
    """One layout per entry that quantizes a linear (None for an entry that quantizes none: an
    earlier entry took all its matches); the family's refusal as a SchemeError naming the entry."""
    check_schemes(quant)
    used = {i for i in assignment.values() if i is not None}
    parts: list[ExportLayout | None] = []
    for i, entry in enumerate(quant.entries()):
        if i not in used:
            parts.append(None)
            continue
        try:
            parts.append(make(quant.single(entry), model_dtype, block_scales))
        except (ExportError, SchemeError) as exc:
            raise SchemeError(f"{entry_path(quant, i)}: {exc}") from None
    return parts


class MixedLayout(ExportLayout):
    """The layouts of a recipe's entries, dispatched by module (see the module doc)."""

    def __init__(
        self,
        quant: QuantConfig,
        model_dtype: torch.dtype,
        parts: list[ExportLayout | None],
        assignment: dict[str, int | None],
    ) -> None:
        first = next(p for p in parts if p is not None)
        super().__init__(quant, model_dtype, first.block_scales)
        self.name = first.name
        self.parts = parts
        self.assignment = dict(assignment)
        self.first = first

    def part(self, module: str) -> ExportLayout:
        i = self.assignment.get(module)
        if i is None or self.parts[i] is None:  # the plan quantizes only assigned linears
            raise ExportError(f"{module}: no entry of quant.schemes quantizes it")
        return self.parts[i]  # type: ignore[return-value]

    def members(self) -> Iterator[tuple[int, ExportLayout, list[str]]]:
        """(entry index, its layout, the linears it writes, sorted) of each entry in use."""
        by: dict[int, list[str]] = {}
        for m, i in self.assignment.items():
            if i is not None:
                by.setdefault(i, []).append(m)
        for i, part in enumerate(self.parts):
            if part is not None and i in by:
                yield i, part, sorted(by[i])

    def quant_of(self, module: str) -> QuantConfig:
        return self.part(module).quant

    def linear_specs(self, module: str, shape: tuple[int, ...]) -> list[OutSpec]:
        return self.part(module).linear_specs(module, shape)

    def needed_amax(self, module: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        return self.part(module).needed_amax(module, shape)

    def quantize_linear(
        self, module: str, w: torch.Tensor, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.part(module).quantize_linear(module, w, amax)

    def guard_amax(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        return self.part(module).guard_amax(module, amax)

    def stacks(self) -> bool:
        return any(p.stacks() for _, p, _ in self.members())

    def stacks_module(self, module: str) -> bool:
        return self.part(module).stacks()

    def stack_key(self, module: str) -> int:
        i = self.assignment.get(module)
        return -1 if i is None else i

    def quantize_stack(
        self, modules: list[str], w: torch.Tensor, amax: dict[str, torch.Tensor], chunk_elems: int
    ) -> list[torch.Tensor]:
        return self.part(modules[0]).quantize_stack(modules, w, amax, chunk_elems)

    # KV-cache scales do not depend on a linear's scheme: every part writes them alike
    def kv_specs(self, attn: str) -> list[OutSpec]:
        return self.first.kv_specs(attn)

    def kv_tensors(
        self, attn: str, amax: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.first.kv_tensors(attn, amax)

    def ignore_entries(self, ignored: list[str], embeddings: list[str]) -> list[str]:
        return self.first.ignore_entries(ignored, embeddings)

    def warnings(self, modules: list[str]) -> list[str]:
        out: list[str] = []
        for i, part, _ in self.members():
            mine = [m for m in modules if self.assignment.get(m) == i]
            out += [w for w in part.warnings(mine) if w not in out]
        return out

    def quant_format(self) -> str:
        """The shard metadata's and the report's ``quant_format`` of this mix."""
        raise NotImplementedError

    def shard_metadata(self) -> dict[str, str]:
        return {**self.first.shard_metadata(), "quant_format": self.quant_format()}
