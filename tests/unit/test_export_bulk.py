"""The export's bulk path (issue 18): runs of adjacent small weights read with one read, checked
and quantized a stack of one shape at a time, written with one pwritev per file.

* the files are byte-identical to the per-item path's for every layout (the layouts that do not
  stack fall back to it), with files cut small so that runs straddle shard files, and whatever
  the number of files written at once (lanes: 1, the plan order, against 2 and 3);
* a refused weight inside a run gives the per-item path's one-line error, for the first refused
  weight in plan order, and nothing is left behind;
* every budget byte comes back and no run holds more than the budget;
* the pieces: a run's stacks (strided views of the down/gate/up turns of a MoE file), the
  stacked guard against the per-weight one, a span write, a truncated span read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qckpt.export.shares as shares
import qckpt.export.stages as pipe
from qckpt.errors import CheckpointError, ExportError
from qckpt.export.guard import check_source_stack, check_source_weight
from qckpt.export.plan import plan_export
from qckpt.export.stages import Pipeline
from qckpt.export.writer import WriteOptions
from qckpt.layouts.export_layout import CHUNK_ELEMS
from qckpt.read.sources import SafetensorsSource
from qckpt.recipe import ExportConfig
from qckpt.storage.shards import ShardFile, create_shard_file
from tests.export_fixtures import (
    make_calibration,
    quant_config,
    run_export,
    saved_model,
    tampered,
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("bulk")
    model, hf_dir = saved_model(root, "tiny-moe")
    return root, model, hf_dir


@pytest.fixture
def runs(monkeypatch):
    """Records every run's items and the budgets left (and their peaks) at the end."""
    seen: dict[str, list] = {"runs": [], "left": []}
    real_process, real_run = Pipeline._process_run, Pipeline.run

    def process_run(self, run, fut):
        seen["runs"].append([it.entry.name for it in run.items])
        return real_process(self, run, fut)

    def run(self, *a):
        try:
            return real_run(self, *a)
        finally:
            seen["left"].append((self.budget.used, self.budget.peak, self.budget.cap))

    monkeypatch.setattr(Pipeline, "_process_run", process_run)
    monkeypatch.setattr(Pipeline, "run", run)
    return seen


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _export(model, src, out, q, cal, bulk: bool, **kw):
    old = os.environ.get("QCKPT_EXPORT_BULK")
    os.environ["QCKPT_EXPORT_BULK"] = "1" if bulk else "0"
    try:
        return run_export(model, src, cal, out, q, **kw)
    finally:
        if old is None:
            del os.environ["QCKPT_EXPORT_BULK"]
        else:
            os.environ["QCKPT_EXPORT_BULK"] = old


