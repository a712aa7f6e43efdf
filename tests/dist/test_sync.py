"""The amax sync protocol over real gloo process groups, one test per clause of DESIGN.md.

Scenarios run on a shared live world of 4 ranks (``tests/dist/harness.py``); every group has a
10 s timeout, so a protocol that would hang fails the test instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qckpt.calib.quantizer import TensorQuantizer
from qckpt.calib.sync import COLLECTIVES_PER_SYNC, sync_amax
from tests.dist.harness import shared_world

pytestmark = pytest.mark.timeout(120)
N = 4


def _q(name: str, gran: str = "tensor", kind: str = "input", **kw) -> TensorQuantizer:
    shape = (4, 8) if kind == "weight" else (8,)
    if gran == "block":
        kw.setdefault("block_size", (4,) if kind == "input" else (2, 4))
    return TensorQuantizer(name, kind, shape=shape, granularity=gran, **kw)


def _feed(q: TensorQuantizer, value: float) -> None:
    q.collect(torch.full(q.shape, float(value)))


def _sync_or_error(qs, **kw):
    try:
        r = sync_amax(qs, dist.group.WORLD, **kw)
        return {"collectives": r.collectives}
    except Exception as exc:  # the outcome under test: which ranks raise what
        return {"error": f"{type(exc).__name__}: {exc}"}


def _amax(q):
    return None if q.amax is None else q.amax.tolist()


# ---- scenarios (module level: they are pickled to the ranks) -------------------------------------
def sc_group_max(rank, world):
    t = _q("m.t")
    c = _q("m.c", "channel", kind="weight")
    _feed(t, rank + 1)
    # per-channel: each rank is largest on a different channel; the MAX is elementwise
    w = torch.ones(4, 8)
    w[rank % 4] = 10 + rank
    c.collect(w)
    out = _sync_or_error([t, c])
    return out | {"t": _amax(t), "c": _amax(c)}


def sc_uneven_channel(rank, world):
    c = _q("model.layers.0.mlp.down_proj", "channel", kind="weight")
    ok = _q("model.layers.0.mlp.up_proj")
    if rank < 2:
        _feed(c, 1.0)
    _feed(ok, 1.0)
    return _sync_or_error([ok, c])


def sc_uneven_block(rank, world):
    b = _q("model.layers.1.self_attn.o_proj", "block", kind="input")
    if rank == 3:
        _feed(b, 2.0)
    return _sync_or_error([b])


def sc_ep_remote_expert_weight(rank, world, owner_lacks):
    # EP2 x DP2: ranks 0 and 1 hold expert 5 (local), ranks 2 and 3 keep a remote placeholder
    w = _q("model.layers.0.mlp.experts.5.down_proj", "channel", kind="weight", local=rank < 2)
    if rank == 0 or (rank == 1 and not owner_lacks):
        w.collect(torch.full((4, 8), 2.0))
    out = _sync_or_error([w])
    return out | {"w": _amax(w)}


def sc_nobody(rank, world):
    c = _q("m.c", "channel", kind="weight")
    b = _q("m.b", "block", kind="weight")
    t = _q("m.t")
    out = _sync_or_error([c, b, t])
    return out | {"c": _amax(c), "b": _amax(b), "t": _amax(t)}


def sc_nvfp4(rank, world):
    g = _q("m.nvfp4", "dynamic_block", fmt="nvfp4")
    if rank == 1:
        _feed(g, 6.5)
    out = _sync_or_error([g])
    return out | {"amax": _amax(g), "shape": None if g.amax is None else tuple(g.amax.shape)}


def sc_zero_vs_none(rank, world):
    z = _q("m.zero", kind="weight")
    u = _q("m.unseen")
    if rank == 2:
        z.collect(torch.zeros(4, 8))
    out = _sync_or_error([z, u])
    return out | {"zero": _amax(z), "unseen": _amax(u)}


def sc_dtypes(rank, world):
    only0 = _q("m.only0", calib_dtype=torch.bfloat16 if rank == 0 else torch.float32)
    mixed = _q("m.mixed", calib_dtype=torch.bfloat16 if rank == 0 else torch.float32)
    if rank == 0:
        _feed(only0, 3.0)
        _feed(mixed, 5.0)
    if rank == 1:
        _feed(mixed, 4.0)
    out = _sync_or_error([only0, mixed])
    return out | {
        "only0": (str(only0.amax.dtype), only0.amax.item()),
        "mixed": (str(mixed.amax.dtype), mixed.amax.item()),
    }


def sc_disabled(rank, world):
    a = _q("m.a")
    _feed(a, rank)
    qs = [a]
    if rank == 0:
        # disabled on rank 0 and not even known to the others: if it joined a collective, the
        # ranks would disagree and (without the layout check) wait on each other forever
        d = _q("m.dynamic_input", enabled=False)
        d.amax = torch.tensor(7.0)
        qs.append(d)
    out = _sync_or_error(qs)
    return out | {"a": _amax(a), "d": _amax(qs[1]) if rank == 0 else None}


def sc_layout_mismatch(rank, world):
    qs = [_q("m.a")]
    if rank == 3:
        qs.append(_q("m.extra"))
    return _sync_or_error(qs)


def sc_local_failure(rank, world):
    a = _q("m.a")
    _feed(a, 1.0)
    bad = _q("model.layers.3.mlp.experts.5.up_proj")
    if rank == 2:
        bad.amax = torch.tensor(float("nan"))  # what a NaN activation would leave behind
    return _sync_or_error([a, bad])


def _experts(layer: str, share: bool, n: int = 4):
    group = f"{layer}:gate_up_input" if share else None
    return [
        _q(f"{layer}.{e}.gate_proj", share_group=group, expert_layer=layer, expert=e)
        for e in range(n)
    ]


def sc_ep_share(rank, world):
    layer = "model.layers.0.mlp.experts"
    qs = _experts(layer, share=True)
    # rank 0 routes to expert 0, rank 1 to expert 1; nobody routes to experts 2 and 3
    if rank < 2:
        _feed(qs[rank], 2.0 + rank)
    out = _sync_or_error(qs)
    return out | {
        "amax": [_amax(q) for q in qs],
        "shared": [q.shared_from_layer for q in qs],
    }


def sc_ep_share_block(rank, world):
    layer = "model.layers.1.mlp.experts"
    qs = [
        _q(
            f"{layer}.{e}.down_proj",
            "block",
            share_group=f"{layer}:down_input",
            expert_layer=layer,
            expert=e,
        )
        for e in range(4)
    ]
    x = torch.arange(8.0) * (rank + 1)
    if rank in (0, 1):
        qs[0].collect(x.view(1, 8))  # expert 0 on ranks 0 and 1 only: not an error when shared
    if rank == 1:
        qs[1].collect(x.flip(0).view(1, 8))
    out = _sync_or_error(qs)
    return out | {"amax": [_amax(q) for q in qs], "shared": [q.shared_from_layer for q in qs]}


def sc_ep_strict(rank, world):
    layer = "model.layers.0.mlp.experts"
    qs = _experts(layer, share=False)
    if rank < 2:
        _feed(qs[rank], 2.0 + rank)
    return _sync_or_error(qs)


def sc_count_collectives(rank, world, n):
    import qckpt.calib.sync as sync_mod

    calls: list[tuple[str, str]] = []
    names = [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "all_to_all",
        "barrier",
        "send",
        "recv",
    ]
    saved = {k: getattr(dist, k) for k in names}
    saved_dev = sync_mod.group_device
    dev_calls = []

    def wrap(k):
        def f(*a, **kw):
            t = a[0] if a and isinstance(a[0], torch.Tensor) else None
            calls.append((k, str(t.device) if t is not None else "-"))
            return saved[k](*a, **kw)

        return f

    def rec_dev(group):
        dev_calls.append(group is dist.group.WORLD)
        return saved_dev(group)

    try:
        for k in names:
            setattr(dist, k, wrap(k))
        sync_mod.group_device = rec_dev
        qs = []
        for i in range(n):
            gran = ("tensor", "dynamic_block", "channel", "block")[i % 4]
            q = _q(f"model.layers.{i}.x", gran, kind="weight")
            q.collect(torch.full((4, 8), float(rank + i)))
            qs.append(q)
        r = sync_amax(qs, dist.group.WORLD)
    finally:
        for k, f in saved.items():
            setattr(dist, k, f)
        sync_mod.group_device = saved_dev
    return {"calls": calls, "reported": r.collectives, "dev_calls": dev_calls}


# ---- tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    return shared_world(N)


def _assert_all_ok(out):
    assert all(o.ok for o in out), out
    errs = [o.value.get("error") for o in out]
    assert errs == [None] * len(out), errs


def _assert_all_raise(out, *needles):
    assert all(o.ok for o in out), [o.traceback for o in out if not o.ok]
    for o in out:
        err = o.value.get("error")
        assert err is not None, f"rank {o.rank} did not raise"
        assert err.startswith("SyncError"), err
        for s in needles:
            assert s in err, (s, err)


def test_group_max_over_ranks_that_all_calibrated(world):
    out = world.run(sc_group_max)
    _assert_all_ok(out)
    for o in out:
        assert o.value["t"] == 4.0
        assert o.value["c"] == [10.0, 11.0, 12.0, 13.0]


def test_uneven_per_channel_raises_on_every_rank_naming_it(world):
    out = world.run(sc_uneven_channel)
    _assert_all_raise(out, "model.layers.0.mlp.down_proj.weight_amax", "2 of 4 ranks lacked it")
    # at once: nobody waits for a timeout
    assert max(o.seconds for o in out) < 5.0


def test_uneven_per_block_raises_on_every_rank(world):
    out = world.run(sc_uneven_block)
    _assert_all_raise(out, "model.layers.1.self_attn.o_proj.input_amax", "3 of 4 ranks lacked it")


def test_remote_expert_weight_needs_only_its_holders(world):
    out = world.run(sc_ep_remote_expert_weight, False)
    _assert_all_ok(out)
    assert [o.value["w"] for o in out] == [[2.0] * 4] * 4  # the holders' value reaches everyone
    out = world.run(sc_ep_remote_expert_weight, True)
    _assert_all_raise(out, "experts.5.down_proj.weight_amax", "1 of 2 ranks lacked it")


def test_per_channel_nobody_calibrated_is_fine(world):
    out = world.run(sc_nobody)
    _assert_all_ok(out)
    for o in out:
        assert (o.value["c"], o.value["b"], o.value["t"]) == (None, None, None)


def test_nvfp4_dynamic_block_syncs_as_per_tensor(world):
    out = world.run(sc_nvfp4)
    _assert_all_ok(out)  # only rank 1 has it, and that is fine for a per-tensor global amax
    for o in out:
        assert o.value["amax"] == 6.5 and o.value["shape"] == ()


def test_calibrated_zero_survives_uncalibrated_stays_none(world):
    out = world.run(sc_zero_vs_none)
    _assert_all_ok(out)
    for o in out:
        assert o.value["zero"] == 0.0
        assert o.value["unseen"] is None


def test_dtype_kept_and_adopted(world):
    out = world.run(sc_dtypes)
    _assert_all_ok(out)
    # only rank 0 calibrated (in bfloat16): every other rank adopts bfloat16
    assert [o.value["only0"] for o in out] == [("torch.bfloat16", 3.0)] * 4
    # ranks 0 (bf16) and 1 (fp32) calibrated: each keeps its dtype; 2 and 3 adopt the group's
    mixed = [o.value["mixed"] for o in out]
    assert mixed[0] == ("torch.bfloat16", 5.0)
    assert mixed[1] == ("torch.float32", 5.0)
    assert mixed[2] == mixed[3] == ("torch.float32", 5.0)


def test_disabled_quantizers_join_nothing(world):
    out = world.run(sc_disabled, deadline_s=30)
    _assert_all_ok(out)
    assert [o.value["a"] for o in out] == [3.0] * 4
    assert out[0].value["d"] == 7.0  # left alone
    assert len({o.value["collectives"] for o in out}) == 1


def test_layout_mismatch_raises_on_every_rank_not_hangs(world):
    out = world.run(sc_layout_mismatch, deadline_s=30)
    _assert_all_raise(out, "disagree")


def test_local_failure_raises_on_every_rank(world):
    out = world.run(sc_local_failure)
    _assert_all_raise(out)
    assert "non-finite" in out[2].value["error"]
    assert "model.layers.3.mlp.experts.5.up_proj.input_amax" in out[2].value["error"]
    for o in (out[0], out[1], out[3]):
        assert "rank 2 of 4 failed" in o.value["error"]


def test_ep_opt_in_gives_cold_experts_the_layer_value(world):
    out = world.run(sc_ep_share)
    _assert_all_ok(out)
    for o in out:
        assert o.value["amax"] == [2.0, 3.0, 3.0, 3.0]
        assert o.value["shared"] == [False, False, True, True]


def test_ep_opt_in_block_inputs_seen_by_some_ranks_are_fine(world):
    out = world.run(sc_ep_share_block)
    _assert_all_ok(out)
    for o in out:
        # blocks of 4: expert 0 is the max of ranks 0 and 1, expert 1 is rank 1's alone
        assert o.value["amax"][0] == [6.0, 14.0]
        assert o.value["amax"][1] == [14.0, 6.0]
        # cold experts: the elementwise max over the layer's experts
        assert o.value["amax"][2] == o.value["amax"][3] == [14.0, 14.0]
        assert o.value["shared"] == [False, False, True, True]


def test_strict_moe_raises_incomplete_on_every_rank(world):
    out = world.run(sc_ep_strict)
    _assert_all_raise(out, "MoE calibration incomplete", "model.layers.0.mlp.experts: experts 2, 3")


def test_collective_count_does_not_grow_with_quantizers(world):
    small = world.run(sc_count_collectives, 8)
    large = world.run(sc_count_collectives, 400)
    for o in small + large:
        assert o.ok, o.traceback
        calls = o.value["calls"]
        assert [k for k, _ in calls] == ["all_reduce"] * COLLECTIVES_PER_SYNC
        assert o.value["reported"] == COLLECTIVES_PER_SYNC
        # gloo: the buffers live on the CPU, as group_device says for this group
        assert {d for _, d in calls} == {"cpu"}
        assert o.value["dev_calls"] == [True]


# ---- random scenarios against a reference written from DESIGN.md --------------------------------
_DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_PREF = ["f32", "f16", "bf16"]  # the order of preference among these (after float64)


def sc_random(rank, world, spec):
    qs = []
    for i, s in enumerate(spec):
        q = _q(f"model.layers.{i}.q", s["gran"], kind="weight", calib_dtype=_DT[s["dt"][rank]])
        if rank in s["have"]:
            w = torch.tensor(s["vals"][rank], dtype=torch.float32).view(4, 8)
            q.collect(w.to(_DT[s["dt"][rank]]))
        qs.append(q)
    out = _sync_or_error(qs)
    out["amax"] = [None if q.amax is None else q.amax.float().flatten().tolist() for q in qs]
    out["dtype"] = [None if q.amax is None else str(q.amax.dtype).replace("torch.", "") for q in qs]
    return out


def _reference(spec, rank, world):
    """What DESIGN.md says rank ``rank`` ends with, or the error every rank raises."""
    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    amax, dtype = [], []
    for s in spec:
        have = sorted(s["have"])
        if s["gran"] in ("channel", "block") and 0 < len(have) < world:
            return "SyncError"
        if not have:
            amax.append(None)
            dtype.append(None)
            continue
        vals = []
        for r in have:
            w = torch.tensor(s["vals"][r]).view(4, 8).to(_DT[s["dt"][r]])
            q = _q("x", s["gran"], kind="weight", calib_dtype=_DT[s["dt"][r]])
            vals.append(q.reduce(w).float())
        m = torch.stack(vals).amax(dim=0)
        mine = s["dt"][rank] if rank in have else min((s["dt"][r] for r in have), key=_PREF.index)
        amax.append(m.to(_DT[mine]).float().flatten().tolist())
        dtype.append({v: k for k, v in names.items()}[mine])
    return amax, dtype


def test_random_presence_patterns_match_the_design(world):
    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        spec = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            gran = ["tensor", "dynamic_block", "channel", "block"][
                int(torch.randint(0, 4, (1,), generator=g))
            ]
            # static quantizers mostly all-or-nothing (else the whole sync raises); sometimes not
            if gran in ("channel", "block") and trial % 3:
                have = list(range(N)) if torch.rand(1, generator=g) < 0.7 else []
            else:
                have = [r for r in range(N) if torch.rand(1, generator=g) < 0.5]
            spec.append(
                {
                    "gran": gran,
                    "have": have,
                    "dt": [_PREF[int(torch.randint(0, 3, (1,), generator=g))] for _ in range(N)],
                    "vals": [(torch.randn(32, generator=g) * 3).tolist() for _ in range(N)],
                }
            )
        out = world.run(sc_random, spec)
        for o in out:
            assert o.ok, o.traceback
            ref = _reference(spec, o.rank, N)
            if ref == "SyncError":
                assert o.value["error"].startswith("SyncError"), (trial, o.value)
                continue
            assert "error" not in o.value, (trial, o.value["error"])
            assert (o.value["amax"], o.value["dtype"]) == ref, (trial, o.rank, spec)
