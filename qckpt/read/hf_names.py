"""A checkpoint in HF checkpoint naming: what ``save_pretrained`` writes (fused experts per expert).

``hf_entries`` / ``iter_hf_tensors`` give any source's entries and tensors in that naming (the
export writes it); ``per_expert_pieces`` says where each per-expert tensor sits inside a fused
parameter (the HF and training readers present a fused parameter as its experts' chunks). The
names themselves come from :func:`qckpt.models.naming.hf_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qckpt.errors import CheckpointError
from qckpt.read.source import CheckpointSource, Entry

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HFEntry:
    """One tensor as the HF checkpoint names it, and the stored entry it comes from."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Entry


def hf_entries(entries: Iterable[Entry], model_type: str) -> list[HFEntry]:
    """The HF checkpoint entries of stored ones (a fused parameter split per expert, adjacent)."""
    import torch

    from qckpt.models.naming import hf_tensors, is_fused_experts_param

    out: list[HFEntry] = []
    dtypes: dict[str, torch.dtype] = {}  # a large MoE lists tens of thousands of entries
    for e in entries:
        dt = dtypes.get(e.dtype)
        if dt is None:
            dt = dtypes[e.dtype] = e.torch_dtype
        if not is_fused_experts_param(e.name):  # passes through: no meta tensor to view
            out.append(HFEntry(e.name, dt, tuple(e.shape), e))
            continue
        meta = torch.empty(e.shape, dtype=dt, device="meta")
        for name, view in hf_tensors(e.name, meta, model_type):
            out.append(HFEntry(name, dt, tuple(view.shape), e))
    return out


def iter_hf_tensors(
    source: CheckpointSource, entries: Iterable[HFEntry], model_type: str
) -> Iterator[tuple[HFEntry, torch.Tensor]]:
    """(HF entry, tensor) for each entry, reading every stored tensor exactly once.

    Entries that come from one stored tensor must be adjacent, as :func:`hf_entries` makes
    them; the stored tensor is dropped after its last one.
    """
    from qckpt.models.naming import hf_tensors

    current: Entry | None = None
    views: dict[str, torch.Tensor] = {}
    for he in entries:
        if he.source is not current:
            views = {}  # drop the previous stored tensor before reading the next one
            current = he.source
            stored = source.read(current)
            views = dict(hf_tensors(current.name, stored, model_type))
            del stored
        yield he, views.pop(he.name)
    views.clear()


def per_expert_pieces(
    name: str, shape: tuple[int, ...], model_type: str
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(hf name, offsets, sizes) of each per-expert tensor of a fused parameter.

    Derived from ``naming.hf_tensors`` on a meta tensor: each yielded view is ``fused[e, rows]``
    and its storage offset tells where it sits, so the names and places stay whatever naming
    says they are.
    """
    import torch

    from qckpt.models.naming import hf_tensors

    meta = torch.empty(shape, device="meta")
    _, rows_total, cols = shape
    out = []
    for hf_name, view in hf_tensors(name, meta, model_type):
        if view.dim() != 2 or view.shape[1] != cols or view.stride() != (cols, 1):
            raise CheckpointError(f"{name}: unexpected per-expert view {tuple(view.shape)}")
        off = view.storage_offset()
        e, rest = divmod(off, rows_total * cols)
        out.append((hf_name, (e, rest // cols, 0), (1, view.shape[0], cols)))
    return out
