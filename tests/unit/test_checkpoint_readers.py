"""Checkpoint readers on hostile dirs: no hang on a FIFO, one line naming the file for every
corrupt or truncated piece, a torch-free ``inspect`` of HF dirs, and ``convert --to hf``
carrying the tokenizer files the way export does."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from qckpt.convert.dcp import save_model_dcp
from qckpt.errors import CheckpointError
from qckpt.inspect import inspect_path
from qckpt.load.loader import load_checkpoint
from qckpt.read.readers import iter_checkpoint_tensors, open_source
from qckpt.read.sources import SafetensorsSource
from qckpt.storage import safetensors as stio
from qckpt.storage.model_files import CARRY_FILES
from tests.conftest import ROOT, run_qckpt
from tests.unit.test_load import Toy

pytestmark = pytest.mark.timeout(120)  # a reader that blocks on a FIFO fails, it never hangs


def _hf_dir(path, sharded=False):
    path.mkdir()
    a = {"a.weight": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}
    b = {"b.bias": torch.ones(5, dtype=torch.float32)}
    if sharded:
        save_file(a, str(path / "model-00001-of-00002.safetensors"))
        save_file(b, str(path / "model-00002-of-00002.safetensors"))
        wm = {"a.weight": "model-00001-of-00002.safetensors"}
        wm["b.bias"] = "model-00002-of-00002.safetensors"
        (path / stio.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file({**a, **b}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def _one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qckpt: error: "), err
    assert "Traceback" not in err and "QCKPT_DEBUG" not in err, err  # an expected failure
    for n in needles:
        assert n in err, err
    return err


def _raw_header(path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# ---- FIFOs and other non-regular files -----------------------------------------------------


def test_fifo_in_checkpoint_dirs_is_refused_not_waited_on(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    (hf / "model.safetensors").unlink()
    os.mkfifo(hf / "model.safetensors")
    r = run_qckpt("inspect", str(hf), timeout=60)
    _one_line_error(r, "model.safetensors: not a regular file (a FIFO)")

    # a FIFO config.json, .metadata or data file: refused in process too, never opened blocking
    hf2 = _hf_dir(tmp_path / "hf2")
    (hf2 / "config.json").unlink()
    os.mkfifo(hf2 / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json: not a regular file \(a FIFO\)"):
        inspect_path(hf2)
    d = tmp_path / "dcp"
    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(d), no_dist=True)
    data = next(d.glob("*.distcp"))
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(CheckpointError, match=r"\.distcp: not a regular file \(a FIFO\)"):
        load_checkpoint(Toy(), d)
    (d / ".metadata").unlink()
    os.mkfifo(d / ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata: not a regular file \(a FIFO\)"):
        inspect_path(d)


def test_fifo_that_is_no_checkpoint_file_is_ignored(tmp_path):
    hf = _hf_dir(tmp_path / "hf", sharded=True)
    os.mkfifo(hf / "notes.safetensors")  # not in the index: never opened
    os.mkfifo(hf / "README")
    info = inspect_path(hf)
    assert info["tensors"] == 2 and info["files"] == 2 and info["index"] is True


# ---- corrupt and truncated files: one line naming the file ---------------------------------


def test_truncated_distcp_names_the_file(tmp_path):
    d = tmp_path / "dcp"
    save_model_dcp(Toy(seed=1), d)
    data = max(d.glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    want = f"{data}: truncated: the DCP metadata needs {size} bytes, the file has {size // 2}"
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(Toy(), d)
    assert str(ei.value) == want
    with pytest.raises(CheckpointError, match="truncated"):
        list(iter_checkpoint_tensors(d))
    r = run_qckpt("inspect", str(d), timeout=120)
    _one_line_error(r, want)


def test_corrupt_index_config_and_headers_are_one_line_each(tmp_path):
    hf = _hf_dir(tmp_path / "hf", sharded=True)
    (hf / stio.INDEX_NAME).write_text('{"weight_map": {"a.weight": ')
    _one_line_error(run_qckpt("inspect", str(hf)), "model.safetensors.index.json: corrupt")

    cfg = _hf_dir(tmp_path / "cfg")
    (cfg / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match=r"config\.json: corrupt model config \(Expect"):
        inspect_path(cfg)

    lst = tmp_path / "list.safetensors"
    _raw_header(lst, [1, 2, 3])
    _one_line_error(
        run_qckpt("inspect", str(lst)), f"{lst}: safetensors header is a JSON list, not an object"
    )

    past = tmp_path / "past.safetensors"
    _raw_header(past, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(
        CheckpointError, match=r"tensor w: data ends at byte \d+, past the end of the file"
    ):
        inspect_path(past)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}, "16 bytes of data for shape [3]"),
        ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}, "unsupported dtype Q4"),
        ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "is not a list of sizes"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "are not [begin, end]"),
        ([1], "header entry is not an object"),
        ({"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}, "too large"),
    ],
)
def test_header_validation(tmp_path, entry, says):
    f = tmp_path / "x.safetensors"
    _raw_header(f, {"w": entry}, b"\0" * 16)
    with pytest.raises(CheckpointError) as ei:
        stio.read_header(f)
    assert str(ei.value).startswith(f"{f}: tensor w: ") and says in str(ei.value)


def test_index_naming_missing_or_outside_files_is_refused(tmp_path):
    hf = _hf_dir(tmp_path / "hf", sharded=True)
    index = hf / stio.INDEX_NAME
    good = json.loads(index.read_text())
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "c": "../../etc/x"}}))
    with pytest.raises(CheckpointError, match="which is not in its directory"):
        SafetensorsSource(hf).entries()
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "c": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists gone.safetensors, which does not exist"):
        SafetensorsSource(hf).entries()
    wm = dict(good["weight_map"], **{"b.bias": "model-00001-of-00002.safetensors"})
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="maps b.bias to model-00001-of-00002"):
        SafetensorsSource(hf).entries()


# ---- one source abstraction ----------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_source_entries_are_metadata_and_reads_stream(tmp_path, sharded):
    hf = _hf_dir(tmp_path / "hf", sharded=sharded)
    src = open_source(hf)
    es = src.entries()
    assert sorted((e.name, e.dtype, e.shape) for e in es) == [
        ("a.weight", "BF16", (3, 4)),
        ("b.bias", "F32", (5,)),
    ]
    assert all(e.stored_dtype == e.dtype and e.scales == () for e in es)
    got = dict((e.name, t) for e, t in src.iter_tensors())
    assert torch.equal(got["a.weight"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    assert torch.equal(got["b.bias"], torch.ones(5))
    d = tmp_path / "dcp"
    dcp.save(got, checkpoint_id=str(d), no_dist=True)
    dsrc = open_source(d)
    assert {(e.name, e.dtype, e.shape) for e in dsrc.entries()} == {
        (e.name, e.dtype, e.shape) for e in es
    }
    assert all(torch.equal(t, got[e.name]) for e, t in dsrc.iter_tensors())


def test_inspect_of_hf_dir_does_not_import_torch(tmp_path):
    hf = _hf_dir(tmp_path / "hf", sharded=True)
    cal = tmp_path / "calib.safetensors"
    meta = {"qckpt_calibration": "1", "model_type": "llama", "quant": "{}", "quantizers": "{}"}
    save_file({"m.weight_amax": torch.tensor(2.5), "m.input_amax": torch.zeros(())}, str(cal),
              metadata=meta)  # fmt: skip
    code = (
        "import sys\nfrom qckpt.cli.app import main\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n        main(['inspect', p])\n    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(hf), str(cal)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stderr
    assert "TORCH False" in r.stdout and "amax_max" in r.stdout and "2.5" in r.stdout
    info = inspect_path(cal)
    assert info["zero_amax"] == ["m.input_amax"] and info["amax_max"] == 2.5


# ---- convert --to hf carries the model's small files -----------------------------------------


def test_convert_to_hf_carries_tokenizer_generation_and_chat_files(tmp_path):
    from qckpt.models.build import build_model

    model = build_model("tiny-dense", seed=3)
    d = tmp_path / "dcp"
    save_model_dcp(model, d)
    (d / "config.json").write_text(model.config.to_json_string())
    for name in CARRY_FILES:
        (d / name).write_text(f"{name} of the source\n")
    os.mkfifo(d / "tokenizer.model.fifo")  # not a carried name, and never opened
    r = run_qckpt("convert", str(d), str(tmp_path / "hf"), "--to", "hf")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "hf"
    for name in CARRY_FILES:
        assert (out / name).read_text() == f"{name} of the source\n"
    assert not (out / "tokenizer.model.fifo").exists()
    assert stio.list_files(out) == ["model.safetensors"]


def test_plain_dir_check_knows_every_quantization_parameter_name(tmp_path):
    """A dir whose only sign of quantization is a parameter's name is not taken for plain:
    the torch-free check and the layout detection read the one list of names."""
    import torch
    from safetensors.torch import save_file

    from qckpt.layouts.names import PARAM_SUFFIXES

    for i, suffix in enumerate(PARAM_SUFFIXES):
        d = tmp_path / str(i)
        d.mkdir()
        leaf = suffix if suffix.startswith("weight_") else f"input{suffix}"
        tensors = {"a.weight": torch.zeros(2, 2), f"a.{leaf}": torch.ones(1)}
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match="unknown quantized layout"):
            SafetensorsSource(d).layout()


def test_quantized_source_entries_report_stored_dtype_scales_and_bytes(tmp_path):
    from tests import quantized_fixtures as fx

    src = fx.bf16_dir(tmp_path, source="tiny-dense")
    q = SafetensorsSource(fx.blockwise_fp8(src, tmp_path / "bw", (32, 32)))
    stored = {e.name: e for e in q.stored()}
    quantized = [e for e in q.entries() if e.scales]
    assert quantized and all(e.dtype == "F32" and e.stored_dtype == "F8_E4M3" for e in quantized)
    for e in quantized:  # what reading it costs: the codes plus their scales, as stored
        assert e.nbytes == stored[e.name].nbytes + sum(stored[s].nbytes for s in e.scales)
        assert not any(n in {x.name for x in q.entries()} for n in e.scales)
    e = quantized[0]
    assert tuple(q.read(e).shape) == e.shape and q.read(e).dtype == torch.float32
