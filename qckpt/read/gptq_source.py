"""The checkpoint an export of a ``gptq`` calibration reads: the original, with the GPTQ'd
weights in place of the linears' own.

``calibrate`` (algorithm gptq) writes a sidecar dir beside its file (``<output>.gptq/``): one
safetensors file per EP rank (``ep000.safetensors``, ...) holding, in checkpoint (per-expert)
naming, each GPTQ'd linear's ``{module}.weight`` in the model's dtype (the dequantized GPTQ
values) and, for NVFP4, ``{module}.weight_block_scale`` (the E4M3 block scales GPTQ chose,
which the export writes as they are; INT4's group scales, and for asymmetric INT4 the int8
``{module}.weight_zero_point`` beside them). :class:`GptqSource` keeps the original's entries, order
and every other tensor; an entry one of whose checkpoint tensors is in the sidecar is read from
the sidecar (a fused experts tensor assembled from its experts' views), one in flight, and has
no byte span (the export's bulk path would read the original's bytes). The entries and hence
the export's files do not depend on how the sidecar is split (DP, EP).

An ``awq`` calibration's sidecar (``<output>.awq/``) is read the same way: it holds every
tensor its folds changed (norms, routers and linears, in the model's dtype) and no block
scales, so the export quantizes the folded weights as it would any checkpoint's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from qckpt.errors import ExportError
from qckpt.models.naming import hf_tensors
from qckpt.read.source import CheckpointSource, Entry

BLOCK_SCALE = "weight_block_scale"
# asymmetric INT4 groups: the int8 zero points GPTQ chose beside each group's scale
ZERO_POINT = "weight_zero_point"


class GptqSource(CheckpointSource):
    """``base`` with the tensors of ``files`` (in ``root``) read in their place."""

    def __init__(
        self, base: CheckpointSource, root: str | os.PathLike, files: list[str], model_type: str
    ):
        super().__init__(base.path)
        self.base, self.format, self.model_type = base, base.format, model_type
        self.where: dict[str, Path] = {}
        self.block_scales: dict[str, Path] = {}
        self.zero_points: dict[str, Path] = {}
        for f in files:
            path = Path(root) / f
            if not path.is_file():
                raise ExportError(
                    f"{path}: the GPTQ weights of this calibration are missing (calibrate again)"
                )
            with safe_open(str(path), "pt") as h:
                for k in h.keys():  # noqa: SIM118 - safe_open has no iteration
                    if k.endswith("." + BLOCK_SCALE):
                        self.block_scales[k[: -len(BLOCK_SCALE) - 1]] = path
                    elif k.endswith("." + ZERO_POINT):
                        self.zero_points[k[: -len(ZERO_POINT) - 1]] = path
                    else:
                        self.where[k] = path
        self._over: dict[str, list[str]] = {}

    def _list(self) -> list[Entry]:
        return self.base.entries()

    def _names(self, e: Entry) -> list[str]:
        got = self._over.get(e.name)
        if got is None:
            meta = torch.empty(e.shape, dtype=e.torch_dtype, device="meta")
            got = self._over[e.name] = [n for n, _ in hf_tensors(e.name, meta, self.model_type)]
        return got

    def overridden(self, e: Entry) -> bool:
        names = self._names(e)
        hits = [n in self.where for n in names]
        if any(hits) and not all(hits):
            missing = next(n for n, h in zip(names, hits, strict=True) if not h)
            raise ExportError(f"{missing}: not in the GPTQ weights beside its other experts")
        return bool(hits and hits[0])

    def span(self, e: Entry):
        if self.overridden(e) or not hasattr(self.base, "span"):
            return None  # read through read(): the bulk path would take the original's bytes
        return self.base.span(e)

    def read_span(self, entries: list[Entry], pinned: bool = False) -> torch.Tensor:
        return self.base.read_span(entries, pinned=pinned)

    def read(self, entry: Entry, pinned: bool = False) -> torch.Tensor:
        if not self.overridden(entry):
            return self.base.read(entry, pinned=pinned)
        out = torch.empty(entry.shape, dtype=entry.torch_dtype)
        for name, view in hf_tensors(entry.name, out, self.model_type):
            with safe_open(str(self.where[name]), "pt") as h:
                t = h.get_tensor(name)
            if tuple(t.shape) != tuple(view.shape):
                raise ExportError(f"{name}: GPTQ weight of shape {list(t.shape)}, expected "
                                  f"{list(view.shape)}")  # fmt: skip
            view.copy_(t)
        return out

    def block_scale(self, module: str) -> torch.Tensor | None:
        path = self.block_scales.get(module)
        if path is None:
            return None
        with safe_open(str(path), "pt") as h:
            return h.get_tensor(f"{module}.{BLOCK_SCALE}")

    def zero_point(self, module: str) -> torch.Tensor | None:
        path = self.zero_points.get(module)
        if path is None:
            return None
        with safe_open(str(path), "pt") as h:
            return h.get_tensor(f"{module}.{ZERO_POINT}")

    def __getattr__(self, name: str):
        # anything else a reader asks of a source (files, headers, layout...) is the base's
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)
