"""StreamingDequantLoadPlanner: quantize once from the whole value, prepended axes, no state."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from qckpt import formats
from qckpt.convert.dcp import save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.load.destination import prepended_axes, unwrap_prepended
from qckpt.load.loader import load_checkpoint
from qckpt.load.meter import MemoryMeter
from qckpt.load.planner import StreamingDequantLoadPlanner
from qckpt.models import naming
from qckpt.read.dcp_reader import OrderedFileSystemReader
from tests.toy import FMTS, Toy, assert_same_model, same_tensor, toy_quantized

# ---- prepended singleton axes ------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prepended_axis_check_rejects_a_non_singleton_axis_in_any_position(k):
    dest = (6, 4)
    ok = torch.arange(24.0).view(*([1] * k), *dest)
    out = unwrap_prepended(ok, k)
    assert out.shape == dest and out.data_ptr() == ok.data_ptr()  # a view, not a copy
    assert prepended_axes(ok.shape, dest) == k
    for pos in range(k):
        shape = [1] * k
        shape[pos] = 2
        bad = torch.zeros(*shape, *dest)
        with pytest.raises(CheckpointError, match=f"axis {pos}"):
            unwrap_prepended(bad, k)
        with pytest.raises(CheckpointError, match=f"axis {pos}"):
            prepended_axes(bad.shape, dest, "w")


def test_prepended_axes_of_unrelated_shapes_is_zero():
    assert prepended_axes((6, 4), (6, 4)) == 0
    assert prepended_axes((1, 4, 6), (6, 4)) == 0  # does not end like the destination
    assert prepended_axes((24,), (6, 4)) == 0


@pytest.mark.parametrize("fmt", FMTS)
def test_unwrap_quantized_uses_view_without_dequantizing(fmt):
    q = formats.quantize(torch.randn(64, 64, dtype=torch.bfloat16), fmt)
    try:
        wrapped = q.view(1, 1, 64, 64)
    except formats.UnsupportedOpError:
        pytest.skip(f"{fmt} cannot add leading axes by view")
    # QuantizedTensor refuses every op it has no handler for, so a silent dequantize (t[0]
    # would be select) cannot hide here; the result shares the codes
    out = unwrap_prepended(wrapped, 2)
    assert tuple(out.shape) == (64, 64)
    assert out.qdata.data_ptr() == q.qdata.data_ptr()


@pytest.mark.parametrize("fmt", ["none", "fp8", "mxfp8"])
def test_checkpoint_with_prepended_axes_loads(tmp_path, fmt):
    if fmt != "none" and fmt not in formats.FORMATS:
        pytest.skip(f"{fmt} not built")
    src = Toy(seed=1)
    sd = src.state_dict()
    sd["l1.weight"] = sd["l1.weight"].view(1, 1, 96, 64)
    sd["moe.experts.down_proj"] = sd["moe.experts.down_proj"].view(1, 4, 32, 32)
    save_model_dcp(sd, tmp_path / "c")
    a = Toy(seed=9) if fmt == "none" else toy_quantized(fmt)
    load_checkpoint(a, tmp_path / "c")
    save_model_dcp(src, tmp_path / "plain")
    b = Toy(seed=9) if fmt == "none" else toy_quantized(fmt)
    load_checkpoint(b, tmp_path / "plain")
    assert_same_model(a, b)


@pytest.mark.parametrize("shape", [(2, 1, 96, 64), (1, 3, 96, 64)])
def test_checkpoint_with_non_singleton_prepended_axis_is_refused(tmp_path, shape):
    sd = Toy(seed=1).state_dict()
    sd["l1.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    save_model_dcp(sd, tmp_path / "c")
    pos = shape.index(next(s for s in shape[:2] if s != 1))
    with pytest.raises(CheckpointError, match=rf"^l1\.weight: .*prepended axis {pos}"):
        load_checkpoint(toy_quantized("fp8"), tmp_path / "c")


# ---- a destination in several read items is quantized once -------------------------------------


def _hf_dir_of(model, path):
    """The Toy as an HF dir: fused experts written per expert, as naming says."""
    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in model.state_dict().items():
        for hf_name, view in naming.hf_tensors(name, t, ""):
            out[hf_name] = view.contiguous().clone()
    save_file(out, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("fmt", FMTS)
def test_split_destination_is_quantized_once_from_the_whole_value(tmp_path, fmt):
    src = Toy(seed=4)
    _hf_dir_of(src, tmp_path / "hf")
    m = toy_quantized(fmt)
    rep = load_checkpoint(m, tmp_path / "hf")
    # gate_up arrives as 8 items (gate and up of 4 experts), down_proj as 4
    assert rep.read_items == 3 + 2 + 8 + 4
    full = src.moe.experts.gate_up_proj.detach()
    got = m.moe.experts.gate_up_proj
    if fmt == "fp8_delayed":
        want = formats.quantize(full, fmt)
        want.load_quant_state(got.quant_state())
        want.quantize_(full, update_state=False)
    else:
        want = formats.quantize(full, fmt, **got.opts)
    assert same_tensor(got, want)
    if fmt == "fp8":
        # what a per-slice quantize (Megatron's streaming copy_ per item) would have written:
        # each slice gets its own scale, and the values differ from the whole-tensor quantize
        slices = [v for _, v in naming.hf_tensors("moe.experts.gate_up_proj", full, "")]
        per_slice = torch.stack(
            [formats.quantize(s.contiguous(), fmt).dequantize(torch.float32) for s in slices]
        )
        whole = got.dequantize(torch.float32)
        whole_slices = torch.stack(
            [v for _, v in naming.hf_tensors("moe.experts.gate_up_proj", whole, "")]
        )
        assert not torch.equal(per_slice, whole_slices)
        scales = {float(formats.quantize(s.contiguous(), fmt).scale) for s in slices}
        assert len(scales) > 1 and float(got.scale) == max(scales)


# ---- plan order and state ----------------------------------------------------------------------


def _item(fqn, off, n):
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, torch.Size([off])),
        dest_offsets=torch.Size([off]),
        storage_index=MetadataIndex(fqn, torch.Size([off])),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([n]),
    )


def test_finish_plan_groups_a_destinations_items_and_counts_them():
    p = StreamingDequantLoadPlanner()
    q1 = formats.quantize(torch.randn(8), "fp8")
    q2 = formats.quantize(torch.randn(8), "fp8")
    p.set_up_planner({"a": q1, "b": q2, "c": torch.zeros(8)}, None)
    # files first, as a per-file reader would see them: a0 b0 c | a1 b1
    items = [
        _item("a", 0, 4),
        _item("b", 0, 4),
        _item("c", 0, 8),
        _item("a", 4, 4),
        _item("b", 4, 4),
    ]
    plan = p.finish_plan(LoadPlan(list(items)))
    assert [(i.dest_index.fqn, i.dest_offsets[0]) for i in plan.items] == [
        ("a", 0),
        ("a", 4),
        ("b", 0),
        ("b", 4),
        ("c", 0),
    ]
    assert p._dests["a"].expected == 2 and p._dests["b"].expected == 2
    with pytest.raises(CheckpointError, match="covers 4 of its 8"):
        p.set_up_planner({"a": q1}, None)
        p.finish_plan(LoadPlan([_item("a", 0, 4)]))


def _dcp_load(model, path, planner) -> None:
    """A bare single-process ``dcp.load`` into ``model`` through ``planner`` (no qckpt wrapper)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            model.state_dict(keep_vars=True),
            storage_reader=OrderedFileSystemReader(path),
            planner=planner,
            no_dist=True,
        )


