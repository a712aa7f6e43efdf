"""The streamed safetensors writer (GPTQ's sidecar under calibrate.offload): a file that the
safetensors library and qckpt's own header reader read back with every tensor's values, and a
header larger than the room announced is refused, not written past the data."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qckpt.storage.safetensors import read_header
from qckpt.storage.safetensors_stream import StreamWriter, TooManyTensors


def test_tensors_written_one_by_one_read_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    want = {
        "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(5, 7, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.3.down_proj.weight_block_scale": torch.rand(5, 1).half(),
        "b.odd": torch.arange(3, dtype=torch.uint8),  # an odd byte count before a float32
        "c.f32": torch.randn(2, 3, generator=g),
        "d.scalar": torch.tensor(2.5),
    }
    path = tmp_path / "s.safetensors"
    with open(path, "wb") as f:
        w = StreamWriter(f, [*want, "announced.but.never.written"])
        for k, v in want.items():
            w.add(k, v)
        w.finish({"format": "pt"})
    got = load_file(str(path))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert {t.name for t in read_header(path).tensors} == set(want)


def test_a_name_not_announced_can_overflow_the_room(tmp_path):
    with open(tmp_path / "s.safetensors", "wb") as f:
        w = StreamWriter(f, ["a"])
        for i in range(8):
            w.add(f"a-much-longer-name-than-announced-{i}" * 4, torch.zeros(2))
        with pytest.raises(TooManyTensors, match="reserved"):
            w.finish()
        with pytest.raises(ValueError, match="written twice"):
            w.add("a-much-longer-name-than-announced-0" * 4, torch.zeros(2))
