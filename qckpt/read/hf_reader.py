"""A DCP ``StorageReader`` over a Hugging Face safetensors dir, in the model's state-dict names.

transformers 5 keeps routed experts fused (``experts.gate_up_proj`` [E, 2I, H]) but its
checkpoints hold them per expert (``experts.{e}.gate_proj.weight`` [I, H], ...). Our Metadata
presents each fused parameter as ONE ``TensorStorageMetadata`` whose chunks are the per-expert
tensors (gate at offset [e, 0, 0] size [1, I, H], up at [e, I, 0], down at [e, 0, 0] of
``down_proj``), so DCP plans a fused destination as many read items and the streaming planner
quantizes it once, at its last item. Data are read lazily, item by item in plan order, through
``safe_open`` slices: only the requested rows leave the file.

The mapping comes from ``qckpt.models.naming.hf_tensors`` (the one place that knows the names),
so what we read is exactly what ``save_pretrained`` / ``dcp_to_hf_dir`` write.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from qckpt.errors import CheckpointError
from qckpt.layouts.dequantize import dequantize_into
from qckpt.layouts.registry import source_layout
from qckpt.layouts.source_layout import QuantWeight, SourceLayout
from qckpt.models import naming
from qckpt.read.hf_names import per_expert_pieces
from qckpt.read.sources import SafetensorsSource
from qckpt.read.state_dict_reader import StateDictReader
from qckpt.storage.files import read_json, require_regular
from qckpt.storage.safetensors import has_safetensors
from qckpt.storage.slices import SafetensorsFetch


@dataclass(frozen=True)
class HFPiece:
    """One checkpoint tensor placed inside a state-dict tensor."""

    file: str  # file name inside the dir
    key: str  # the tensor's name in the file
    offsets: tuple[int, ...]  # where it sits in the state-dict tensor
    sizes: tuple[int, ...]  # its extent there (leading 1s for the axes it lacks)
    lead: int  # how many leading axes of ``sizes`` the stored tensor does not have
    # a quantized source's weight: read as codes + scales and dequantized (qckpt.layouts.dequantize)
    quant: QuantWeight | None = None


@dataclass
class HFStateEntry:
    shape: torch.Size
    dtype: torch.dtype
    pieces: list[HFPiece]


def hf_index(
    path: str | os.PathLike, source: SafetensorsSource | None = None
) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor of the dir: name -> (file name, shape, dtype), from the headers only
    (``source``: the dir's ``SafetensorsSource`` when the caller holds one: parsed once)."""
    names: dict[Any, str] = {}  # a Path per tensor costs more than the rest of its entry

    def name_of(file: Any) -> str:
        n = names.get(file)
        if n is None:
            n = names[file] = Path(file).name
        return n

    return {
        e.name: (name_of(e.file), e.shape, e.torch_dtype)
        for e in (source or SafetensorsSource(path)).stored()
    }


def model_type_of_dir(path: str | os.PathLike) -> str:
    """The dir's config.json ``model_type`` ("" without a config.json)."""
    cfg = Path(path) / "config.json"
    if not os.path.lexists(cfg):
        return ""
    return str(read_json(cfg, what="model config").get("model_type", ""))


_EXPERT_RE = re.compile(r"^(?P<pre>.+)\.(?P<e>\d+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")


def _guess_fused(
    index: dict[str, tuple[str, tuple[int, ...], torch.dtype]], model_type: str
) -> dict[str, tuple[int, ...]]:
    """Fused state-dict names and shapes implied by per-expert names (no model at hand)."""
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for k, (_, shape, _) in index.items():
        m = _EXPERT_RE.match(k)
        if m and len(shape) == 2:
            groups.setdefault(m["pre"], {})[k] = shape
    renames = [r for (r, *_rest) in getattr(naming, "_EXPERT_NAMES", {}).values() if r]
    out: dict[str, tuple[int, ...]] = {}
    for pre, members in groups.items():
        shapes = list(members.values())
        n = len(members)
        if n % 3:
            continue
        # gate and up share a shape [I, H]; down is [H, I]
        counts: dict[tuple[int, ...], int] = {}
        for s in shapes:
            counts[s] = counts.get(s, 0) + 1
        gate_like = max(counts, key=lambda s: counts[s])
        rows, cols = gate_like
        experts = n // 3
        candidates = [pre] + [("." + pre).replace(new, old)[1:] for old, new in renames]
        for sd_pre in dict.fromkeys(candidates):
            gu = (f"{sd_pre}.gate_up_proj", (experts, 2 * rows, cols))
            dn = (f"{sd_pre}.down_proj", (experts, cols, rows))
            if not naming.is_fused_experts_param(gu[0]):
                continue
            names = {h for nm, sh in (gu, dn) for h, _, _ in per_expert_pieces(nm, sh, model_type)}
            if names == set(members):
                out[gu[0]], out[dn[0]] = gu[1], dn[1]
                break
    return out


