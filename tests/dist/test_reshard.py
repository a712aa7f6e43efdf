"""Resharded loads on real gloo ranks: saved on N ranks, loaded on M, per-tensor FP8 destinations.

Checkpoints saved on N > 1 ranks are truly sharded (every tensor split by rows over the ranks'
files), so a load on any other M reads each destination in several items from several files.
Every load must give the same quantized params, bit for bit, as an unsharded load: per-tensor
scaling quantized once from the whole value (the Toy's rows differ in magnitude by 2**k, so a
per-slice scale would differ).
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.dist.harness import shared_world


def _save(rank: int, world: int, out: str) -> list[str]:
    from qckpt.convert.dcp import save_model_dcp
    from tests.toy import Toy

    save_model_dcp(Toy(seed=1), out)
    return sorted(p.name for p in Path(out).iterdir())


def _load(rank: int, world: int, path: str, out: str, reader: str = "fast") -> dict:
    from qckpt import formats
    from qckpt.load.loader import load_checkpoint
    from tests.toy import toy_quantized

    m = toy_quantized("fp8")
    rep = load_checkpoint(m, path, reader=reader)
    fields = {
        k: (v.fields() if formats.is_quantized(v) else {"t": v.detach()})
        for k, v in m.state_dict(keep_vars=True).items()
    }
    torch.save(fields, f"{out}.{rank}.pt")
    return {
        "world": rep.world_size,
        "items": rep.read_items,
        "transient": rep.transient_bytes,
        "predicted": rep.predicted_transient_bytes,
    }


def _load_ep(rank: int, world: int, path: str) -> dict:
    """EP=2 over 4 ranks: each rank holds half the experts (fp8: the whole tensor's per-tensor
    scale, reduced over the EP group, so the block is the slice of an unsharded load)."""
    from qckpt import formats
    from qckpt.load.loader import load_checkpoint
    from qckpt.models.quantize_params import quantize_model_params
    from qckpt.parallel.expert import shard_experts
    from qckpt.parallel.mesh import init_mesh
    from tests.toy import Toy

    mesh = init_mesh(ep=2, tp=1, timeout_s=10, device="cpu")
    out = {"ep_rank": mesh.ep_rank}
    for stream, reader in ((True, "fast"), (False, "fast"), ("plain", "plain")):
        m = Toy(seed=99)
        assert shard_experts(m, mesh) == ["moe.experts"]
        quantize_model_params(m, "fp8")
        rep = load_checkpoint(m, path, stream=bool(stream), mesh=mesh, reader=reader)
        out[stream] = {
            k: (v.fields() if formats.is_quantized(v) else {"t": v.detach()})
            for k, v in m.state_dict(keep_vars=True).items()
        }
        out[f"items_{stream}"] = rep.read_items
    return out


def _fields_of(m) -> dict:
    from qckpt import formats

    return {
        k: (v.fields() if formats.is_quantized(v) else {"t": v.detach()})
        for k, v in m.state_dict(keep_vars=True).items()
    }


def _assert_same(got: dict, ref: dict, what: str) -> None:
    from tests._bits import bits

    assert got.keys() == ref.keys()
    for k in ref:
        for f in ref[k]:
            assert torch.equal(bits(got[k][f]), bits(ref[k][f])), f"{what}: {k}.{f} differs"


def _ok(outs):
    bad = [o for o in outs if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: {o.error}\n{o.traceback}" for o in bad)
    return [o.value for o in outs]


@pytest.mark.timeout(180)
def test_save_on_n_ranks_load_on_m_gives_the_unsharded_values(tmp_path):
    from qckpt.convert.dcp import save_model_dcp
    from qckpt.load.loader import load_checkpoint
    from tests.toy import Toy, toy_quantized

    c1, c2, c4 = (str(tmp_path / f"c{n}") for n in (1, 2, 4))
    save_model_dcp(Toy(seed=1), c1)
    ref_model = toy_quantized("fp8")
    ref_rep = load_checkpoint(ref_model, c1, reader="plain")
    ref = _fields_of(ref_model)
    n_tensors = len(ref)
    assert ref_rep.read_items == n_tensors  # unsharded: one item per tensor

    w2, w4 = shared_world(2), shared_world(4)
    files4 = _ok(w4.run(_save, c4, deadline_s=240))[0]  # the first scenario spawns the world
    assert [f for f in files4 if f.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]
    files2 = _ok(w2.run(_save, c2, deadline_s=240))[0]
    assert [f for f in files2 if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]

    cases = [
        ("save 2 -> load 4", w4, c2, 2),
        ("save 1 -> load 2", w2, c1, 1),
        ("save 4 -> load 2", w2, c4, 4),
    ]
    one = ref_rep.predicted_transient_bytes
    for (what, world, path, parts), reader in itertools.product(cases, ("plain", "fast")):
        out = str(tmp_path / (what + reader).replace(" ", "_").replace(">", ""))
        stats = _ok(world.run(_load, path, out, reader))
        for rank, s in enumerate(stats):
            assert s["world"] == world.n
            # each destination arrives in `parts` items (one per saved shard)
            assert s["items"] == n_tensors * parts, (what, s)
            # one scratch at a time (the plain reader; the fast one at its default max_inflight
            # 1) even though the pieces come from `parts` files
            assert s["transient"] == s["predicted"] == one, (what, s)
            _assert_same(torch.load(f"{out}.{rank}.pt"), ref, f"{what} ({reader}), rank {rank}")

    # save 2 -> load on 4 ranks as DP2 x EP2: each rank reads only its experts' rows
    from qckpt import formats

    src = Toy(seed=1)
    for v in _ok(w4.run(_load_ep, c2)):
        e0 = 2 * v["ep_rank"]
        assert v[True].keys() == ref.keys()
        _assert_same(v[True], v[False], f"EP rank {v['ep_rank']}: stream vs bulk")
        _assert_same(v[True], v["plain"], f"EP rank {v['ep_rank']}: fast vs plain reader")
        for k in ref:
            if k.startswith("moe.experts."):
                whole = formats.quantize(
                    getattr(src.moe.experts, k.rsplit(".", 1)[1]).detach(), "fp8"
                )
                want = {"qdata": whole.qdata[e0 : e0 + 2], "scale": whole.scale}
                assert torch.equal(want["scale"], ref[k]["scale"])
                _assert_same({k: v[True][k]}, {k: want}, f"EP rank {v['ep_rank']}")
            else:
                _assert_same({k: v[True][k]}, {k: ref[k]}, f"EP rank {v['ep_rank']}")
        # experts: 2 of 4 experts per rank; each saved half (2 experts) overlaps one rank's
        # block exactly for gate_up and down, so 1 item each; the rest 2 items per tensor
        assert v["items_True"] == 2 * 5 + 2

    # save 2 -> load 1 (this process, no process group)
    for reader in ("plain", "fast"):
        m = toy_quantized("fp8")
        rep = load_checkpoint(m, c2, reader=reader)
        assert rep.read_items == 2 * n_tensors
        assert rep.transient_bytes <= rep.predicted_transient_bytes
        _assert_same(_fields_of(m), ref, f"save 2 -> load 1 ({reader})")

    # a sharded checkpoint reads back whole, one tensor at a time (export / inspect / convert)
    from qckpt.read.readers import iter_checkpoint_tensors

    want = Toy(seed=1).state_dict()
    for c in (c2, c4):
        got = dict(iter_checkpoint_tensors(c))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    # why the plan-order reader: DCP's stock FileSystemReader walks file by file, so with every
    # tensor split over 4 files all scratches are alive at once (2 * sum(numel))
    from qckpt.load.meter import MemoryMeter
    from qckpt.load.planner import StreamingDequantLoadPlanner
    from qckpt.read.dcp_reader import OrderedFileSystemReader
    from qckpt.storage.dcp_metadata import SafeFileSystemReader

    q_bytes = [
        2 * v.numel() for v in m.state_dict(keep_vars=True).values() if formats.is_quantized(v)
    ]
    for reader, want in (
        (SafeFileSystemReader(c4), sum(q_bytes)),
        (OrderedFileSystemReader(c4), max(q_bytes)),
    ):
        m = toy_quantized("fp8")
        meter = MemoryMeter("cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                m.state_dict(keep_vars=True),
                storage_reader=reader,
                planner=StreamingDequantLoadPlanner(meter=meter),
                no_dist=True,
            )
        assert meter.peak_scratch == want, type(reader).__name__
        _assert_same(_fields_of(m), ref, f"save 4 -> load 1 via {type(reader).__name__}")
