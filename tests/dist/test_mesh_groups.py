"""The mesh's process groups over 4 real gloo ranks: each family's members, and no group made
where a family is one rank (None), the whole world (the world's own group) or an earlier
family's ranks (that group)."""

from __future__ import annotations

import pytest

from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(180)


def sc_groups(rank, world, layouts):
    import torch
    import torch.distributed as dist

    from qckpt.parallel import mesh as mesh_mod

    made = []
    real = dist.new_group

    def counting(*a, **kw):
        made.append(a[0] if a else kw.get("ranks"))
        return real(*a, **kw)

    out = {}
    mesh_mod.dist.new_group = counting
    try:
        for ep, tp in layouts:
            made.clear()
            m = mesh_mod.init_mesh(ep=ep, tp=tp, timeout_s=10, device="cpu")
            row = {"made": len(made)}
            for name in ("dp", "ep", "tp", "data"):
                g = getattr(m, f"{name}_group")
                if g is None:
                    row[name] = None
                    continue
                # who is in it, as the group's own collective sees it
                got = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(g))]
                dist.all_gather(got, torch.tensor([rank]), group=g)
                row[name] = ([int(t) for t in got], g is dist.group.WORLD)
            out[f"{ep}x{tp}"] = row
    finally:
        mesh_mod.dist.new_group = real
    return out


def test_groups_hold_the_right_ranks_and_none_is_made_needlessly():
    layouts = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)]
    out = shared_world(4).run(sc_groups, layouts, deadline_s=120)
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    world = [0, 1, 2, 3]
    for rank, o in enumerate(out):
        v = o.value
        # pure DP: dp and data are the world, no group made at all
        assert v["1x1"] == {
            "made": 0, "dp": (world, True), "ep": None, "tp": None, "data": (world, True)
        }  # fmt: skip
        # ep 2: dp pairs {0,2},{1,3} and ep pairs {0,1},{2,3} made; data is the world
        pair_ep = [rank - rank % 2, rank - rank % 2 + 1]
        pair_dp = [rank % 2, rank % 2 + 2]
        assert v["2x1"] == {
            "made": 4, "dp": (pair_dp, False), "ep": (pair_ep, False), "tp": None,
            "data": (world, True),
        }  # fmt: skip
        # tp 2: dp = data = the ranks of one tp index (the same groups); tp {0,1},{2,3}
        assert v["1x2"] == {
            "made": 4, "dp": (pair_dp, False), "ep": None, "tp": (pair_ep, False),
            "data": (pair_dp, False),
        }  # fmt: skip
        assert v["4x1"] == {
            "made": 0, "dp": None, "ep": (world, True), "tp": None, "data": (world, True)
        }  # fmt: skip
        # ep 2 x tp 2: one dp rank; ep {0,2},{1,3}; tp {0,1},{2,3}; data = ep (the same)
        assert v["2x2"]["made"] == 4 and v["2x2"]["dp"] is None
        assert v["2x2"]["ep"] == v["2x2"]["data"] == (pair_dp, False)
        assert v["2x2"]["tp"] == (pair_ep, False)