def hf_layout(
    path: str | os.PathLike,
    *,
    model_type: str | None = None,
    expected: dict[str, torch.Size] | None = None,
) -> dict[str, HFStateEntry]:
    """``hf_source``'s layout alone."""
    return hf_source(path, model_type=model_type, expected=expected)[0]


def hf_source(
    path: str | os.PathLike,
    *,
    model_type: str | None = None,
    expected: dict[str, torch.Size] | None = None,
    stored_source: SafetensorsSource | None = None,
) -> tuple[
    dict[str, HFStateEntry], SourceLayout, dict[str, tuple[str, tuple[int, ...], torch.dtype]]
]:
    """State-dict name -> where its data lie in the dir.

    With ``expected`` (the model's state-dict shapes), fused expert parameters are mapped from
    the per-expert names naming gives for those shapes; a missing per-expert tensor is a
    CheckpointError naming it. Without, fused parameters are inferred from complete per-expert
    groups. Names used by no fused parameter pass through one to one. A quantized dir (see
    ``qckpt.layouts``) shows its weights under their logical names, shapes and the model's
    dtype, each piece carrying how it is stored. Returns (layout, source layout, stored index).
    """
    raw = hf_index(path, stored_source)
    source = source_layout(path, raw)
    index = source.logical_index(raw) if source.quantized else raw
    if model_type is None:
        model_type = model_type_of_dir(path)
    if expected is not None:
        fused = {
            n: tuple(s)
            for n, s in expected.items()
            if naming.is_fused_experts_param(n) and len(s) == 3 and n not in index
        }
    else:
        fused = _guess_fused(index, model_type)
    layout: dict[str, HFStateEntry] = {}
    used: set[str] = set()
    for name, shape in fused.items():
        pieces: list[HFPiece] = []
        dtypes = set()
        for hf_name, offs, sizes in per_expert_pieces(name, shape, model_type):
            if hf_name not in index:
                raise CheckpointError(
                    f"{name}: missing from the checkpoint ({hf_name} not in {path})"
                )
            f, st_shape, dt = index[hf_name]
            if tuple(st_shape) != tuple(sizes[1:]):
                raise CheckpointError(
                    f"{name}: {hf_name} has shape {tuple(st_shape)} in the checkpoint, "
                    f"{tuple(sizes[1:])} in the model"
                )
            dtypes.add(dt)
            pieces.append(HFPiece(f, hf_name, offs, sizes, 1, source.weights.get(hf_name)))
            used.add(hf_name)
        if len(dtypes) > 1:
            raise CheckpointError(
                f"{name}: its per-expert tensors mix dtypes {sorted(map(str, dtypes))}"
            )
        layout[name] = HFStateEntry(torch.Size(shape), dtypes.pop(), pieces)
    for k, (f, shape, dt) in index.items():
        if k in used:
            continue
        piece = HFPiece(f, k, (0,) * len(shape), shape, 0, source.weights.get(k))
        layout[k] = HFStateEntry(torch.Size(shape), dt, [piece])
    return layout, source, raw


