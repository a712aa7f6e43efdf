"""``qckpt plan``'s predictions against what the commands measure (one rank, in process), its
layout suggestion, and its refusals of bad input. Sharded loads: tests/dist/test_plan_sharded.py;
the model configs of docs/SCALING.md: tests/unit/test_plan_models.py."""

from __future__ import annotations

import json

import pytest
import torch

from qckpt import formats
from qckpt.cli.app import main
from qckpt.convert.dcp import save_model_dcp
from qckpt.load.loader import load_checkpoint
from qckpt.models.build import build_model
from qckpt.parallel.mesh import Mesh
from qckpt.pipeline.load import build_for_load
from qckpt.pipeline.plan import plan
from qckpt.plan.fields import field_specs
from qckpt.plan.layouts import Layout
from qckpt.recipe import load_recipe
from tests.conftest import ROOT, run_qckpt

RECIPE = str(ROOT / "configs" / "tiny-moe.yaml")


def held_bytes(model: torch.nn.Module) -> int:
    """What a rank's model holds: every parameter and buffer once, quantized ones as stored."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            q = formats.is_quantized(t)
            total += t.quantized_nbytes() if q else t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_field_shapes_are_the_formats_own(fmt):
    opts_list = [{}]
    if fmt == "fp8":
        opts_list.append({"granularity": "channel"})
    if fmt == "fp8_block":
        opts_list.append({"block_size": (16, 48)})
    for shape in [(64, 48), (3, 40, 130), (33,), (130, 257)]:
        for opts in opts_list:
            q = formats.quantize(torch.randn(shape, dtype=torch.bfloat16), fmt, **opts)
            real = {k: (tuple(getattr(q, k).shape), getattr(q, k).dtype) for k in q.fields()}
            assert real == field_specs(fmt, shape, opts), (fmt, shape, opts)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    model = build_model("tiny-moe", seed=0)
    save_model_dcp(model, d / "dcp")
    model.save_pretrained(d / "hf")
    return d


@pytest.mark.parametrize(
    ("kind", "fmt", "reader"),
    [
        ("dcp", "fp8", "fast"),
        ("dcp", "nvfp4", "plain"),  # the plain DCP reader reads each stored chunk whole
        ("hf", "fp8_block", "fast"),
        ("hf", "mxfp8", "plain"),
        ("hf", "none", "fast"),
    ],
)
def test_one_rank_load_is_predicted_exactly(checkpoints, kind, fmt, reader):
    sets = [f"checkpoint.path={checkpoints / kind}", f"load.params={fmt}", f"load.reader={reader}"]
    r = load_recipe(RECIPE, sets)
    built = build_for_load(r, Mesh())
    rep = load_checkpoint(
        built.model,
        r.checkpoint.path,
        mesh=Mesh(),
        reader=r.load.reader,
        max_inflight=r.load.max_inflight,
    )
    (row,) = plan(r, nproc_per_node=1).rows["load"]
    assert row.parameter_bytes == held_bytes(built.model)
    assert row.bytes_read == rep.bytes_read > 0
    # the report's own prediction (load.max_inflight scratches), which bounds what it measured
    assert row.transient_bytes == rep.predicted_transient_bytes >= rep.transient_bytes
    assert (row.transient_bytes > 0) == (fmt != "none")


def test_fp32_main_params_are_counted(checkpoints):
    sets = [f"checkpoint.path={checkpoints / 'dcp'}", "load.main_params=fp32"]
    r = load_recipe(RECIPE, sets)
    built = build_for_load(r, Mesh())
    rep = load_checkpoint(built.model, r.checkpoint.path, mesh=Mesh(), main_params="fp32")
    (row,) = plan(r, nproc_per_node=1).rows["load"]
    assert rep.main_params_bytes > 0
    assert row.parameter_bytes == held_bytes(built.model) + rep.main_params_bytes


def test_a_split_inside_a_scale_block_is_refused_as_the_load_refuses_it():
    # tiny-moe's 64-wide linears split over TP2: 32 rows, inside a 128x128 fp8_block tile
    r = load_recipe(
        RECIPE, ["checkpoint.path=/nonexistent", "load.params=fp8_block", "parallel.tp=2"]
    )
    res = plan(r, nproc_per_node=2, device_bytes=10**12)
    assert res.fits("load") is False
    for row in res.rows["load"]:
        assert "inside a 128-element fp8_block scale block" in row.refused
    assert res.fits("calibrate")  # BF16-resident: nothing quantized, nothing refused
    assert res.suggestions["load"].tp == 1  # EP or DP instead


def test_no_checkpoint_reads_the_bf16_size():
    r = load_recipe(RECIPE, ["checkpoint.path=/nonexistent/dcp"])
    res = plan(r, nproc_per_node=1)
    model = build_model("tiny-moe", seed=0)
    bf16 = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert res.rows["load"][0].bytes_read == bf16
    assert res.rows["calibrate"][0].bytes_read == bf16
    assert "no checkpoint" in res.checkpoint


def test_calibrate_offload_keeps_the_activations_between_layers():
    from qckpt.plan.layouts import parse_layout

    r = load_recipe(RECIPE, ["checkpoint.path=/nonexistent/dcp"])
    lays = [parse_layout(s, Layout()) for s in ("offload=layer", "offload=host,activations=host")]
    res = plan(r, nproc_per_node=2, layouts=lays)
    layer, host = (res.extra[x.label()]["calibrate"] for x in lays)
    # 16 samples in batches of 4 over 2 data ranks: 8 samples each, hidden 64, bf16
    kept = 8 * r.calibrate.data.seq_len * 64 * 2
    model = build_model("tiny-moe", seed=0)
    layer_bytes = sum(p.numel() * 2 for p in model.model.layers[0].parameters())
    outer = sum(p.numel() * 2 for n, p in model.named_parameters() if "layers." not in n)
    outer -= model.lm_head.weight.numel() * 2  # ignored: never on the device
    outer += sum(b.numel() * b.element_size() for b in model.buffers())
    for full, on_dev, on_host in zip(res.rows["calibrate"], layer, host, strict=True):
        assert on_dev.activation_bytes == kept and on_host.activation_bytes == 0
        assert full.activation_bytes == 0 and on_dev.forward_bytes > 0
        assert on_host.host_bytes - on_dev.host_bytes == kept + 2 * layer_bytes
        assert on_dev.parameter_bytes == on_host.parameter_bytes == outer + 2 * layer_bytes
        head = model.lm_head.weight.numel() * 2  # ignored: never fetched, never read
        assert on_dev.bytes_read == full.bytes_read - head


def test_too_small_a_gpu_does_not_fit_and_gets_a_layout_that_does(tmp_path):
    r = load_recipe(RECIPE, ["checkpoint.path=/nonexistent/dcp", "parallel.ep=1"])
    one = plan(r, nproc_per_node=2).rows["load"][0].peak_bytes
    ep2 = load_recipe(RECIPE, ["checkpoint.path=/nonexistent/dcp", "parallel.ep=2"])
    two = plan(ep2, nproc_per_node=2).rows["load"][0].peak_bytes
    assert two < one
    mem = (one + two) // 2
    out = tmp_path / "plan.json"
    res = run_qckpt(
        "plan", RECIPE, "--nproc-per-node", "2", "--gpu-memory", str(mem),
        "--set", "checkpoint.path=/nonexistent/dcp", "--json", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    load_rows = [ln for ln in res.stdout.splitlines() if ln.startswith("load ")]
    assert load_rows and all("does not fit" in ln for ln in load_rows)
    assert "load: does not fit" in res.stdout
    assert "smallest layout that fits: ep=2,tp=1 (--set parallel.ep=2 --set parallel.tp=1)" in (
        res.stdout
    )
    data = json.loads(out.read_text())
    assert data["fits"]["load"] is False
    assert data["suggestion"]["load"]["ep"] == 2
    assert all(row["peak_bytes"] == one for row in data["commands"]["load"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "0"], "--nnodes: must be >= 1, got 0"),
        (["--gpu-memory", "12XB"], "--gpu-memory: not a size like '141GB' or '139GiB': '12XB'"),
        (["--host-memory", "0GB"], "--host-memory: must be between 1 byte and 1 EiB, got '0GB'"),
        (["--layout", "pp=2"], "--layout 'pp=2': unknown layout key 'pp'"),
        (["--layout", "offload=disk"], "offload must be one of none, layer, host; got 'disk'"),
        (["--layout", "ep=3"], "--layout ep=3,tp=1: ep x tp = 3 does not divide the world size 2"),
        (["--set", "parallel.ep=3"], "parallel.ep: must divide the world size 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["plan", RECIPE, "--nproc-per-node", "2", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_plan_vs_measured_puts_each_rank_beside_its_peak(tmp_path):
    import subprocess
    import sys

    plan_json = {"commands": {"load": [
        {"rank": 0, "peak_bytes": 2**30, "host_bytes": 0},
        {"rank": 1, "peak_bytes": 2**30, "host_bytes": 0},
    ]}}  # fmt: skip
    measured = {
        "peaks": {"device_peak_bytes": 2**30 // 2},
        "runs": [{"ranks": [{"rank": 1, "peaks": {"device_peak_bytes": 2**30}}]}],
    }
    (tmp_path / "p.json").write_text(json.dumps(plan_json))
    (tmp_path / "m.json").write_text(json.dumps(measured))
    script = str(ROOT / "scripts" / "plan_vs_measured.py")
    args = [sys.executable, script, str(tmp_path / "p.json"), "load", str(tmp_path / "m.json")]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout.splitlines()
    assert [ln.split()[1:] for ln in out[1:]] == [
        ["0", "1.00", "0.50", "0.500"],
        ["1", "1.00", "1.00", "1.000"],
    ]
