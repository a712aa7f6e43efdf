"""The whole-destination read items (``qckpt.read.read_items``) are DCP's own: same fields, same
order, on random chunk grids (resharded saves), empty and 0-d tensors, and through a planner."""

from __future__ import annotations

import random

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_from_tensor,
    create_read_items_for_chunk_list,
)

from qckpt.read.read_items import local_load_items, whole_tensor_items


def _grid(rnd: random.Random, size: tuple[int, ...]) -> list[ChunkStorageMetadata]:
    """The tensor cut into a random grid of chunks (cuts per axis), listed in a random order."""
    cuts = []
    for n in size:
        inner = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(0, 3)))) if n > 1 else []
        cuts.append(list(zip([0, *inner], [*inner, n], strict=True)))
    chunks: list[list[tuple[int, int]]] = [[]]
    for axis in cuts:
        chunks = [c + [seg] for c in chunks for seg in axis]
    out = [
        ChunkStorageMetadata(
            offsets=torch.Size([a for a, _ in c]), sizes=torch.Size([b - a for a, b in c])
        )
        for c in chunks
    ]
    rnd.shuffle(out)
    return out


def _md(size, chunks) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size(size), chunks=chunks
    )


def test_whole_tensor_items_are_dcps_on_random_grids():
    rnd = random.Random(0)
    for _ in range(300):
        size = tuple(rnd.randint(1, 9) for _ in range(rnd.randint(1, 4)))
        md = _md(size, _grid(rnd, size))
        want = create_read_items_for_chunk_list(
            "w", md, [_create_chunk_from_tensor(torch.empty(size))]
        )
        got = whole_tensor_items("w", md, torch.Size(size))
        assert got == want, size
        assert [i.storage_index.index for i in got] == [i.storage_index.index for i in want]


def test_whole_tensor_items_of_per_expert_chunks_empty_and_scalar():
    # a fused [E, 2I, H] parameter from per-expert gate and up chunks (an HF dir)
    e, i, h = 4, 3, 5
    experts = [
        ChunkStorageMetadata(offsets=torch.Size([x, r * i, 0]), sizes=torch.Size([1, i, h]))
        for x in range(e)
        for r in (0, 1)
    ]
    empty = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([0, 3]))]
    for size, chunks in [((e, 2 * i, h), experts), ((0, 3), empty), ((), [_scalar_chunk()])]:
        md = _md(size, chunks)
        want = create_read_items_for_chunk_list(
            "w", md, [_create_chunk_from_tensor(torch.empty(size))]
        )
        got = whole_tensor_items("w", md, torch.Size(size))
        assert got == want and [x.storage_index.index for x in got] == [
            x.storage_index.index for x in want
        ]
    assert len(whole_tensor_items("w", _md((e, 2 * i, h), experts), torch.Size((e, 2 * i, h)))) == 8


def test_local_load_items_equal_dcps_plan():
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    rnd = random.Random(1)
    sd, md_all = {}, {}
    for k in range(20):
        size = tuple(rnd.randint(1, 6) for _ in range(rnd.randint(0, 3)))
        sd[f"t{k}"] = torch.zeros(size)
        md_all[f"t{k}"] = _md(size, _grid(rnd, size) if size else [_scalar_chunk()])
    md = Metadata(state_dict_metadata=md_all)
    assert local_load_items(sd, md, True) == create_default_local_load_plan(sd, md, True).items


def _scalar_chunk() -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
