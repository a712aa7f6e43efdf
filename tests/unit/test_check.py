"""``qckpt check``: passes qckpt's exports, names the problem in broken ones, guards export.

Broken exports are made from a good one the way they happen in practice: a scale's bytes
overwritten (NaN, zero), a per-expert scale left out of a shard, a hand-edited ignore list, the
``hf_quant_config.json`` lost in a copy, and qckpt's own old ModelOpt config (a flat
``exclude_modules`` that vLLM does not read, which made vLLM serve garbage).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qckpt.errors import ExportError
from qckpt.layouts import modelopt
from qckpt.layouts.check import check_export
from tests.conftest import run_qckpt
from tests.export_fixtures import make_calibration, quant_config, run_export, saved_model

EXPERT = "model.layers.1.mlp.experts.5"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    model, hf_dir = saved_model(root, "tiny-moe")
    out = {}
    for fmt, kv in (("compressed-tensors", True), ("modelopt", False)):
        q = quant_config("tensor", "static", kv=kv)
        out[fmt] = root / fmt
        run_export(model, hf_dir, make_calibration(model, q), out[fmt], q, fmt=fmt)
    q = quant_config(fmt="nvfp4")
    out["ct-nvfp4"] = root / "ct-nvfp4"
    run_export(model, hf_dir, make_calibration(model, q), out["ct-nvfp4"], q)
    return root, out


def _copy(root: Path, src: Path, name: str) -> Path:
    dst = root / name
    shutil.copytree(src, dst)
    return dst


def _poke(d: Path, tensor: str, value: float) -> None:
    """Overwrite one scalar tensor's bytes in place (its dtype as stored)."""
    f = next(d.glob("*.safetensors"))
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    info = json.loads(raw[8 : 8 + n])[tensor]
    start = 8 + n + info["data_offsets"][0]
    t = torch.tensor(
        [value], dtype=getattr(torch, {"F32": "float32", "BF16": "bfloat16"}[info["dtype"]])
    )
    data = t.view(torch.uint8).numpy().tobytes()
    f.write_bytes(raw[:start] + data + raw[start + len(data) :])


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def test_qckpt_exports_pass(exports):
    _, out = exports
    for fmt, d in out.items():
        res = check_export(d)
        assert res.ok, res.problems
        assert res.layout == fmt.replace("ct-nvfp4", "compressed-tensors")
        assert res.quantized == 8 + 48 and res.experts == 48
    assert check_export(out["ct-nvfp4"]).scheme == "NVFP4 static"
    assert check_export(out["compressed-tensors"]).kv
    r = run_qckpt("check", str(out["modelopt"]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("3 left in high precision)")  # lm_head and two routers


@pytest.mark.parametrize(
    "fmt, name, breakage, expect",
    [
        ("modelopt", "nan", lambda d: _poke(d, f"{EXPERT}.up_proj.weight_scale", float("nan")),
         f"{EXPERT}.up_proj.weight_scale: NaN or Inf scale"),
        ("compressed-tensors", "zero",
         lambda d: _poke(d, "model.layers.0.self_attn.o_proj.input_scale", 0.0),
         "model.layers.0.self_attn.o_proj.input_scale: zero scale"),
        ("compressed-tensors", "zero-kv",
         lambda d: _poke(d, "model.layers.1.self_attn.v_scale", 0.0),
         "model.layers.1.self_attn.v_scale: zero scale"),
        ("modelopt", "ignore", lambda d: _edit_config(d, lambda q: q["ignore"].remove("lm_head")),
         "lm_head: BF16 weight not in the ignore list"),
        ("compressed-tensors", "ignore-q",
         lambda d: _edit_config(d, lambda q: q["ignore"].append("re:.*layers.0.self_attn.q_proj")),
         "model.layers.0.self_attn.q_proj: quantized, but the ignore list names it"),
        ("modelopt", "no-hfq", lambda d: (d / "hf_quant_config.json").unlink(),
         "hf_quant_config.json: missing"),
        ("modelopt", "old-layout",
         lambda d: _edit_config(d, lambda q: q.update(exclude_modules=q.pop("ignore"))),
         "config.json: quantization_config has no 'ignore'"),
        ("ct-nvfp4", "zero-global",
         lambda d: _poke(d, f"{EXPERT}.up_proj.weight_global_scale", 0.0),
         f"{EXPERT}.up_proj.weight_global_scale: zero scale"),
        ("ct-nvfp4", "nan-input-global",
         lambda d: _poke(d, "model.layers.0.self_attn.q_proj.input_global_scale", float("nan")),
         "model.layers.0.self_attn.q_proj.input_global_scale: NaN or Inf scale"),
        ("ct-nvfp4", "group-32",
         lambda d: _edit_config(d, lambda q: q["config_groups"]["group_0"]["weights"].update(
             group_size=32)),
         "config.json: nvfp4-pack-quantized weights 4-bit float group_size 32: not NVFP4"),
    ],
)  # fmt: skip
def test_broken_export_names_the_problem(exports, fmt, name, breakage, expect):
    root, out = exports
    d = _copy(root, out[fmt], f"{fmt}-{name}")
    breakage(d)
    res = check_export(d)
    assert not res.ok
    assert any(p.startswith(expect) for p in res.problems), res.problems


def test_missing_per_expert_scale_via_cli(exports):
    root, out = exports
    d = _copy(root, out["modelopt"], "modelopt-missing")
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(str(shard))
    del tensors[f"{EXPERT}.gate_proj.weight_scale"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    del idx["weight_map"][f"{EXPERT}.gate_proj.weight_scale"]
    index.write_text(json.dumps(idx))
    r = run_qckpt("check", str(d))
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"{d}: 1 problem (modelopt FP8)"
    assert lines[1:] == [f"{EXPERT}.gate_proj: no weight_scale"]


def test_ct_nvfp4_missing_global_scale_is_named(exports):
    root, out = exports
    d = _copy(root, out["ct-nvfp4"], "ct-nvfp4-missing")
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(str(shard))
    del tensors[f"{EXPERT}.down_proj.weight_global_scale"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = d / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    del idx["weight_map"][f"{EXPERT}.down_proj.weight_global_scale"]
    index.write_text(json.dumps(idx))
    res = check_export(d)
    assert res.problems == [f"{EXPERT}.down_proj: no weight_global_scale"], res.problems


def test_export_refuses_to_publish_what_fails_the_check(exports, monkeypatch):
    root, _ = exports
    model, hf_dir = saved_model(root, "tiny-moe")
    q = quant_config("tensor", "static")
    orig = modelopt.ModelOptLayout.quantization_config

    def old_layout(self, ignored):  # what qckpt wrote before: vLLM served it as garbage
        cfg = orig(self, ignored)
        cfg["exclude_modules"] = cfg.pop("ignore")
        return cfg

    monkeypatch.setattr(modelopt.ModelOptLayout, "quantization_config", old_layout)
    target = root / "refused"
    with pytest.raises(
        ExportError, match="failed its own check: config.json: quantization_config has no 'ignore'"
    ):
        run_export(model, hf_dir, make_calibration(model, q), target, q, fmt="modelopt")
    assert not target.exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".refused")]


def test_check_of_something_not_a_directory_is_a_usage_error(tmp_path):
    r = run_qckpt("check", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "nope: not a directory" in r.stderr


def test_modelopt_export_described_by_hf_quant_config_alone(exports):
    """Older ModelOpt exports have no quantization_config in config.json; vLLM reads the file."""
    root, out = exports
    d = _copy(root, out["modelopt"], "modelopt-legacy")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert check_export(d).ok, check_export(d).problems
    (d / "hf_quant_config.json").unlink()
    assert check_export(d).problems == [
        "config.json: no quantization_config: not a quantized export"
    ]


def test_bulk_scale_test_gives_the_one_by_one_problems_in_order(exports, monkeypatch):
    """The one-value scales are read and tested together (one pread per run of nearby scales):
    several bad ones, of each kind, give the messages and the order that testing each scale
    where it is met gives (the bulk test turned off)."""
    import qckpt.layouts.check as check

    root, out = exports
    d = _copy(root, out["compressed-tensors"], "ct-many-bad")
    _poke(d, f"{EXPERT}.up_proj.weight_scale", float("nan"))
    _poke(d, "model.layers.0.self_attn.o_proj.input_scale", 0.0)
    _poke(d, "model.layers.1.self_attn.v_scale", -1.0)
    _poke(d, "model.layers.1.mlp.experts.0.down_proj.weight_scale", float("inf"))
    _edit_config(d, lambda q: q["ignore"].append("re:.*layers.0.self_attn.q_proj"))
    bulk = check_export(d).problems
    monkeypatch.setattr(check, "_ONE_VALUE", {})  # every scale tested where it is met
    one_by_one = check_export(d).problems
    assert bulk == one_by_one
    assert len(bulk) == 5 and any("negative scale" in p for p in bulk), bulk


def test_a_fifo_in_place_of_a_shard_is_named_not_waited_on(exports):
    """``qckpt check`` opens a shard only if it is a regular file: a FIFO under a shard's name
    (nothing ever writes to it) is a named problem within the command's time, not a hang."""
    import os

    root, out = exports
    d = _copy(root, out["compressed-tensors"], "ct-fifo")
    shard = next(d.glob("*.safetensors"))
    shard.unlink()
    os.mkfifo(shard)
    r = run_qckpt("check", str(d), timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{shard.name}: unreadable safetensors header" in r.stdout
    assert "not a regular file" in r.stdout, r.stdout


def test_the_calibration_record_of_a_fifo_is_none_not_a_wait(tmp_path):
    import os
    import threading

    from qckpt.export.model_record import peek

    fifo = tmp_path / "calib.safetensors"
    os.mkfifo(fifo)
    got: list = []
    # in a daemon thread: a regression blocks that thread in open(), and the test fails
    t = threading.Thread(target=lambda: got.append(peek(fifo)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "peek waited on a FIFO"
    assert got == [None]
