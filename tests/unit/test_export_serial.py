"""The export's serial parts made fast (planning, headers, index, calibration file, report):
each fast path gives what the plain one gave, byte for byte or value for value.

Shard headers are made as text and the index without json's indenting encoder: the bytes equal
``json.dumps`` of the same objects. The calibration file's one-value amaxes are read as floats
in one go: equal to the tensors' values, and ignored once an entry is replaced. The report's
``seconds`` span the plan and the write, and ``steps`` name where they went.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import pytest
import torch

from qckpt.calib.state_file import CalibrationState, load_calibration, save_calibration
from qckpt.errors import CheckpointError
from qckpt.storage.safetensors import read_header
from qckpt.storage.shards import ShardSpecs, index_text, shard_header, shard_layout
from tests.export_fixtures import make_calibration, quant_config, run_export, saved_model


@dataclass
class _Spec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _specs() -> list[_Spec]:
    return [
        _Spec("a.weight", torch.float8_e4m3fn, (3, 5)),
        _Spec('odd "name" é\\', torch.bfloat16, ()),
        _Spec("b.scale", torch.float32, (1,)),
        _Spec("empty", torch.int64, (0, 4)),
        _Spec("c", torch.uint8, (7,)),
    ]


def _plain_header(specs, metadata) -> bytes:
    """What the header was before: a dict per entry, json.dumps, padded to 8 bytes."""
    head = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for s in specs:
        n = torch.empty(s.shape, dtype=s.dtype).nbytes
        head[s.name] = {
            "dtype": _code(s.dtype),
            "shape": list(s.shape),
            "data_offsets": [off, off + n],
        }
        off += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _code(dtype: torch.dtype) -> str:
    return {
        torch.float8_e4m3fn: "F8_E4M3",
        torch.bfloat16: "BF16",
        torch.float32: "F32",
        torch.int64: "I64",
        torch.uint8: "U8",
    }[dtype]


@pytest.mark.parametrize("metadata", [{}, {"format": "pt", "q": 'x"y'}])
def test_shard_header_bytes_equal_json_dumps_and_read_back(tmp_path, metadata):
    specs = _specs()
    head, offsets = shard_header(tmp_path / "f", specs, metadata)
    assert head == _plain_header(specs, metadata)
    size = offsets[-1] + 7
    (tmp_path / "f").write_bytes(head + b"\0" * (size - len(head)))
    back = read_header(tmp_path / "f")
    assert [(t.name, t.shape, t.begin) for t in back.tensors] == [
        (s.name, s.shape, o) for s, o in zip(specs, offsets, strict=True)
    ]
    # kept on ShardSpecs: made once, and made again when the metadata differs
    kept = ShardSpecs(specs)
    first = shard_layout(tmp_path / "f", kept, metadata)
    assert shard_layout(tmp_path / "f", kept, metadata) is first
    other = shard_layout(tmp_path / "f", kept, {"other": "1"})
    assert other is not first and other.head == _plain_header(specs, {"other": "1"})


def test_index_text_equals_indented_json_dumps():
    for wm in ({}, {"a": "model-00001.safetensors"}, {'x"é': "f1", "b\n": "f2"}):
        want = json.dumps({"metadata": {"total_size": 42}, "weight_map": wm}, indent=2) + "\n"
        assert index_text(42, wm) == want


def test_calibration_floats_equal_the_tensors_and_a_replaced_entry_is_not_trusted(tmp_path):
    amax = {
        "m.0.weight_amax": torch.tensor(1.5),
        "m.0.input_amax": torch.tensor([3.25]),
        "m.1.weight_amax": torch.tensor([0.1, 0.2, 0.3]),  # per channel: no float
    }
    p = save_calibration(CalibrationState(amax=amax, model_type="x"), tmp_path / "c.safetensors")
    cal = load_calibration(p)
    assert cal.float_of("m.0.weight_amax") == float(cal.amax["m.0.weight_amax"]) == 1.5
    assert cal.float_of("m.0.input_amax") == 3.25
    assert cal.float_of("m.1.weight_amax") is None
    cal.amax["m.0.weight_amax"] = torch.tensor(7.0)  # replaced: its file value is stale
    assert cal.float_of("m.0.weight_amax") is None


def test_not_a_calibration_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(CheckpointError, match="not a safetensors calibration file") as e:
        load_calibration(bad)
    assert "\n" not in str(e.value)


def test_export_seconds_span_plan_and_write_and_steps_say_where(tmp_path):
    model, hf = saved_model(tmp_path, "tiny-moe")
    q = quant_config("tensor", "static")
    rep = run_export(model, hf, make_calibration(model, q), tmp_path / "out", q)
    steps = rep.steps
    for k in ("plan", "share", "create", "write", "wait", "check_written", "finish"):
        assert k in steps, steps
    assert {"self_check", "commit"} <= set(steps)
    assert all(v >= 0 for v in steps.values())
    assert sum(steps.values()) <= rep.seconds + 1e-3
    assert steps["plan"] > 0 and steps["write"] > 0


def _st_file(path, entries: dict, metadata: dict) -> None:
    """A safetensors file written by hand: ``entries`` name -> (code, shape, bytes, offset)."""
    head = {"__metadata__": metadata}
    data = b""
    for name, (code, shape, raw, off) in entries.items():
        head[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        data = data.ljust(off, b"\0")[:off] + raw + data[off + len(raw) :]
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_calibration_file_loads_bit_for_bit_as_safetensors_does(tmp_path):
    """float32 files are read as views of one buffer: every tensor equals safetensors' own
    load, bits included (a NaN payload, -0.0), whatever its shape; a file of another dtype,
    or whose data do not tile, goes through safetensors itself (and its error)."""
    from safetensors.torch import load as st_load

    meta = {"qckpt_calibration": "1", "model_type": "x"}
    nan = struct.pack("<I", 0x7FC00123)  # a NaN with a payload
    f32 = {
        "a.weight_amax": ("F32", (), struct.pack("<f", 1.5), 0),
        "a.input_amax": ("F32", (), nan, 4),
        "b.weight_amax": ("F32", (3,), struct.pack("<3f", 0.1, -0.0, 2.0), 8),
        "c.weight_amax": ("F32", (2, 2), struct.pack("<4f", 1, 2, 3, 4), 20),
    }
    bf16 = {**f32, "d.input_amax": ("BF16", (), b"\x80\x3f", 36)}
    for name, entries in (("f32", f32), ("bf16", bf16)):
        p = tmp_path / f"{name}.safetensors"
        _st_file(p, entries, meta)
        got, want = load_calibration(p).amax, st_load(p.read_bytes())
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            bits = got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
            assert torch.equal(*bits), k
        buffers = {t.untyped_storage().data_ptr() for t in got.values()}
        assert len(buffers) == (1 if name == "f32" else len(got))  # the one-buffer path, or not
    gap = dict(f32, **{"c.weight_amax": ("F32", (2, 2), struct.pack("<4f", 1, 2, 3, 4), 24)})
    p = tmp_path / "gap.safetensors"
    _st_file(p, gap, meta)
    with pytest.raises(CheckpointError, match="not a safetensors calibration file") as e:
        load_calibration(p)
    assert "\n" not in str(e.value)