LAYOUTS = {
    # name: (export format, weights, inputs, whether its weights stack)
    "ct tensor": ("compressed-tensors", "tensor", "static", True),
    "ct channel": ("compressed-tensors", "channel", "token", True),
    "ct block": ("compressed-tensors", "block", "group", False),
    "modelopt fp8": ("modelopt", "tensor", "static", False),
    "modelopt per channel": ("modelopt", "channel", "token", True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_runs_write_the_same_files_as_one_item_at_a_time(moe, runs, layout):
    root, model, hf_dir = moe
    fmt, w, i, stacks = LAYOUTS[layout]
    q = quant_config(w, i, block=(32, 32))
    cal = make_calibration(model, q)
    tag = layout.replace(" ", "-")
    # small shard files: a run's outputs land in two files, written with one call per file
    kw = {"fmt": fmt, "max_shard_size": "40KB"}
    plain = root / f"plain-{tag}"  # one item at a time, one file at a time, in plan order
    rep = _export(model, hf_dir, plain, q, cal, bulk=False, options=WriteOptions(lanes=1), **kw)
    assert runs["runs"] == [] and rep.lanes == 1
    out = root / f"bulk-{tag}"
    rep = _export(model, hf_dir, out, q, cal, bulk=True, **kw)
    assert (
        len(list(out.glob("*.safetensors"))) > 2 and rep.lanes == min(pipe.LANES, rep.shards) >= 2
    )
    assert rep.run_sources == sum(len(r) for r in runs["runs"]) < rep.source_tensors
    assert _digest(out) == _digest(plain)
    three = root / f"three-{tag}"  # three files at once, one item at a time
    rep = _export(model, hf_dir, three, q, cal, bulk=False, options=WriteOptions(lanes=3), **kw)
    assert rep.lanes == 3 and _digest(three) == _digest(plain)
    if stacks:  # the experts went in runs, several of them to a run
        taken = [n for r in runs["runs"] for n in r]
        assert sum("experts" in n for n in taken) == sum(
            "experts" in n for n in load_file(str(hf_dir / "model.safetensors"))
        )
        assert max(len(r) for r in runs["runs"]) > 3
    else:
        assert runs["runs"] == []
    used, peak, cap = runs["left"][-1]
    assert used == 0 and 0 < peak <= cap


def test_a_refused_weight_in_a_run_gives_the_first_ones_one_line_error(moe, runs):
    """Two bad experts of one layer (so of one run, in two stacks: an up and a later down);
    the first in plan order is named with the per-item path's message."""
    root, model, hf_dir = moe
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    first = "model.layers.0.mlp.experts.1.up_proj.weight"
    second = "model.layers.0.mlp.experts.2.down_proj.weight"

    def spoil(sd):
        sd[first][7].mul_(3.0)
        sd[second][3, 5] = float("nan")

    bad = tampered(root, hf_dir, "two-bad", spoil)
    out = root / "out-two-bad"
    with pytest.raises(ExportError) as e:
        _export(model, bad, out, q, cal, bulk=True)
    msg = str(e.value)
    assert msg.startswith(f"{first}: amax ") and "exceeds the calibrated weight amax" in msg
    assert "\n" not in msg and not out.exists()
    assert any(first in r and second in r for r in runs["runs"])
    with pytest.raises(ExportError) as plain:
        _export(model, bad, out, q, cal, bulk=False)
    assert str(plain.value) == msg

    nan = float("nan")
    only_nan = tampered(root, hf_dir, "nan-only", lambda sd: sd[second].__setitem__((3, 5), nan))
    with pytest.raises(ExportError) as e:
        _export(model, only_nan, out, q, cal, bulk=True)
    assert str(e.value) == (
        f"{second}: not finite (NaN or Inf in row 3) in the checkpoint; refusing to quantize it"
    )
    assert not out.exists()


def test_a_run_is_cut_into_stacks_of_evenly_spaced_weights_of_one_kind():
    # a MoE file's turns: down [4, 2], gate [2, 4], up [2, 4] per expert, 16 bytes each (bf16),
    # then two weights of the gate's shape that are no expert's
    names = [f"e.{e}.{p}" for e in range(3) for p in ("down", "gate", "up")] + ["q", "k"]
    shapes = [(4, 2), (2, 4), (2, 4)] * 3 + [(2, 4), (2, 4)]
    offsets = [16 * i for i in range(len(shapes))]
    stacks = shares.stacks(names, shapes, offsets, 2)
    got = [(s.index, s.shape, s.offset, s.stride) for s in stacks]
    assert got == [
        ([0, 3, 6], (4, 2), 0, 48),
        ([1, 4, 7], (2, 4), 16, 48),
        ([2, 5, 8], (2, 4), 32, 48),
        ([9], (2, 4), 144, 16),
        ([10], (2, 4), 160, 16),
    ]
    # a kind whose spacing changes is cut where it does
    got = shares.stacks(["a.0.w", "a.1.w", "a.2.w", "a.3.w"], [(2, 4)] * 4, [0, 16, 48, 64], 2)
    assert [(s.index, s.offset, s.stride) for s in got] == [([0, 1], 0, 16), ([2, 3], 48, 16)]
    # a view of the bytes through the stacks gives each weight back
    buf = torch.arange(len(shapes) * 8, dtype=torch.bfloat16)
    for s in stacks:
        assert all(offsets[i] == s.offset + j * s.stride for j, i in enumerate(s.index))
        r, c = s.shape
        v = buf.as_strided((len(s.index), r, c), (s.stride // 2, c, 1), s.offset // 2)
        for j, i in enumerate(s.index):
            assert torch.equal(v[j].reshape(-1), buf[offsets[i] // 2 : offsets[i] // 2 + 8])


def _guard_cases():
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16) for _ in range(5)]
    ws[1][3, 5] = float("nan")
    ws[2][60, 0] = float("-inf")
    ws[3][7].mul_(3.0)
    per_t = [w.float().abs().nan_to_num(0, 0, 0).amax() for w in ws]
    per_t[3] = ws[0].float().abs().amax()  # ws[3]'s row 7 grew past it
    per_row = [w.float().abs().nan_to_num(0, 0, 0).amax(dim=1) for w in ws]
    per_row[3] = ws[0].float().abs().amax(dim=1)
    return ws, per_t, per_row


@pytest.mark.parametrize("kind", ["tensor", "rows", "nan amax", "chunked", "mixed"])
def test_the_stacked_guard_agrees_with_the_per_weight_one(kind):
    ws, per_t, per_row = _guard_cases()
    amax = {"tensor": per_t, "rows": per_row, "chunked": per_t}.get(kind)
    if kind == "nan amax":
        amax = [torch.tensor(float("nan"))] + per_t[1:]
    if kind == "mixed":  # per-row and per-tensor amaxes in one stack: checked one by one
        amax = [per_row[0], per_t[1], per_row[2], per_t[3], per_row[4]]
    w = torch.stack(ws)
    chunk = 64 * 48 * 2 if kind == "chunked" else CHUNK_ELEMS
    got = check_source_stack(w, amax, chunk)
    want = [bool(check_source_weight("m", x, a)) for x, a in zip(ws, amax, strict=True)]
    assert got.dtype == torch.bool and got.tolist() == want
    assert any(want) and not all(want)


def test_a_span_write_puts_every_tensor_at_its_slot(tmp_path):
    from qckpt.layouts.export_layout import OutSpec

    specs = [OutSpec(f"t{i}", torch.uint8, (i + 1,)) for i in range(6)]
    path = tmp_path / "s.safetensors"
    create_shard_file(path, specs, {})
    data = {s.name: torch.full(s.shape, i + 1, dtype=torch.uint8) for i, s in enumerate(specs)}
    f = ShardFile(path, specs, {})
    # t0..t2 follow each other (one call), t4 after a gap, then t3 and t5 one by one
    order = ["t0", "t1", "t2", "t4"]
    n = f.write_span(order, [memoryview(data[k].numpy()) for k in order])
    assert n == 1 + 2 + 3 + 5
    f.write("t3", data["t3"])
    f.write_span(["t5"], [memoryview(data["t5"].numpy())])
    f.close()
    back = load_file(str(path))
    assert all(torch.equal(back[k], v) for k, v in data.items())
    f2 = ShardFile(path, specs, {}, names=["t0"])
    with pytest.raises(AssertionError):
        f2.write_span(["t0"], [memoryview(bytes(2))])  # one byte planned
    f2.abort()


def test_a_truncated_span_read_names_the_first_tensor_missing(tmp_path):
    sd = {f"w{i}": torch.full((4, 4), float(i), dtype=torch.bfloat16) for i in range(3)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path)
    entries = src.entries()
    got = src.read_span(entries)
    assert torch.equal(got.view(torch.bfloat16).reshape(3, 4, 4), torch.stack(list(sd.values())))
    size = (tmp_path / "model.safetensors").stat().st_size
    os.truncate(tmp_path / "model.safetensors", size - 40)
    with pytest.raises(CheckpointError, match=r"truncated data for tensor w1$"):
        src.read_span(entries)


@pytest.mark.parametrize("layout", ["ct tensor", "ct channel", "modelopt per channel"])
def test_runs_on_the_device_path_write_the_same_files(moe, runs, monkeypatch, layout):
    """A run's device path (one copy there, the quantized weights and verdicts back in one
    block with one wait) taken on the CPU: the same files as one item at a time."""
    root, model, hf_dir = moe
    fmt, w, i, _ = LAYOUTS[layout]
    q = quant_config(w, i)
    cal = make_calibration(model, q)
    tag = layout.replace(" ", "-")
    kw = {"fmt": fmt, "max_shard_size": "40KB"}
    plain = root / f"dev-plain-{tag}"
    _export(model, hf_dir, plain, q, cal, bulk=False, **kw)
    monkeypatch.setattr(Pipeline, "_runs_on_device", lambda self: True)
    out = root / f"dev-bulk-{tag}"
    _export(model, hf_dir, out, q, cal, bulk=True, **kw)
    assert runs["runs"] and _digest(out) == _digest(plain)
    assert runs["left"][-1][0] == 0


def test_a_refused_weight_on_the_runs_device_path_gives_the_per_item_error(moe, monkeypatch):
    root, model, hf_dir = moe
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"
    bad = tampered(root, hf_dir, "dev-bad", lambda sd: sd[name][4].mul_(3.0))
    out = root / "dev-out-bad"
    with pytest.raises(ExportError) as plain:
        _export(model, bad, out, q, cal, bulk=False)
    monkeypatch.setattr(Pipeline, "_runs_on_device", lambda self: True)
    with pytest.raises(ExportError) as e:
        _export(model, bad, out, q, cal, bulk=True)
    assert str(e.value) == str(plain.value) and str(e.value).startswith(f"{name}: amax ")
    assert not out.exists()


def test_two_lanes_still_name_the_first_refused_weight_in_plan_order(moe, runs):
    """Two shard files written at once (two lanes, taken by turns): a bad weight at the start
    of the second lane is quantized long before a bad weight at the end of the first, which
    comes earlier in plan order. The error names the earlier one (the first lane is finished up
    to it), with the message it has alone; the export leaves nothing."""
    root, model, hf_dir = moe
    q = quant_config("tensor", "static")
    cal = make_calibration(model, q)
    kw = {"max_shard_size": "40KB"}
    plan = plan_export(
        source=hf_dir,
        calibration=cal,
        output=root / "never",
        model_type="qwen3_moe",
        model_config=model.config,
        quant=q,
        export=ExportConfig(**kw),
    )
    items = shares.plan_items(plan)
    costs, files = [it.cost for it in items], [it.file_of[0] for it in items]
    order = shares.lane_order(costs, files, 2)
    cut = shares.split_balanced(costs, 2)[1].start
    quantized = [i for i, it in enumerate(items) if it.quantized_only]
    first = items[max(i for i in quantized if i < cut)].entry.name  # the first lane's last
    second = items[min(i for i in quantized if i >= cut)].entry.name  # the second's first
    taken = [items[i].entry.name if items[i].entry else None for i in order]
    assert taken.index(second) < len(items) // 4 < 3 * len(items) // 4 < taken.index(first)

    def spoil(sd):
        sd[first][1].mul_(3.0)
        sd[second][0, 1] = float("nan")

    bad = tampered(root, hf_dir, "two-lanes-bad", spoil)
    out = root / "out-two-lanes-bad"
    for bulk in (False, True):
        with pytest.raises(ExportError) as e:
            _export(model, bad, out, q, cal, bulk=bulk, options=WriteOptions(lanes=2), **kw)
        msg = str(e.value)
        assert msg.startswith(f"{first}: amax ") and "exceeds the calibrated weight amax" in msg
        assert "\n" not in msg and not out.exists()
        assert not [p for p in root.iterdir() if ".qckpt-" in p.name]  # no temp dir left
        assert runs["left"][-1][0] == 0  # the refusals gave their bytes back
    # the second alone is named when the first is clean
    only = tampered(root, hf_dir, "two-lanes-nan", lambda sd: sd[second].__setitem__((0, 1), 1e30))
    with pytest.raises(ExportError, match=f"^{second}: amax "):
        _export(model, only, out, q, cal, bulk=True, options=WriteOptions(lanes=2), **kw)
