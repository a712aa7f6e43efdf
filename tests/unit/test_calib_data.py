"""Calibration data: sources, and the split over data ranks that keeps world-size invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qckpt.calib.data import calibration_batches
from qckpt.errors import CalibrationError
from qckpt.recipe import DataConfig


def _all(cfg, world, **kw):
    return [
        b
        for r in range(world)
        for b in calibration_batches(cfg, vocab_size=256, data_rank=r, data_world=world, **kw)
    ]


def _key(batches):
    return sorted(tuple(b.flatten().tolist()) for b in batches)


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_union_over_ranks_is_the_same_batches_for_any_world(world):
    cfg = DataConfig(num_samples=22, seq_len=8, batch_size=4)  # 6 batches, the last one of 2
    one = _all(cfg, 1)
    assert [b.shape[0] for b in one] == [4, 4, 4, 4, 4, 2]
    assert _key(_all(cfg, world)) == _key(one)  # same batches, not just the same samples


def test_synthetic_is_seeded_and_in_vocab():
    cfg = DataConfig(num_samples=8, seq_len=16, batch_size=4)
    a = calibration_batches(cfg, vocab_size=100)
    b = calibration_batches(cfg, vocab_size=100)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert a[0].dtype == torch.long and a[0].shape == (4, 16) and int(a[0].max()) < 100


def test_text_without_tokenizer_uses_bytes_mod_vocab(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("hello world, " * 20)
    cfg = DataConfig(source="text", path=str(p), num_samples=3, seq_len=10, batch_size=2)
    batches = calibration_batches(cfg, vocab_size=50, model_source="tiny-moe")
    flat = torch.cat([b.flatten() for b in batches])
    assert flat.numel() == 30
    assert flat.tolist() == [c % 50 for c in ("hello world, " * 20).encode()[:30]]


@pytest.mark.parametrize("fmt", ["pt", "npy", "txt"])
def test_token_files(tmp_path, fmt):
    ids = torch.arange(40) % 256
    p = tmp_path / f"ids.{fmt}"
    if fmt == "pt":
        torch.save(ids, p)
    elif fmt == "npy":
        np.save(p, ids.numpy())
    else:
        p.write_text(" ".join(map(str, ids.tolist())))
    cfg = DataConfig(source="tokens", path=str(p), num_samples=4, seq_len=10, batch_size=4)
    (b,) = calibration_batches(cfg, vocab_size=256)
    assert torch.equal(b, ids.view(4, 10))


def test_token_ids_out_of_vocab_are_refused(tmp_path):
    p = tmp_path / "ids.txt"
    p.write_text("1 2 3 999 4 5")
    cfg = DataConfig(source="tokens", path=str(p), num_samples=1, seq_len=6, batch_size=1)
    with pytest.raises(CalibrationError, match=r"token ids must be in \[0, 256\)"):
        calibration_batches(cfg, vocab_size=256)


def test_too_little_data_and_missing_file_are_one_line_errors(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("1 2")
    cfg = DataConfig(source="tokens", path=str(p), num_samples=1, seq_len=6, batch_size=1)
    with pytest.raises(CalibrationError, match="fewer than one sample"):
        calibration_batches(cfg, vocab_size=256)
    cfg.path = str(tmp_path / "nope.txt")
    with pytest.raises(CalibrationError, match="not found"):
        calibration_batches(cfg, vocab_size=256)


def test_pickled_token_file_is_not_executed(tmp_path):
    p = tmp_path / "evil.pt"
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran code from the file')",))

    p.write_bytes(pickle.dumps(Boom()))
    cfg = DataConfig(source="tokens", path=str(p), num_samples=1, seq_len=4, batch_size=1)
    with pytest.raises(CalibrationError, match="cannot read token ids"):
        calibration_batches(cfg, vocab_size=256)
