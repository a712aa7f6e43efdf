"""TensorQuantizer max calibration, and the sync's rules in a world of one (no process group)."""

from __future__ import annotations

import pytest
import torch

from qckpt.calib.quantizer import AmaxStore, TensorQuantizer, host_amaxes
from qckpt.calib.sync import sync_amax
from qckpt.errors import CalibrationError, SyncError


def test_per_tensor_amax_is_running_max_of_abs():
    q = TensorQuantizer("model.layers.0.mlp.up_proj", "input", shape=(8,))
    assert q.amax is None
    q.collect(torch.tensor([[1.0, -3.0], [2.0, 0.5]]))
    q.collect(torch.tensor([[-2.5, 1.0]]))
    assert q.amax.item() == 3.0 and q.amax.dtype == torch.float32 and q.amax.shape == ()


def test_bf16_input_gives_exact_amax_in_calib_dtype():
    x = torch.randn(64, 32).to(torch.bfloat16)
    q = TensorQuantizer("m", "input", shape=(32,))
    q.collect(x)
    assert q.amax.item() == x.float().abs().max().item()


def test_per_channel_weight_amax():
    w = torch.randn(6, 10)
    q = TensorQuantizer("m", "weight", shape=(6, 10), granularity="channel")
    q.collect(w)
    assert torch.equal(q.amax, w.abs().amax(dim=1))


def test_static_per_block_weight_amax_with_ragged_edges():
    w = torch.randn(5, 9)
    q = TensorQuantizer("m", "weight", shape=(5, 9), granularity="block", block_size=(2, 4))
    q.collect(w)
    assert q.amax.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            ref = w[2 * i : 2 * i + 2, 4 * j : 4 * j + 4].abs().max()
            assert q.amax[i, j] == ref


def test_input_per_block_is_over_the_last_dim():
    x = torch.randn(3, 7, 10)
    q = TensorQuantizer("m", "input", shape=(10,), granularity="block", block_size=(128, 4))
    q.collect(x)
    ref = torch.stack([x[..., i : i + 4].abs().max() for i in (0, 4, 8)])
    assert torch.equal(q.amax, ref)


def test_nvfp4_global_amax_is_one_number():
    q = TensorQuantizer("m", "weight", shape=(32, 64), granularity="dynamic_block", fmt="nvfp4")
    w = torch.randn(32, 64)
    q.collect(w)
    assert q.amax.shape == () and q.amax == w.abs().max()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activation_is_an_error_naming_the_module(bad):
    q = TensorQuantizer("model.layers.1.self_attn.q_proj", "input", shape=(4,))
    x = torch.ones(2, 4)
    x[1, 2] = bad
    with pytest.raises(CalibrationError, match=r"model\.layers\.1\.self_attn\.q_proj.*non-finite"):
        q.collect(x)


def test_disabled_quantizer_does_not_collect():
    q = TensorQuantizer("m", "input", shape=(4,), enabled=False)
    q.collect(torch.ones(2, 4))
    assert q.amax is None


def test_amax_of_wrong_shape_is_refused():
    q = TensorQuantizer("m", "weight", shape=(4, 8), granularity="channel")
    with pytest.raises(ValueError, match="expected"):
        q.amax = torch.ones(8)


# ---- the sync in a world of one: same rules, no collectives -----------------------------------
def test_world_of_one_keeps_values_and_makes_no_collectives():
    a = TensorQuantizer("a", "input", shape=(4,))
    z = TensorQuantizer("z", "input", shape=(4,))
    u = TensorQuantizer("u", "input", shape=(4,))
    a.collect(torch.full((2, 4), 2.0))
    z.collect(torch.zeros(2, 4))
    r = sync_amax([a, z, u], None)
    assert r.collectives == 0
    assert a.amax.item() == 2.0 and z.amax.item() == 0.0 and u.amax is None
    assert r.uncalibrated == ["u.input_amax"]