class HFSafetensorsReader(StateDictReader):
    """Reads an HF safetensors dir (single file or sharded with an index) through DCP.

    Items are served in plan order (the streaming planner groups a destination's items), one
    ``safe_open`` slice at a time; ``bytes_read`` counts what left the files.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        model_type: str | None = None,
        expected: dict[str, torch.Size] | None = None,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.model_type = model_type
        self.expected = expected
        self.bytes_read = 0
        self._metadata: Metadata | None = None
        self.storage_data: dict[MetadataIndex, HFPiece] = {}
        self.source: SourceLayout | None = None  # the dir's layout (after read_metadata)
        self.layout: dict[str, HFStateEntry] = {}
        # every stored tensor (codes and scales of a quantized dir included): name -> (file,
        # shape, dtype)
        self.raw_index: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != self.path:
            self.path = Path(checkpoint_id)
            self._metadata = None
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self.stored_source = SafetensorsSource(self.path)
            layout, self.source, self.raw_index = hf_source(
                self.path,
                model_type=self.model_type,
                expected=self.expected,
                stored_source=self.stored_source,
            )
            self.layout = layout
            sd_md: dict[str, Any] = {}
            storage: dict[MetadataIndex, HFPiece] = {}
            for name, entry in layout.items():
                chunks = [
                    ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
                    for p in entry.pieces
                ]
                sd_md[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=entry.dtype), size=entry.shape, chunks=chunks
                )
                for p in entry.pieces:
                    storage[MetadataIndex(name, torch.Size(p.offsets))] = p
            self._metadata = Metadata(state_dict_metadata=sd_md, storage_data=storage)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        handles: dict[str, Any] = {}
        fetch = SafetensorsFetch(self.path, self.raw_index)
        try:
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise CheckpointError(f"{req.dest_index.fqn}: safetensors hold no byte entries")
                piece: HFPiece = self.storage_data[req.storage_index]
                if piece.quant is not None:
                    self._read_quantized(req, piece, planner, fetch)
                    continue
                h = handles.get(piece.file)
                if h is None:
                    require_regular(self.path / piece.file)  # a FIFO swapped in would block
                    h = safe_open(str(self.path / piece.file), framework="pt", device="cpu")
                    handles[piece.file] = h
                # storage offsets are relative to the chunk; the stored tensor lacks its
                # leading ``lead`` axes (always offset 0, length 1)
                offs = req.storage_offsets[piece.lead :]
                lens = req.lengths[piece.lead :]
                if len(lens) == 0:
                    t = h.get_tensor(piece.key)
                else:
                    sl = h.get_slice(piece.key)
                    t = sl[tuple(slice(o, o + n) for o, n in zip(offs, lens, strict=True))]
                t = t.reshape(tuple(req.lengths))
                self.bytes_read += t.numel() * t.element_size()
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise CheckpointError(
                        f"{req.dest_index.fqn}: read {tuple(t.size())} for a destination "
                        f"slice of {tuple(target.size())}"
                    )
                target.copy_(t)
                planner.commit_tensor(req, target)
                del t, target
        finally:
            handles.clear()
            self.bytes_read += fetch.bytes_read
            fetch.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _read_quantized(
        req: Any, piece: HFPiece, planner: LoadPlanner, fetch: SafetensorsFetch
    ) -> None:
        """Dequantize the item's rectangle of a quantized weight straight into the destination
        (the planner's scratch, on its device), a row chunk at a time."""
        assert piece.quant is not None
        offs = req.storage_offsets[piece.lead :]
        lens = req.lengths[piece.lead :]
        if len(lens) != (3 if piece.quant.experts else 2):
            raise CheckpointError(
                f"{req.dest_index.fqn}: a quantized weight is read as "
                f"{'3-D (experts)' if piece.quant.experts else '2-D'}"
            )
        target = planner.resolve_tensor(req).detach()
        if tuple(target.size()) != tuple(req.lengths):
            raise CheckpointError(
                f"{req.dest_index.fqn}: read {tuple(req.lengths)} for a destination slice of "
                f"{tuple(target.size())}"
            )
        span = [(int(o), int(o) + int(n)) for o, n in zip(offs, lens, strict=True)]
        if piece.quant.experts:  # gpt-oss's fused experts: the box, experts first
            dequantize_into(target, piece.quant, fetch, span[1], span[2], span[0])
            planner.commit_tensor(req, target)
            return
        # the stored tensor lacks the leading axes (each of length 1): index them away (a view)
        out = target[(0,) * (target.dim() - 2)] if target.dim() > 2 else target
        dequantize_into(out, piece.quant, fetch, span[0], span[1])
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        p = Path(checkpoint_id)
        return p.is_dir() and has_safetensors(p)