def test_planner_holds_no_state_after_a_load(tmp_path):
    save_model_dcp(Toy(seed=1), tmp_path / "c")
    m = toy_quantized("fp8")
    meter = MemoryMeter("cpu")
    p = StreamingDequantLoadPlanner(meter=meter)
    _dcp_load(m, tmp_path / "c", p)
    assert p.pending() == {
        "destinations": 0,
        "plain_items": 0,
        "scratch_buffers": 0,
        "scratch_bytes": 0,
    }
    assert p._dests == {} and p._plain_expected == {} and p._user_sd == {} and p._main == {}
    assert meter.scratch == 0 and meter.peak_scratch == 2 * 4 * 64 * 32
    assert p.stats == {"items": 7, "quantized": 4, "plain": 3}
    ref = toy_quantized("fp8")
    load_checkpoint(ref, tmp_path / "c")
    assert_same_model(m, ref)


def test_planner_reset_after_a_failed_load_drops_the_scratch(tmp_path):
    sd = Toy(seed=1).state_dict()
    save_model_dcp(sd, tmp_path / "c")
    m = toy_quantized("fp8")

    def tap(fqn: str, value: torch.Tensor) -> None:
        # fails while the destination's scratch is live (a NaN/Inf check no longer does: it
        # is made after the last item, when every scratch is gone)
        if fqn.endswith("down_proj"):
            raise CheckpointError(f"{fqn}: cannot quantize (test)")

    p = StreamingDequantLoadPlanner(tap=tap)
    # DCP wraps what the planner raised in its CheckpointException (load_checkpoint unwraps it)
    with pytest.raises(BaseException, match="down_proj: cannot quantize"):
        _dcp_load(m, tmp_path / "c", p)
    assert p.pending()["scratch_buffers"] == 1  # the failed destination's scratch
    p.reset()
    assert p.pending()["destinations"] == 0 and p.pending()["scratch_buffers"] == 0