def _experts(share: bool):
    layer = "model.layers.0.mlp.experts"
    return [
        TensorQuantizer(
            f"{layer}.{e}.down_proj",
            "input",
            shape=(4,),
            share_group=f"{layer}:down_input" if share else None,
            expert_layer=layer,
            expert=e,
        )
        for e in range(3)
    ]


def test_world_of_one_cold_expert_takes_layer_value():
    qs = _experts(share=True)
    qs[0].collect(torch.full((1, 4), 1.5))
    qs[1].collect(torch.full((1, 4), 4.0))
    r = sync_amax(qs, None)
    assert [q.amax.item() for q in qs] == [1.5, 4.0, 4.0]
    assert [q.shared_from_layer for q in qs] == [False, False, True]
    assert r.shared == ["model.layers.0.mlp.experts.2.down_proj.input_amax"]


def test_world_of_one_strict_mode_names_cold_experts():
    qs = _experts(share=False)
    qs[0].collect(torch.ones(1, 4))
    with pytest.raises(SyncError, match=r"MoE calibration incomplete.*experts: experts 1, 2"):
        sync_amax(qs, None)


def test_local_error_raises_in_a_world_of_one():
    q = TensorQuantizer("a", "input", shape=(4,))
    with pytest.raises(SyncError, match="boom"):
        sync_amax([q], None, local_error="boom")


def test_repeated_sync_is_stable_and_amax_resolves_to_tensors():
    qs = [TensorQuantizer(f"m{i}", "input", shape=(4,)) for i in range(50)]
    for i, q in enumerate(qs):
        q.collect(torch.full((1, 4), float(i)))
    sync_amax(qs, None)
    sync_amax(qs, None)
    assert [q.amax.item() for q in qs] == [float(i) for i in range(50)]
    assert all(isinstance(q.amax, torch.Tensor) and q.amax.shape == () for q in qs)
    qs[3].collect(torch.full((1, 4), 99.0))  # calibrating after a sync folds into the synced value
    assert qs[3].amax.item() == 99.0


def test_world_of_one_banks_in_any_order_leave_other_slots_alone():
    a, b = AmaxStore(capacity=2), AmaxStore(capacity=2)
    qa = [TensorQuantizer(f"a{i}", "input", shape=(4,), store=a) for i in range(5)]
    qb = [TensorQuantizer(f"b{i}", "input", shape=(4,), store=b) for i in range(2)]
    off = qa[2]
    off.amax = torch.tensor(7.0)
    off.enabled = False  # its slot sits between synced ones: untouched by the sync
    for q, v in ((qa[0], 1.0), (qa[3], 3.0), (qb[1], 4.0)):
        q.collect(torch.full((1, 4), v))
    qa[4].bank.values[qa[4].slot] = float("nan")  # a stale number in an absent slot is never read
    qs = [qa[4], qb[1], qa[3], off, qa[0], qb[0], qa[1]]
    r = sync_amax(qs, None)
    got = [None if q.amax is None else q.amax.item() for q in qs]
    assert got == [None, 4.0, 3.0, 7.0, 1.0, None, None]
    assert r.uncalibrated == ["a4.input_amax", "b0.input_amax", "a1.input_amax"]
    assert r.calibrated == 3 and r.quantizers == 6


