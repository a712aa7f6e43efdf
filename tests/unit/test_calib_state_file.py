"""The calibration file's own writer: the bytes safetensors writes, read back bit for bit."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from qckpt.calib.state_file import (
    CalibrationState,
    f32_file_bytes,
    load_calibration,
    save_calibration,
)


def _amaxes() -> dict[str, torch.Tensor]:
    nan = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)[0]  # a payload
    return {
        "model.layers.1.mlp.experts.10.down_proj.input_amax": torch.tensor(3.5),
        "model.layers.1.mlp.experts.2.down_proj.input_amax": torch.tensor(-0.0),
        "model.layers.0.self_attn.q_proj.weight_amax": torch.rand(6) * 100,
        "model.layers.0.self_attn.o_proj.weight_amax": torch.rand(3, 2),
        "model.layers.0.mlp.gate_proj.input_amax": nan.clone(),
        "lm_head.input_amax": torch.tensor(1e-30),
        "empty.weight_amax": torch.zeros(0, 4),
        "ünïcode.weight_amax": torch.tensor(2.0),
    }


def test_the_bytes_are_safetensors_own_for_one_metadata_key():
    # one key: safetensors' header order is then fixed, so the whole file must match
    t = _amaxes()
    meta = {"quantizers": json.dumps({"a": {"x": "ü"}, "b": [1, 2]})}
    assert f32_file_bytes(t, meta) == st_save(t, metadata=meta)
    assert f32_file_bytes({}, {}) == st_save({})


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_written_calibration_reads_back_bit_for_bit(tmp_path):
    t = _amaxes()
    state = CalibrationState(
        amax=t,
        quantizers={k: {"calibrated": True, "shape": list(v.shape)} for k, v in t.items()},
        model_type="qwen3_moe",
        model_fingerprint="0123abcd",
        quant={"weights": {"format": "fp8"}},
    )
    path = save_calibration(state, tmp_path / "c.safetensors")
    back = load_calibration(path)
    theirs = st_load(path.read_bytes())  # safetensors' own parser takes the file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["quantizers"]) == state.quantizers
    assert (back.model_type, back.model_fingerprint, back.quant) == (
        "qwen3_moe",
        "0123abcd",
        state.quant,
    )
    assert back.quantizers == state.quantizers
    assert back.amax.keys() == theirs.keys() == t.keys()
    for k, v in t.items():
        for got in (back.amax[k], theirs[k]):
            assert got.dtype == torch.float32 and got.shape == v.shape, k
            assert _bits(got) == _bits(v), k
