"""DCP's read items for a destination held whole, made without DCP's general resharding sweep.

``create_default_local_load_plan`` runs, per destination, a sweep over the checkpoint's chunks
that also serves destinations held in pieces (DTensor shards): per chunk an overlap test, a
region computed axis by axis in Python, and four new index and size objects. A destination
held whole by this rank (one local chunk at offset 0, the common case, and the one of an HF
dir's per-expert chunks: 18k of them in a 48-layer MoE) overlaps every chunk exactly where the
chunk lies, so its items follow from the chunks directly. The items, and their order, are the
ones DCP makes (``tests/unit/test_read_items.py`` compares them on random chunk grids).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor


def whole_tensor_items(fqn: str, md: TensorStorageMetadata, size: torch.Size) -> list[ReadItem]:
    """The items that fill a whole destination of ``size`` from the chunks of ``md``: what
    ``create_read_items_for_chunk_list(fqn, md, [chunk at 0 of size])`` returns."""
    chunks = md.chunks
    nd = len(size)
    if not chunks:
        return []
    zeros = torch.Size([0] * nd)
    dest_index = MetadataIndex(fqn, zeros, 0)
    if nd == 0:
        order = list(range(len(chunks)))
    else:
        # DCP's sweep axis (the longest), and its order: by where each chunk ends along it
        sweep, longest = 0, 0
        if nd > 1:
            for d in range(nd):
                end = max(size[d], max(c.offsets[d] + c.sizes[d] for c in chunks))
                if end > longest:
                    longest, sweep = end, d
        lim = size[sweep]
        keyed = [
            (c.offsets[sweep] + c.sizes[sweep], i)
            for i, c in enumerate(chunks)
            if c.offsets[sweep] < lim
        ]
        keyed.sort()
        order = [i for _, i in keyed]
    items = []
    for i in order:
        c = chunks[i]
        offs, sizes = c.offsets, c.sizes
        if any(o + n <= 0 or o >= s for o, n, s in zip(offs, sizes, size, strict=True)):
            continue  # no overlap (an empty chunk)
        lens = sizes
        if any(o + n > s for o, n, s in zip(offs, sizes, size, strict=True)):
            lens = torch.Size(
                [min(o + n, s) - o for o, n, s in zip(offs, sizes, size, strict=True)]
            )
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=dest_index,
                dest_offsets=torch.Size(offs),
                storage_index=MetadataIndex(fqn, offs, i),
                storage_offsets=zeros,
                lengths=torch.Size(lens),
            )
        )
    return items


def local_load_items(
    state_dict: dict[str, Any], metadata: Metadata, strict: bool
) -> list[ReadItem]:
    """``create_default_local_load_plan(state_dict, metadata, strict).items``, with the
    destinations held whole (plain tensors) planned by :func:`whole_tensor_items`."""
    md_all = metadata.state_dict_metadata
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = md_all.get(fqn)
        whole = (
            isinstance(md, TensorStorageMetadata)
            and isinstance(obj, torch.Tensor)
            and not isinstance(obj, DTensor)
            and not hasattr(obj, "__create_chunk_list__")
            and md.size == obj.size()
        )
        if whole:
            items += whole_tensor_items(fqn, md, obj.size())
        else:  # DCP's own planning: a missing key, a byte entry, a DTensor, a mismatch
            items += create_default_local_load_plan({fqn: obj}, metadata, strict).items
    return items
