"""The compressed-tensors NVFP4 layout refuses, in one line, what it cannot write (its exports are
checked end to end in tests/e2e/test_ct_nvfp4_export.py)."""

from __future__ import annotations

import pytest
import torch

from tests.export_fixtures import quant_config


def _nvfp4_quant():
    q = quant_config(fmt="nvfp4")
    q.ignore = ["lm_head", "*.mlp.gate"]
    return q


def test_ct_nvfp4_refuses_what_it_cannot_write():
    from qckpt import ExportError
    from qckpt.errors import SchemeError
    from qckpt.layouts.registry import make_layout

    q = quant_config(fmt="nvfp4", inputs="token")  # dynamic NVFP4 inputs: no global input scale
    with pytest.raises(SchemeError, match="writes NVFP4 .* inputs nvfp4 static or none"):
        make_layout("compressed-tensors", q, torch.bfloat16)
    layout = make_layout("compressed-tensors", _nvfp4_quant(), torch.bfloat16)
    with pytest.raises(ExportError, match=r"^m: NVFP4 needs the input dim divisible by 16, got 40"):
        layout.linear_specs("m", (32, 40))
