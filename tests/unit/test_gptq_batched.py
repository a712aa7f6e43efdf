"""GPTQ batched over a stack of linears (an MoE layer's experts: one Cholesky call, one batched
GEMM per block update, one Hessian GEMM per group of experts) against the per-linear reference
(``gptq.REFERENCE``: one call per linear / expert): the same bits for every weight format GPTQ
quantizes, cold experts included, on CPU. The pass's sidecar and calibration file too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qckpt.calib import gptq, gptq_hessians
from qckpt.calib.gptq_pass import per_expert
from qckpt.formats.act_quant import InputQuant
from qckpt.formats.scheme import make_scheme

SHAPE = (40, 160)  # 160 columns: a block of 128 and a partial one of 32
# (name, scheme kwargs, act_order, block search)
CASES = {
    "fp8_tensor": (dict(fmt="fp8"), False, False),
    "fp8_channel_ao": (dict(fmt="fp8", granularity="channel"), True, False),
    "fp8_block": (dict(fmt="fp8", granularity="block", block=(32, 32)), False, False),
    "nvfp4": (dict(fmt="nvfp4"), False, False),
    "nvfp4_mse": (dict(fmt="nvfp4"), False, True),
    "int4": (dict(fmt="int4", granularity="group", block=(1, 32)), False, False),
    "int4_asym": (
        dict(fmt="int4", granularity="group", block=(1, 32), symmetric=False),
        False,
        False,
    ),  # fmt: skip
    "int4_asym_ao": (
        dict(fmt="int4", granularity="group", block=(1, 32), symmetric=False),
        True,
        False,
    ),  # fmt: skip
    "int8_channel": (dict(fmt="int8", granularity="channel"), False, False),
    "mxfp4": (dict(fmt="mxfp4"), False, False),
    "mxfp8": (dict(fmt="mxfp8"), False, False),
}


def _scheme(name: str):
    kw = dict(CASES[name][0])
    return make_scheme(kw.pop("fmt"), **kw)


def _amax(name: str, w: torch.Tensor) -> torch.Tensor:
    gran = CASES[name][0].get("granularity", "tensor")
    if gran == "channel":
        return w.abs().amax(dim=1)
    if gran == "block":
        b = 32
        pad = torch.nn.functional.pad(w, (0, -w.shape[1] % b, 0, -w.shape[0] % b))
        return pad.abs().reshape(pad.shape[0] // b, b, -1, b).amax(dim=(1, 3))
    if gran == "group":
        return w.abs().reshape(w.shape[0], -1, 32).amax(-1)
    return w.abs().max()


def _hessian(seed: int, n: int, dead_col: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g) @ torch.randn(16, SHAPE[1], generator=g)
    x = (x + 0.3 * torch.randn(n, SHAPE[1], generator=g)).to(torch.bfloat16).float()
    x = x * torch.logspace(-1, 1, SHAPE[1])[torch.randperm(SHAPE[1], generator=g)]
    if dead_col is not None:
        x[:, dead_col] = 0  # an input column no token moved: its diagonal is 0
    return gptq.hessian_add(None, x, float(x.abs().max()), gptq.grid_bits(2048))


def _stack():
    """The linears of one MoE layer side: experts 0-2 a gate and an up sharing their input's
    Hessian, expert 3 cold (no Hessian), expert 4 an all-zero one, expert 5 one with a dead
    input column; every weight its own."""
    ha, hb, hc = _hessian(1, 400), _hessian(2, 300), _hessian(3, 500, dead_col=7)
    hs = [ha, ha, hb, hb, hc, hc, None, None, torch.zeros_like(ha), _hessian(4, 256, 3)]
    ws = [
        (0.02 * (1 + k % 3)) * torch.randn(SHAPE, generator=torch.Generator().manual_seed(40 + k))
        for k in range(len(hs))
    ]
    return [w.to(torch.bfloat16).float() for w in ws], hs


def _run(name: str, batching: gptq.Batching):
    _, act_order, search = CASES[name]
    ws, hs = _stack()
    qs = [
        gptq.ColumnQuantizer(_scheme(name), _amax(name, w), SHAPE, search=search,
                             scale_dtype=torch.bfloat16)
        for w in ws
    ]  # fmt: skip
    got = gptq.gptq_batch(ws, hs, qs, act_order=act_order, batching=batching)
    return got, qs


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("chunks", ["whole", "parts"])
def test_batched_gptq_gives_every_linear_the_reference_bits(name, chunks, monkeypatch):
    if chunks == "parts":  # stacks of 4, factors 2 a call, updates 3 linears a GEMM
        monkeypatch.setattr(gptq, "STACK_BYTES", 4 * gptq.linear_stack_bytes(*SHAPE))
        monkeypatch.setattr(gptq, "FACTOR_BYTES", 2 * 20 * SHAPE[1] ** 2)
        monkeypatch.setattr(gptq, "UPDATE_BYTES", 3 * 4 * SHAPE[0] * (SHAPE[1] - 128))
    ref, ref_q = _run(name, gptq.REFERENCE)
    got, got_q = _run(name, gptq.Batching())
    for k, ((a, la), (b, lb)) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), (name, k)
        assert la == lb, (name, k)
    for qa, qb in zip(ref_q, got_q, strict=True):
        if gptq.makes_group_scales(qa.scheme):
            assert torch.equal(qa.block_scales.view(torch.uint8), qb.block_scales.view(torch.uint8))
            if qa.zero_points is not None:
                assert torch.equal(qa.zero_points, qb.zero_points)
    # the cold expert and the all-zero Hessian: rounded to nearest, as before
    fresh = gptq.ColumnQuantizer(_scheme(name), _amax(name, _stack()[0][6]), SHAPE,
                                 scale_dtype=torch.bfloat16)  # fmt: skip
    assert torch.equal(got[6][0], gptq.round_to_nearest(_stack()[0][6].clone(), fresh))
    assert got[6][1] == 0.0 and got[8][1] == 0.0
    # and GPTQ did move the others off rounding to nearest
    assert not torch.equal(got[0][0], gptq.round_to_nearest(_stack()[0][0].clone(), ref_q[6]))


def _counting(monkeypatch, fn_path: tuple, seen: list):
    owner, name = fn_path
    real = getattr(owner, name)

    def spy(x, *a, **kw):
        seen.append(x.dim())
        return real(x, *a, **kw)

    monkeypatch.setattr(owner, name, spy)


@pytest.mark.parametrize("batched", [True, False])
def test_the_stack_takes_one_factor_call_and_one_gemm_per_block(batched, monkeypatch):
    chol, mm = [], []
    _counting(monkeypatch, (torch.linalg, "cholesky"), chol)
    _counting(monkeypatch, (torch, "bmm"), mm)
    _run("nvfp4", gptq.Batching() if batched else gptq.REFERENCE)
    if batched:  # 4 distinct live Hessians: 2 Cholesky calls (H, then H^-1) on [4, n, n]
        assert chol == [3, 3]
        assert mm == [3]  # one block is followed by columns: one batched GEMM
    else:
        assert chol == [2] * 8 and mm == []


def _rows(seed: int, counts: list[int], d: int = 48):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in enumerate(counts)])
    x = (torch.randn(len(ids), d, generator=g) * torch.logspace(-1, 1, d)).to(torch.bfloat16)
    return x, ids


KEYS = [f"experts:{e}:gate_up" for e in (3, 9, 10, 11, 12, 20, 21)]  # local row -> global key


def _amaxes(batches) -> dict[str, float]:
    out: dict[str, float] = {}
    for x, ids in batches:
        for r, rows in per_expert(x, ids):
            out[KEYS[r]] = max(out.get(KEYS[r], 0.0), float(rows.float().abs().max()))
    out[KEYS[4]] = 0.0  # a key whose amax is 0: it takes no Hessian (as the pass skips it)
    return out


@pytest.mark.parametrize("inputs", ["source", "fp8_token", "nvfp4"])
@pytest.mark.parametrize("group_bytes", [1 << 29, 40_000])
def test_expert_hessians_in_groups_are_each_experts_own(inputs, group_bytes, monkeypatch):
    monkeypatch.setattr(gptq_hessians, "GROUP_BYTES", group_bytes)
    # uneven routing, an expert no row reached (2) and one alone in a batch (the last)
    batches = [_rows(0, [50, 47, 0, 10, 44, 45, 1]), _rows(1, [3, 60, 0, 58, 7, 0, 0]),
               _rows(2, [0, 0, 0, 0, 0, 0, 9])]  # fmt: skip
    amax = _amaxes(batches)
    bits = gptq.grid_bits(400)
    iq = None
    if inputs == "fp8_token":
        iq = InputQuant("fp8_token")
    elif inputs == "nvfp4":
        iq = InputQuant("nvfp4", scale=torch.tensor(6.0 * 448.0 / 3.0))
    ref_h: dict = {}
    ref_c: dict = {}
    got_h: dict = {}
    got_c: dict = {}
    for x, ids in batches:
        for r, rows in per_expert(x, ids):
            key = KEYS[r]
            if amax[key] <= 0:
                continue
            if iq is None:
                ref_h[key] = gptq.hessian_add(ref_h.get(key), rows, amax[key], bits)
            else:
                ref_h[key], ref_c[key] = gptq.quantized_add(
                    ref_h.get(key), ref_c.get(key), rows, iq(rows), amax[key], bits
                )
        gptq_hessians.add_experts(got_h, got_c, x, ids, KEYS, amax, bits, iq)
    assert sorted(got_h) == sorted(ref_h) == sorted(k for k in KEYS if amax.get(k, 0) > 0)
    assert sorted(got_c) == sorted(ref_c)
    for key in ref_h:
        assert torch.equal(got_h[key], ref_h[key]), key
        if iq is not None:
            assert torch.equal(got_c[key], ref_c[key]), key
            assert not torch.equal(got_c[key], got_h[key])  # the inputs were quantized


# the pass: (calibrate case, quant) of tests/dist/test_algorithms_dist.py, on the tiny MoE with
# cold experts; batched and per-expert must write the same sidecar and calibration bytes
# (every weight format's sweep is compared above; here the Hessians and the pass around them)
PASS_CASES = [
    ("gptq+ao", "fp8_channel"), ("gptq+qin", "nvfp4"), ("gptq", "int4"),
    ("gptq+ao", "int4_asym"), ("gptq+qin", "int8"), ("gptq", "mxfp4"), ("gptq+qin", "mixed"),
]  # fmt: skip


def _calibrated(tmp: Path, case: str, quant: str, batching, moe_forward: str):
    """(the calibration file's bytes, the sidecar's tensors' bytes) of the dist tests' one
    process run (tests/dist/test_algorithms_dist.sc_calibrate) with ``batching``."""
    from qckpt.calib.calibrate import calibrate_model
    from qckpt.calib.data import calibration_batches
    from qckpt.calib.gptq_pass import write_weights
    from qckpt.calib.state_file import save_calibration
    from qckpt.parallel.mesh import Mesh
    from qckpt.pipeline.calibrate import algorithm_of
    from qckpt.pipeline.model import build
    from qckpt.recipe import recipe_from_dict
    from tests.dist import test_algorithms_dist as algos
    from tests.dist.test_ep_calibration import starve_experts

    q = {**algos.QUANTS[quant], "ignore": ["lm_head", "*.mlp.gate"]}
    cal = {"data": algos.DATA, **algos.OPTIONS.get(case, {"algorithm": case})}
    r = recipe_from_dict({"quant": q, "calibrate": cal})
    model = build(
        "tiny-moe", Mesh(), seeded=True, before_shard=lambda m: starve_experts(m, cold=algos.COLD)
    ).model
    batches = calibration_batches(r.calibrate.data, vocab_size=256, data_rank=0, data_world=1)
    old = gptq.BATCHING
    gptq.BATCHING = batching
    try:
        state, _ = calibrate_model(
            model, batches, r.quant, Mesh(), algorithm=algorithm_of(r), moe_forward=moe_forward
        )
    finally:
        gptq.BATCHING = old
    out = tmp / "c.safetensors"
    write_weights(state, str(out), Mesh())
    save_calibration(state, out)
    side = {}
    for f in sorted(Path(f"{out}.gptq").glob("*.safetensors")):
        side.update({k: t.contiguous().view(-1).view(torch.uint8) for k, t in load_file(f).items()})
    return out.read_bytes(), side


@pytest.mark.parametrize(("case", "quant"), PASS_CASES)
def test_the_pass_writes_the_same_files_batched_or_per_expert(tmp_path, case, quant):
    (tmp_path / "ref").mkdir()
    (tmp_path / "new").mkdir()
    ref = _calibrated(tmp_path / "ref", case, quant, gptq.REFERENCE, "eager")
    got = _calibrated(tmp_path / "new", case, quant, gptq.Batching(), "eager")
    assert got[1] and sorted(got[1]) == sorted(ref[1])
    for name, t in ref[1].items():
        assert torch.equal(got[1][name], t), name
    assert got[0] == ref[0]


def test_the_grouped_forward_taps_batch_both_sides_to_the_same_files(tmp_path):
    # calibrate.moe_forward: grouped taps the down side with every expert's rows at once too
    (tmp_path / "ref").mkdir()
    (tmp_path / "new").mkdir()
    ref = _calibrated(tmp_path / "ref", "gptq+qin", "nvfp4", gptq.REFERENCE, "grouped")
    got = _calibrated(tmp_path / "new", "gptq+qin", "nvfp4", gptq.Batching(), "grouped")
    assert got[0] == ref[0] and sorted(got[1]) == sorted(ref[1])
    assert all(torch.equal(got[1][name], t) for name, t in ref[1].items())


def test_batching_is_checked_where_built():
    with pytest.raises(ValueError, match="Batching.update must be a bool"):
        gptq.Batching(update="yes")