def test_world_of_one_sharing_is_decided_layer_by_layer():
    def experts(layer: int, n: int, dtype=torch.float32):
        name = f"model.layers.{layer}.mlp.experts"
        return [
            TensorQuantizer(
                f"{name}.{e}.up_proj",
                "input",
                shape=(4,),
                share_group=f"{name}:up_input",
                expert_layer=name,
                expert=e,
                calib_dtype=dtype,
            )
            for e in range(n)
        ]

    hot_cold_hot = experts(0, 3, torch.bfloat16)
    cold = experts(1, 2)
    cold_hot = experts(2, 2)
    all_hot = experts(3, 2)
    hot_cold_hot[0].collect(torch.full((1, 4), 2.0, dtype=torch.bfloat16))
    hot_cold_hot[2].amax = torch.tensor(5.0)  # float32 on the second hot expert
    cold_hot[1].collect(torch.full((1, 4), 1.0))
    for q in all_hot:
        q.collect(torch.full((1, 4), 3.0))
    r = sync_amax(cold_hot + hot_cold_hot + cold + all_hot, None)
    # the layer's max, in the dtype of the layer's first calibrated expert
    assert hot_cold_hot[1].amax.item() == 5.0 and hot_cold_hot[1].amax.dtype == torch.bfloat16
    assert cold_hot[0].amax.item() == 1.0
    assert [q.amax for q in cold] == [None, None]
    shared = [q.shared_from_layer for q in hot_cold_hot + cold_hot]
    assert shared == [False, True, False, True, False]
    assert r.shared == [cold_hot[0].key, hot_cold_hot[1].key]  # in the order of the layers
    assert r.uncalibrated == [q.key for q in cold]


def test_a_cached_sync_plan_follows_enable_and_reshape():
    store = AmaxStore()
    t = TensorQuantizer("m.t", "input", shape=(4,), store=store)
    c = TensorQuantizer("m.c", "weight", shape=(4, 8), granularity="channel", store=store)
    qs = [t, c]
    c.collect(torch.ones(4, 8))
    assert sync_amax(qs, None).quantizers == 2
    t.enabled = False  # the same list again: the plan must drop t
    assert sync_amax(qs, None).quantizers == 1
    t.enabled = True
    # a static amax made whole (as after the TP gather) has a new shape: the plan's offsets follow
    c.make_whole((8, 8), torch.arange(8, dtype=torch.float32))
    r = sync_amax(qs, None)
    assert r.quantizers == 2 and c.amax.tolist() == list(map(float, range(8)))


def test_host_amaxes_are_each_quantizers_amax_bit_for_bit():
    # one store, per-tensor amaxes of three calibrator dtypes in one bank (one never set, one
    # pending from a forward hook, one -0.0), per-channel and per-block static ones, a disabled
    # one, and a quantizer of another store: host_amaxes reads them all in a few copies
    store = AmaxStore()
    mk = lambda name, **kw: TensorQuantizer(name, "input", shape=(8,), store=store, **kw)  # noqa: E731
    f64, bf16, none, pending = mk("a", calib_dtype=torch.float64), mk("b"), mk("c"), mk("d")
    f64.collect(torch.tensor([1.0 / 3.0, -2.0 / 7.0], dtype=torch.float64))
    bf16.amax = torch.tensor(-0.0, dtype=torch.bfloat16)
    pending.observe(torch.tensor([[0.25, -9.5]]))  # deferred until the store settles
    ch = TensorQuantizer("e", "weight", shape=(3, 4), granularity="channel", store=store)
    ch.collect(torch.randn(3, 4))
    blk = TensorQuantizer("f", "weight", shape=(5, 9), granularity="block", block_size=(2, 4))
    blk.collect(torch.randn(5, 9))
    off = mk("g", enabled=False)
    qs = [f64, bf16, none, pending, ch, blk, off]
    got = host_amaxes(qs)
    for q, a in zip(qs, got, strict=True):
        want = q.amax
        if want is None:
            assert a is None, q.name
            continue
        assert a.device.type == "cpu" and a.dtype == want.dtype and a.shape == want.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    assert got[3].item() == 9.5 and got[0].dtype == torch.float64
    # copies: a later sync writing into the bank or replacing a static amax leaves them alone
    before = [a.clone() for a in (got[0], got[4])]
    f64.amax = torch.tensor(5.0, dtype=torch.float64)
    ch.collect(torch.full((3, 4), 100.0))
    assert torch.equal(got[0], before[0]) and torch.equal(got[4], before[1])
