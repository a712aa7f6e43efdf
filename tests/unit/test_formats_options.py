"""Each format's options: a frozen dataclass with the format's defaults, checked like a recipe
section (an unknown key is named with the known ones), stored on the tensor as a plain dict."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qckpt.errors import FormatError
from qckpt.formats import FORMATS, quantize


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_declares_frozen_options_with_defaults(fmt):
    spec = FORMATS[fmt]
    opts = spec.Options()
    assert dataclasses.is_dataclass(opts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opts, dataclasses.fields(opts)[0].name, None)
    q = quantize(torch.randn(32, 64), fmt)
    assert q.opts == {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_unknown_option_is_named_with_the_known_ones(fmt):
    with pytest.raises(FormatError) as e:
        quantize(torch.randn(32, 64), fmt, dtpye=torch.float8_e4m3fn)
    msg = str(e.value)
    assert msg.startswith(f"{fmt}: unknown options ['dtpye']")
    known = ", ".join(FORMATS[fmt].Options.__dataclass_fields__)
    assert msg.endswith(f"(known: {known})")
    if "dtype" in known:
        assert "did you mean 'dtype'?" in msg


@pytest.mark.parametrize(
    ("fmt", "opts", "match"),
    [
        ("fp8", {"granularity": "block"}, "fp8: granularity must be 'tensor' or 'channel'"),
        ("fp8", {"dtype": "int8"}, "unsupported fp8 dtype"),
        ("fp8_delayed", {"history_len": 0}, "fp8_delayed: history_len must be >= 1"),
        ("fp8_delayed", {"granularity": "channel"}, "fp8_delayed: only per-tensor"),
        ("fp8_block", {"block_size": (0, 4)}, "fp8_block: block_size must be two positive"),
        ("mxfp8", {"block_size": 16}, "mxfp8: block_size is 32"),
        ("nvfp4", {"block_size": 32}, "nvfp4: block_size is 16"),
    ],
)
def test_a_bad_value_is_refused_by_its_format(fmt, opts, match):
    with pytest.raises(FormatError, match=match):
        quantize(torch.randn(32, 64), fmt, **opts)


def test_options_are_normalized():
    q = quantize(torch.randn(32, 64), "fp8_block", block_size=16, dtype="e5m2", pow2_scale=1)
    assert q.opts == {"dtype": torch.float8_e5m2, "block_size": (16, 16), "pow2_scale": True}
    # a caller's granularity is accepted where the format's layout fixes it
    assert quantize(torch.randn(32, 64), "mxfp8", granularity="block").opts["block_size"] == 32
