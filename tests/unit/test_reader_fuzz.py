"""Fuzzing the checkpoint readers on mutated files (hypothesis, in process).

The safetensors header reader, the index reader and the DCP ``.metadata`` reader are fed real
files with flipped bytes, truncations and generated headers/indexes. Whatever they get, they
either read it (and then every tensor they list can be read, with the shape they said) or raise
a one-line ``CheckpointError`` that names the file: never another exception, never a hang.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from qckpt.errors import CheckpointError
from qckpt.inspect import inspect_path
from qckpt.read.sources import DCPSource, SafetensorsSource
from qckpt.storage import safetensors as stio
from qckpt.storage.dcp_metadata import read_metadata_file

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same cases on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _expect_ok_or_one_line(fn, path: Path) -> bool:
    try:
        fn()
    except CheckpointError as exc:
        msg = str(exc)
        assert "\n" not in msg and "\r" not in msg, msg
        assert msg.startswith(str(path)), (msg, path)
        return False
    return True


def _st_bytes() -> bytes:
    buf = tempfile.mkdtemp()
    try:
        f = Path(buf) / "m.safetensors"
        tensors = {
            "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b.bias": torch.ones(4, dtype=torch.bfloat16),
            "c": torch.tensor(7, dtype=torch.int64),
        }
        save_file(tensors, str(f), metadata={"format": "pt"})
        return f.read_bytes()
    finally:
        shutil.rmtree(buf)


BASE_ST = _st_bytes()

flips = st.lists(
    st.tuples(st.integers(0, len(BASE_ST) - 1), st.integers(0, 255)), min_size=1, max_size=6
)


def _mutate(base: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(base)
    for pos, val in edits:
        b[pos % len(b)] = val
    return bytes(b[:cut] if cut is not None else b)


json_leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=6)
json_value = st.recursive(
    json_leaf | st.floats(allow_nan=False, allow_infinity=False),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)
sizes = st.integers(-2, 2**64) | st.integers(0, 8) | st.sampled_from([0, 2**31, 2**40, 2**63])
entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*stio.DTYPES, "Q4", "", "f32"]) | json_leaf,
        "shape": st.lists(sizes, max_size=3) | json_value,
        "data_offsets": st.lists(sizes, min_size=2, max_size=2) | json_value,
    }
)
header = st.dictionaries(st.text(max_size=8), entry | json_value, max_size=4) | st.dictionaries(
    st.just("__metadata__"), json_value, max_size=1
)


def _check_hf_dir(d: Path) -> None:
    src = SafetensorsSource(d)

    def read_all() -> None:
        for e, t in src.iter_tensors():
            assert tuple(t.shape) == e.shape and t.dtype == e.torch_dtype
        inspect_path(d)

    _expect_ok_or_one_line(read_all, d)


@FUZZ
@given(edits=flips, cut=st.none() | st.integers(0, len(BASE_ST)))
def test_safetensors_bytes_mutated(edits, cut):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "model.safetensors").write_bytes(_mutate(BASE_ST, edits, cut))
        _check_hf_dir(d)


@FUZZ
@given(hdr=header | json_value, data_len=st.integers(0, 64), declared=st.none() | sizes)
def test_safetensors_generated_headers(hdr, data_len, declared):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        raw = json.dumps(hdr).encode()
        n = len(raw) if declared is None else declared % 2**64
        body = struct.pack("<Q", n) + raw + bytes(range(data_len))
        (d / "model.safetensors").write_bytes(body)
        _check_hf_dir(d)


def _shards(d: Path) -> dict[str, str]:
    save_file({"a": torch.ones(2, 2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(d / "model-00002-of-00002.safetensors"))
    return {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


file_names = st.sampled_from(
    [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "gone.safetensors",
        "../model-00001-of-00002.safetensors",
        "",
        ".",
        "sub/x.safetensors",
    ]
)
index_doc = (
    st.fixed_dictionaries(
        {"weight_map": st.dictionaries(st.sampled_from(["a", "b", "c"]), file_names | json_leaf)}
    )
    | st.fixed_dictionaries({"weight_map": json_value, "metadata": json_value})
    | json_value
)


@FUZZ
@given(doc=index_doc, edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255))))
def test_index_mutated(doc, edits):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        _shards(d)
        text = json.dumps(doc).encode()
        (d / stio.INDEX_NAME).write_bytes(_mutate(text, edits, None) if text else text)
        _check_hf_dir(d)


def _dcp_metadata() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        sd = {"w": torch.ones(4, 4, dtype=torch.bfloat16), "n": {"k": torch.arange(3)}}
        dcp.save(sd, checkpoint_id=tmp, no_dist=True)
        return (Path(tmp) / ".metadata").read_bytes()


BASE_MD = _dcp_metadata()


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(BASE_MD) - 1), st.integers(0, 255)), min_size=1, max_size=4
    ),
    cut=st.none() | st.integers(0, len(BASE_MD)),
)
def test_dcp_metadata_mutated(edits, cut):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / ".metadata").write_bytes(_mutate(BASE_MD, edits, cut))
        (d / "__0_0.distcp").write_bytes(b"\0" * 4096)

        def read() -> None:
            read_metadata_file(d / ".metadata")
            for e in DCPSource(d).entries():
                assert isinstance(e.name, str) and all(isinstance(s, int) for s in e.shape)
            inspect_path(d)

        _expect_ok_or_one_line(read, d)


def test_fuzz_inputs_are_real_files():
    """The bases really are what the readers accept (so mutations start from valid files)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "model.safetensors").write_bytes(BASE_ST)
        assert sorted(e.name for e in SafetensorsSource(d).entries()) == ["a.weight", "b.bias", "c"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / ".metadata").write_bytes(BASE_MD)
        (d / "__0_0.distcp").write_bytes(b"\0" * 4096)
        assert {e.name: e.shape for e in DCPSource(d).entries()} == {"w": (4, 4), "n.k": (3,)}
